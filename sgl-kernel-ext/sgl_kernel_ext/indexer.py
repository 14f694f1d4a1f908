"""The CSA lightning indexer's scoring as one op: ``indexer_scores(q, w, keys, rows, scale)``.

Contract
--------
indexer_scores(q[N, H, d], w[N, H], keys[S, d], rows[N, E], scale, w_scale=1) -> [N, E] float32:
    ``score[n, e] = sum_h w'[n, h] * relu(q[n, h] . keys[rows[n, e]]) * scale`` with ``w' = fp32(w) * w_scale``
    (the weights as the model scales them, one launch fewer than scaling them apart), q and keys upcast to fp32
    (fp32 products and sums), ``-inf`` where ``rows[n, e] < 0`` (no entry). keys may be any row-strided view (a
    pool's columns); only the listed rows are read.

Why an op: written in torch the scores pass through ``[N, H, E]`` fp32 temporaries (and an fp32 copy of every
gathered key) that at a 32-request draft tree are gigabytes per layer; the kernel keeps a tile of keys and its
``[H, BLOCK_E]`` products in registers and writes only ``[N, E]``. The top-k over the scores is ``torch.topk``.
The paths agree up to fp32 summation order (bf16 products are exact in fp32).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import traffic
from .ops import _backend, plain_reference

REFERENCE_CHUNK_ELEMENTS = 1 << 24  # the reference's [N, H + d, chunk] fp32 temporaries: 64 MiB


def indexer_scores_ref(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor,
                       scale: float, w_scale: float = 1.0) -> torch.Tensor:
    n, heads, dim = q.shape
    e = rows.shape[1]
    qf, wf = q.float(), w.float() * w_scale
    out = torch.empty(n, e, dtype=torch.float32, device=q.device)
    step = max(64, REFERENCE_CHUNK_ELEMENTS // max(n * (heads + dim), 1))
    for e0 in range(0, e, step):
        r = rows[:, e0:e0 + step]
        valid = r >= 0
        k = keys[r.clamp(min=0).reshape(-1)].reshape(*r.shape, dim).float()
        s = torch.relu(torch.einsum("nhd,ned->nhe", qf, k)) * scale
        out[:, e0:e0 + step] = (s * wf.unsqueeze(-1)).sum(1).masked_fill(~valid, float("-inf"))
    return out


@torch.library.custom_op("sgl_kernel_ext::indexer_scores", mutates_args=())
def _indexer_scores_op(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, scale: float,
                       w_scale: float = 1.0, backend: Optional[str] = None) -> torch.Tensor:
    if _backend(backend, q) == "torch":
        return indexer_scores_ref(q, w, keys, rows, scale, w_scale)
    from .triton_indexer import indexer_scores_triton

    return indexer_scores_triton(q, w, keys, rows, scale, w_scale)


@_indexer_scores_op.register_fake
def _(q, w, keys, rows, scale, w_scale=1.0, backend=None):
    return q.new_empty(rows.shape, dtype=torch.float32)


@traffic.declare("sgl_kernel_ext::indexer_scores")
def indexer_scores_traffic(q, w, keys, rows, scale, w_scale=1.0, backend=None) -> traffic.Traffic:
    """q, w and the row lists read once, every listed key row once per query that lists it, the scores written
    once; one launch."""
    listed = rows.numel() * keys.shape[1] * keys.element_size()
    read = traffic.nbytes(q) + traffic.nbytes(w) + traffic.nbytes(rows) + listed
    return traffic.Traffic(read, rows.numel() * 4, 1, ((2, listed),))


def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, scale: float,
                   w_scale: float = 1.0, *, backend: str | None = None) -> torch.Tensor:
    """Index scores of the listed entries (see the module doc)."""
    if q.dim() != 3 or w.shape != q.shape[:2]:
        raise ValueError(f"q must be [N, H, d] and w [N, H], got {tuple(q.shape)} and {tuple(w.shape)}")
    if keys.dim() != 2 or keys.shape[1] != q.shape[2]:
        raise ValueError(f"keys must be [S, {q.shape[2]}], got {tuple(keys.shape)}")
    if rows.dim() != 2 or rows.shape[0] != q.shape[0] or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be [{q.shape[0]}, E] int32/int64, got {tuple(rows.shape)} {rows.dtype}")
    if plain_reference(backend, q, w, keys):
        return indexer_scores_ref(q, w, keys, rows, scale, w_scale)
    return torch.ops.sgl_kernel_ext.indexer_scores(q, w, keys, rows, float(scale), float(w_scale), backend)
