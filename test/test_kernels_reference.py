"""The torch references (CPU path and kernel oracle) against independent naive formulations.

Why: the Triton kernels are only as right as the reference they are compared with. Here the reference's gather +
masked-softmax form is checked against a dense softmax over the whole storage with the sink as an appended column,
and the compression against a per-entry loop with RoPE done as complex multiplication. Inputs are fresh each run;
the seed is in every failure message.
"""
from __future__ import annotations

import os

import pytest
import torch

from sgl_kernel_ext import ops
from sgl_kernel_ext.cases import attention_case, compress_case, rel_err, window_case
from sgl_kernel_ext.reference import (
    compress_entries_ref,
    tree_sparse_attention_ref,
    tree_window_attention_ref,
)


@pytest.fixture
def seed() -> int:
    value = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(value)
    return value


def naive_attention(q, kv_a, idx_a, kv_b, idx_b, sink, scale) -> torch.Tensor:
    """Per node: dense logits over [kv_a; kv_b], -inf where not listed, sink column appended, torch.softmax."""
    keys = kv_a.double()
    lists = [idx_a.long()]
    if kv_b is not None:
        keys = torch.cat([keys, kv_b.double()])
        lists.append(torch.where(idx_b >= 0, idx_b.long() + kv_a.shape[0], -1))
    out = torch.zeros(q.shape, dtype=torch.float64)
    for n in range(q.shape[0]):
        visible = torch.zeros(keys.shape[0], dtype=torch.bool)
        for lst in lists:
            rows = lst[n][lst[n] >= 0]
            visible[rows] = True
        logits = (q[n].double() @ keys.T) * scale
        logits = logits.masked_fill(~visible, float("-inf"))
        logits = torch.cat([logits, sink.double()[:, None]], dim=1)
        probs = torch.softmax(logits, dim=1)[:, :-1]
        out[n] = probs @ keys
    return out


def naive_compress(kv_store, score_store, idx, col_off, ape, norm_w, eps, cos, sin) -> torch.Tensor:
    """Per entry: stack the non-empty slots, softmax per channel, pool, RMSNorm, RoPE as z * e^{i angle}."""
    width = ape.shape[1]
    out = torch.zeros(idx.shape[0], width, dtype=torch.float64)
    for e in range(idx.shape[0]):
        values, logits = [], []
        for j in range(idx.shape[1]):
            row = int(idx[e, j])
            if row < 0:
                continue
            c0 = int(col_off[j])
            values.append(kv_store[row, c0 : c0 + width].double())
            logits.append(score_store[row, c0 : c0 + width].double() + ape[j].double())
        if not values:
            continue
        weights = torch.softmax(torch.stack(logits), dim=0)
        pooled = (weights * torch.stack(values)).sum(dim=0)
        y = pooled / torch.sqrt(pooled.pow(2).mean() + eps) * norm_w.double()
        if cos is not None:
            rd = 2 * cos.shape[1]
            pairs = torch.view_as_complex(y[width - rd :].reshape(-1, 2).contiguous())
            turn = torch.complex(cos[e].double(), sin[e].double())
            y[width - rd :] = torch.view_as_real(pairs * turn).flatten()
        out[e] = y
    return out


ATTENTION_SHAPES = [
    # n_nodes, heads, dim, t_a, t_b, empty_nodes
    (1, 4, 64, 8, 0, ()),
    (5, 4, 64, 12, 6, (2,)),
    (3, 8, 32, 0, 7, ()),
    (4, 4, 64, 9, 5, (0, 3)),
    (2, 64, 512, 128, 64, ()),
    (2, 4, 16, 0, 0, ()),  # zero-width lists: only the sink
]


@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_attention_reference_matches_dense_softmax_with_sink_column(shape, seed):
    n_nodes, heads, dim, t_a, t_b, empty = shape
    case = attention_case(n_nodes, heads, dim, t_a, t_b, empty_nodes=empty)
    got = tree_sparse_attention_ref(**case)
    want = naive_attention(**case)
    assert rel_err(got, want) <= 1e-5, f"seed={seed}"
    for n in empty:
        assert torch.all(got[n] == 0), f"node {n} has no rows, only the sink: output must be 0 (seed={seed})"


def test_attention_reference_bf16_inputs(seed):
    case = attention_case(4, 4, 64, 16, 8, dtype=torch.bfloat16)
    got = tree_sparse_attention_ref(**case)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, naive_attention(**case)) <= 1e-2, f"seed={seed}"


