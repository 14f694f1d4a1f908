"""The FlashInfer tree-mask wrapper's plumbing, checked on the CPU.

Why: FlashInfer runs only on a GPU, but most of what can go wrong in the wrapper is ours: the paged view with page
size 1, the indptr / last-page-length arguments, the flattened mask layout, and the sink applied afterwards from
the log-sum-exp. Here FlashInfer's wrapper class is replaced by a small stand-in that implements the documented
contract of `BatchPrefillWithPagedKVCacheWrapper.plan/run` (custom boolean mask, natural-log LSE when asked), and the
wrapper's result is compared with the reference. A second test checks that the installed FlashInfer really has the
parameters the wrapper passes.
"""
from __future__ import annotations

import inspect
import os
import sys
import types

import pytest
import torch

from sgl_kernel_ext import flashinfer_tree
from sgl_kernel_ext.cases import rel_err, window_case
from sgl_kernel_ext.reference import tree_window_attention_ref


class _DocumentedPagedPrefill:
    """Stand-in for flashinfer.BatchPrefillWithPagedKVCacheWrapper following its documented semantics (NHD)."""

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD") -> None:
        assert kv_layout == "NHD"

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, custom_mask=None, sm_scale=None, q_data_type=None,
             kv_data_type=None, **unused) -> None:
        assert not unused, f"unexpected plan arguments {sorted(unused)}"
        self.args = dict(qo=qo_indptr.long(), kv=paged_kv_indptr.long(), pages=paged_kv_indices.long(),
                         last=paged_kv_last_page_len.long(), heads=num_qo_heads, kv_heads=num_kv_heads,
                         dim=head_dim_qk, page_size=page_size, mask=custom_mask, scale=sm_scale)
        for t in (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):
            assert t.dtype == torch.int32

    def run(self, q, paged_kv_cache, return_lse=False, lse_base="log2"):
        a = self.args
        k_cache, v_cache = paged_kv_cache
        assert k_cache.shape[1:] == (a["page_size"], a["kv_heads"], a["dim"]) and q.shape[1] == a["heads"]
        out = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
        mask_start = 0
        for b in range(a["qo"].numel() - 1):
            pages = a["pages"][a["kv"][b] : a["kv"][b + 1]]
            kv_len = (pages.numel() - 1) * a["page_size"] + int(a["last"][b])
            keys = k_cache[pages].reshape(-1, a["kv_heads"], a["dim"])[:kv_len, 0].double()
            values = v_cache[pages].reshape(-1, a["kv_heads"], a["dim"])[:kv_len, 0].double()
            q0, q1 = int(a["qo"][b]), int(a["qo"][b + 1])
            block = a["mask"][mask_start : mask_start + (q1 - q0) * kv_len].view(q1 - q0, 1, kv_len)
            mask_start += (q1 - q0) * kv_len
            logits = torch.einsum("nhd,kd->nhk", q[q0:q1].double(), keys) * a["scale"]
            logits = logits.masked_fill(~block, float("-inf"))
            out[q0:q1] = torch.softmax(logits, dim=-1) @ values
            lse[q0:q1] = torch.logsumexp(logits, dim=-1)
        if lse_base == "log2":
            lse = lse / torch.log(torch.tensor(2.0, dtype=torch.float64))
        out = out.to(q.dtype)
        return (out, lse.float()) if return_lse else out


@pytest.fixture
def seed() -> int:
    value = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(value)
    return value


@pytest.mark.parametrize("batch,nodes,heads,dim,window", [(1, 1, 4, 64, 8), (3, 6, 4, 64, 16), (2, 8, 8, 32, 5)])
def test_wrapper_matches_reference_through_documented_flashinfer(batch, nodes, heads, dim, window, seed,
                                                                  monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithPagedKVCacheWrapper = _DocumentedPagedPrefill
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(flashinfer_tree, "_wrappers", {})
    case = window_case(batch, nodes, heads, dim, window)
    got = flashinfer_tree.tree_window_attention_flashinfer(**case)
    assert rel_err(got, tree_window_attention_ref(**case)) <= 1e-5, f"seed={seed}"


def test_installed_flashinfer_has_the_parameters_the_wrapper_uses():
    flashinfer = pytest.importorskip("flashinfer")
    cls = flashinfer.BatchPrefillWithPagedKVCacheWrapper
    plan = inspect.signature(cls.plan).parameters
    run = inspect.signature(cls.run).parameters
    positional = list(plan)[1:9]
    assert positional == ["qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len",
                          "num_qo_heads", "num_kv_heads", "head_dim_qk", "page_size"], positional
    for name in ("custom_mask", "sm_scale", "q_data_type", "kv_data_type"):
        assert name in plan, name
    for name in ("return_lse", "lse_base"):
        assert name in run, name
    assert "kv_layout" in inspect.signature(cls.__init__).parameters
