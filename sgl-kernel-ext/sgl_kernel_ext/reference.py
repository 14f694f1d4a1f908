"""Torch references of the tree-verification kernels.

These functions are the CPU path of `sgl_kernel_ext.ops` and the oracle the Triton kernels are tested against, so
they favour being obviously right over being fast: gather everything, compute in fp32, then cast.

Conventions shared with the kernels (see `ops.py` for the full contract):
* index lists are integer tensors with -1 as padding; a -1 may sit anywhere in a row and is simply skipped;
* storages may be strided views (a row stride larger than the row width); only advanced indexing is used on them;
* the per-head sink is one extra logit in the softmax denominator that carries no value.
"""
from __future__ import annotations

import torch


def _gather_rows(kv: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `kv[idx]` as fp32 `[N, T, D]` (zeros where idx < 0) and the validity mask `[N, T]`."""
    valid = idx >= 0
    rows = kv[idx.clamp_min(0).long()].float()
    return rows.masked_fill(~valid[..., None], 0.0), valid


def tree_sparse_attention_ref(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    idx_a: torch.Tensor,
    kv_b: torch.Tensor | None,
    idx_b: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse MQA with K = V over two indexed sources and a per-head sink, one softmax per (node, head).

    out[n, h] = sum_j p_j * K_j with p_j = exp(s_j) / (exp(sink_h) + sum_i exp(s_i)), s_j = scale * q[n, h] . K_j,
    where K_j runs over kv_a[idx_a[n]] then kv_b[idx_b[n]] (entries < 0 skipped). A node with no entries gets 0.
    """
    keys, valid = _gather_rows(kv_a, idx_a)
    if kv_b is not None and idx_b is not None and idx_b.shape[1] > 0:
        keys_b, valid_b = _gather_rows(kv_b, idx_b)
        keys, valid = torch.cat([keys, keys_b], dim=1), torch.cat([valid, valid_b], dim=1)
    scores = torch.einsum("nhd,ntd->nht", q.float(), keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink_logit = sink.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    m = torch.cat([scores, sink_logit], dim=-1).amax(dim=-1, keepdim=True)  # also fine for zero-width lists
    p = torch.exp(scores - m)
    denom = p.sum(dim=-1, keepdim=True) + torch.exp(sink_logit - m)
    result = (torch.einsum("nht,ntd->nhd", p, keys) / denom).to(q.dtype)
    if out is None:
        return result
    return out.copy_(result)


def apply_interleaved_rope(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last 2 * cos.shape[-1] channels of y `[E, C]` as interleaved pairs (2i, 2i+1), V4 style."""
    rd = 2 * cos.shape[-1]
    nope, rope = y[:, : y.shape[1] - rd], y[:, y.shape[1] - rd :]
    even, odd = rope[:, 0::2], rope[:, 1::2]
    c, s = cos.float(), sin.float()
    rotated = torch.stack([even * c - odd * s, odd * c + even * s], dim=-1).flatten(1)
    return torch.cat([nope, rotated], dim=1)


def compress_entries_ref(
    kv_store: torch.Tensor,
    score_store: torch.Tensor,
    idx: torch.Tensor,
    col_off: torch.Tensor,
    ape: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated per-channel softmax pooling of R slots, then weighted RMSNorm, then interleaved RoPE.

    Slot j of entry e reads row idx[e, j] (-1 = empty slot, weight 0) at columns col_off[j] .. col_off[j] + C of both
    stores; its logit is score + ape[j]. An entry whose slots are all empty pools to 0 and stays 0.
    """
    n_slots = idx.shape[1]
    width = ape.shape[1]
    valid = idx >= 0
    rows = idx.clamp_min(0).long()[:, :, None]
    cols = (col_off.long().view(-1, 1) + torch.arange(width, device=idx.device)).expand(n_slots, width)[None]
    kv = kv_store[rows, cols].float().masked_fill(~valid[..., None], 0.0)
    logits = (score_store[rows, cols].float() + ape.float()).masked_fill(~valid[..., None], float("-inf"))
    m = logits.amax(dim=1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(logits - m)
    total = e.sum(dim=1, keepdim=True)
    weights = e / torch.where(total > 0, total, torch.ones_like(total))
    pooled = (weights * kv).sum(dim=1)
    y = pooled * torch.rsqrt(pooled.pow(2).mean(dim=1, keepdim=True) + eps) * norm_w.float()
    if cos is not None and sin is not None and cos.shape[-1] > 0:
        y = apply_interleaved_rope(y, cos, sin)
    result = y.to(out_dtype or kv_store.dtype)
    if out is None:
        return result
    return out.copy_(result)


def tree_window_attention_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    mask: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-request dense attention under a boolean tree mask (the FlashInfer custom-mask formulation), with sink.

    Request b owns queries q[qo_indptr[b]:qo_indptr[b+1]] and keys kv[kv_indices[kv_indptr[b]:kv_indptr[b+1]]];
    mask holds, request after request, the row-major [qo_len_b, kv_len_b] booleans (True = attend).
    """
    result = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    mask_start = 0
    for b in range(qo_indptr.numel() - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        k0, k1 = int(kv_indptr[b]), int(kv_indptr[b + 1])
        n_q, n_k = q1 - q0, k1 - k0
        req_mask = mask[mask_start : mask_start + n_q * n_k].view(n_q, n_k)
        mask_start += n_q * n_k
        slots = kv_indices[k0:k1].long()
        idx = torch.where(req_mask, slots.view(1, -1), torch.full_like(slots.view(1, -1), -1))
        result[q0:q1] = tree_sparse_attention_ref(q[q0:q1], kv, idx, None, None, sink, scale)
    if out is None:
        return result
    return out.copy_(result)