COMPRESS_SHAPES = [
    # n_entries, kind, width, ratio, rope_dims, empty_prev_window, empty_entries
    (1, "hca", 64, 8, 16, (), ()),
    (6, "csa", 64, 4, 16, (0,), ()),
    (5, "csa", 32, 4, 8, (1,), (3,)),  # the indexer's compressor: same op, smaller C
    (3, "hca", 16, 4, 0, (), ()),
    (2, "hca", 512, 128, 64, (), ()),
]


@pytest.mark.parametrize("shape", COMPRESS_SHAPES)
def test_compress_reference_matches_per_entry_loop(shape, seed):
    n_entries, kind, width, ratio, rope_dims, prev_empty, all_empty = shape
    case = compress_case(n_entries, kind, width, ratio, rope_dims, empty_prev_window=prev_empty,
                         empty_entries=all_empty)
    got = compress_entries_ref(**case)
    assert rel_err(got, naive_compress(**case)) <= 1e-5, f"seed={seed}"
    for e in all_empty:
        assert torch.all(got[e] == 0), f"seed={seed}"


@pytest.mark.parametrize("batch,nodes,heads,dim,window", [(1, 1, 4, 64, 8), (3, 6, 4, 64, 16), (2, 8, 8, 32, 5)])
def test_window_reference_matches_dense_softmax(batch, nodes, heads, dim, window, seed):
    case = window_case(batch, nodes, heads, dim, window)
    got = tree_window_attention_ref(**case)
    want = torch.zeros(got.shape, dtype=torch.float64)
    mask_start = 0
    for b in range(batch):
        q0, q1 = int(case["qo_indptr"][b]), int(case["qo_indptr"][b + 1])
        k0, k1 = int(case["kv_indptr"][b]), int(case["kv_indptr"][b + 1])
        block = case["mask"][mask_start : mask_start + (q1 - q0) * (k1 - k0)].view(q1 - q0, k1 - k0)
        mask_start += block.numel()
        keys = case["kv"][case["kv_indices"][k0:k1].long()].double()
        logits = torch.einsum("nhd,kd->nhk", case["q"][q0:q1].double(), keys) * case["scale"]
        logits = logits.masked_fill(~block[:, None, :], float("-inf"))
        sink_col = case["sink"].double().view(1, -1, 1).expand(q1 - q0, -1, 1)
        probs = torch.softmax(torch.cat([logits, sink_col], dim=2), dim=2)[..., :-1]
        want[q0:q1] = torch.einsum("nhk,kd->nhd", probs, keys)
    assert rel_err(got, want) <= 1e-5, f"seed={seed}"


def test_mask_to_index_lists_matches_loop(seed):
    case = window_case(3, 5, 2, 16, 6)
    lists = ops.tree_mask_to_index_lists(case["qo_indptr"], case["kv_indptr"], case["kv_indices"], case["mask"])
    mask_start = 0
    for b in range(3):
        q0, q1 = int(case["qo_indptr"][b]), int(case["qo_indptr"][b + 1])
        k0, k1 = int(case["kv_indptr"][b]), int(case["kv_indptr"][b + 1])
        block = case["mask"][mask_start : mask_start + (q1 - q0) * (k1 - k0)].view(q1 - q0, k1 - k0)
        mask_start += block.numel()
        for i in range(q1 - q0):
            want = sorted(int(s) for s, m in zip(case["kv_indices"][k0:k1], block[i], strict=False) if m)
            got = sorted(int(s) for s in lists[q0 + i] if s >= 0)
            assert got == want, f"seed={seed}"


def test_dispatcher_uses_reference_on_cpu(seed, monkeypatch):
    monkeypatch.delenv("SGL_KERNEL_EXT_BACKEND", raising=False)
    case = attention_case(3, 4, 64, 8, 4)
    assert torch.equal(ops.tree_sparse_attention(**case), tree_sparse_attention_ref(**case))
    comp = compress_case(3, "csa", 32, 4, 8)
    assert torch.equal(ops.compress_entries(**comp), compress_entries_ref(**comp))
    win = window_case(2, 4, 4, 32, 6)
    assert torch.equal(ops.tree_window_attention(**win), tree_window_attention_ref(**win))


def test_dispatcher_rejects_bad_arguments():
    case = attention_case(2, 4, 64, 8, 4)
    with pytest.raises(ValueError):
        ops.tree_sparse_attention(**{**case, "sink": case["sink"][:2]})
    with pytest.raises(ValueError):
        ops.tree_sparse_attention(**{**case, "idx_b": None})
    with pytest.raises(ValueError):
        ops.tree_sparse_attention(**case, backend="cuda-please")
    comp = compress_case(2, "hca", 16, 4, 8)
    with pytest.raises(ValueError):
        ops.compress_entries(**{**comp, "col_off": comp["col_off"][:1]})
