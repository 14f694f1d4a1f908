"""Random inputs shaped like V4 verification traffic, shared by the kernel tests and `benchmark/gpu_kernels.py`.

Why here and not in the tests: the benchmark checks every kernel against its reference on the same kind of inputs
the tests use, so both build them from one place. Every builder draws from torch's global generator (seed it for
a reproducible case) and returns the op's keyword arguments.
"""
from __future__ import annotations

import math

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in fp64 (NaN stays NaN, so an unwritten poisoned element fails any bound)."""
    diff = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    scale = ref.double().abs().max().item() if ref.numel() else 0.0
    return diff / max(scale, 1e-30) if scale > 0 else diff


def _index_lists(n_rows: int, width: int, n_store: int, ragged: bool, device) -> torch.Tensor:
    """[n_rows, width] int32 lists of distinct storage rows, -1 padded at random places (ragged) or full."""
    idx = torch.full((n_rows, width), -1, dtype=torch.int32)
    for r in range(n_rows):
        count = int(torch.randint(0, width + 1, ())) if ragged else width
        rows = torch.randperm(n_store)[:count].to(torch.int32)
        where = torch.randperm(width)[:count] if ragged else torch.arange(count)
        idx[r, where] = rows
    return idx.to(device)


def _strided_rows(n_store: int, dim: int, pad: int, dtype, device) -> torch.Tensor:
    """[n_store, dim] view into a wider row (other per-slot data on both sides), as the model's pools hold it."""
    wide = torch.randn(n_store, dim + 2 * pad, dtype=torch.float32, device=device).to(dtype)
    return wide[:, pad : pad + dim]


def attention_case(
    n_nodes: int,
    heads: int,
    dim: int,
    t_a: int,
    t_b: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    ragged: bool = True,
    empty_nodes: tuple[int, ...] = (),
    pad: int = 8,
) -> dict:
    """Inputs of tree_sparse_attention: raw-KV source a (t_a per node), compressed source b (t_b; 0 = no source)."""
    n_a, n_b = max(2 * t_a, 8), max(2 * t_b, 8)
    q = torch.randn(n_nodes, heads, dim, device=device).to(dtype)
    kv_a = _strided_rows(n_a, dim, pad, dtype, device)
    idx_a = _index_lists(n_nodes, t_a, n_a, ragged, device)
    kv_b = idx_b = None
    if t_b > 0:
        kv_b = _strided_rows(n_b, dim, pad, dtype, device)
        idx_b = _index_lists(n_nodes, t_b, n_b, ragged, device)
    for n in empty_nodes:
        idx_a[n] = -1
        if idx_b is not None:
            idx_b[n] = -1
    sink = torch.randn(heads, device=device)
    return dict(q=q, kv_a=kv_a, idx_a=idx_a, kv_b=kv_b, idx_b=idx_b, sink=sink, scale=dim**-0.5)


def rope_cos_sin(positions: torch.Tensor, rope_dims: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[E, rope_dims/2]` of plain RoPE at the given positions (any table works for the op)."""
    inv_freq = theta ** (-torch.arange(0, rope_dims, 2, dtype=torch.float64, device=positions.device) / rope_dims)
    angles = positions.double()[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def compress_case(
    n_entries: int,
    kind: str,
    width: int,
    ratio: int,
    rope_dims: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    n_store: int | None = None,
    empty_prev_window: tuple[int, ...] = (),
    empty_entries: tuple[int, ...] = (),
) -> dict:
    """Inputs of compress_entries.

    kind "hca": R = ratio slots reading row columns [0, C) of a per-slot row `[kv C | score C]`.
    kind "csa": R = 2 * ratio slots over rows `[kv Ca | kv Cb | score Ca | score Cb]`; slots 0..ratio-1 (previous
    window) read the Ca half, the rest the Cb half. `empty_prev_window` entries get -1 for the previous window (the
    e = 0 case), `empty_entries` get -1 everywhere.
    """
    halves = 2 if kind == "csa" else 1
    n_slots = halves * ratio
    n_store = n_store or max(4 * n_slots, 16)
    rows = torch.randn(n_store, 2 * halves * width, device=device)
    rows[:, halves * width :] *= 2.0  # scores spread wider than values, so the gate is far from uniform
    rows = rows.to(dtype)
    kv_store, score_store = rows[:, : halves * width], rows[:, halves * width :]
    idx = torch.randint(0, n_store, (n_entries, n_slots), dtype=torch.int32, device=device)
    for e in empty_prev_window:
        idx[e, :ratio] = -1
    for e in empty_entries:
        idx[e] = -1
    if kind == "csa":
        col_off = torch.tensor([0] * ratio + [width] * ratio, dtype=torch.int32, device=device)
    else:
        col_off = torch.zeros(n_slots, dtype=torch.int32, device=device)
    ape = torch.randn(n_slots, width, device=device)
    norm_w = 1.0 + 0.1 * torch.randn(width, device=device)
    cos = sin = None
    if rope_dims:
        cos, sin = rope_cos_sin(torch.randint(0, 1 << 16, (n_entries,), device=device) * ratio, rope_dims)
    return dict(kv_store=kv_store, score_store=score_store, idx=idx, col_off=col_off, ape=ape, norm_w=norm_w,
                eps=1e-6, cos=cos, sin=sin)


def window_case(
    batch: int,
    nodes: int,
    heads: int,
    dim: int,
    window: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict:
    """Inputs of tree_window_attention: per request a random tree of `nodes` nodes under a committed window.

    Request b's key list = its last window-1 committed rows then its nodes' scratch rows; node n at depth d sees the
    committed rows j >= d (the window shortened by its depth) and its ancestors-or-self.
    """
    committed = window - 1
    per_req = committed + nodes
    pool = 2 * batch * per_req + 4
    kv = _strided_rows(pool, dim, 4, dtype, device)
    slots = torch.randperm(pool)[: batch * per_req].to(torch.int32).view(batch, per_req)
    masks = []
    for _ in range(batch):
        parent = [-1] + [int(torch.randint(0, i, ())) for i in range(1, nodes)]
        depth = [0] * nodes
        anc = torch.zeros(nodes, nodes, dtype=torch.bool)
        for i in range(nodes):
            anc[i, i] = True
            if parent[i] >= 0:
                depth[i] = depth[parent[i]] + 1
                anc[i] |= anc[parent[i]]
        sees_committed = torch.arange(committed)[None, :] >= torch.tensor(depth)[:, None]
        masks.append(torch.cat([sees_committed, anc], dim=1).flatten())
    qo_indptr = torch.arange(0, batch + 1, dtype=torch.int32) * nodes
    kv_indptr = torch.arange(0, batch + 1, dtype=torch.int32) * per_req
    return dict(
        q=torch.randn(batch * nodes, heads, dim, device=device).to(dtype),
        kv=kv,
        qo_indptr=qo_indptr.to(device),
        kv_indptr=kv_indptr.to(device),
        kv_indices=slots.flatten().to(device),
        mask=torch.cat(masks).to(device),
        sink=torch.randn(heads, device=device),
        scale=1.0 / math.sqrt(dim),
    )
