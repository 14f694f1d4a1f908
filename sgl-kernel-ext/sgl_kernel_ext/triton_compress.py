"""Triton kernel: per-branch compression (gated per-channel softmax pooling, weighted RMSNorm, interleaved RoPE).

Why gather by index: in a draft tree the rows of a block are found along the closing node's ancestors (committed rows
for positions before the tree, scratch rows of ancestors after), not in adjacent batch rows, so every slot of every
entry carries its own row index. One program computes one entry: it walks the R slots in blocks with a per-channel
online softmax, keeps the whole pooled row in registers for the RMSNorm, and rotates pairs in place. Channels are
held as two vectors (even, odd) so the interleaved RoPE pairs (2i, 2i+1) are element-wise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _compress_entries_kernel(
    kv_ptr, kv_stride_row, kv_stride_col,
    score_ptr, score_stride_row, score_stride_col,
    idx_ptr, idx_stride, col_off_ptr,
    ape_ptr, ape_stride,
    norm_w_ptr,
    cos_ptr, sin_ptr, rope_stride,
    out_ptr, out_stride,
    n_slots, n_pairs, rope_first_pair, eps,
    HAS_ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    entry = tl.program_id(0).to(tl.int64)
    offs_p = tl.arange(0, BLOCK_P)
    mask_p = offs_p < n_pairs
    col_even = 2 * offs_p

    neg_inf = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
    m_even, m_odd = neg_inf, neg_inf
    l_even = tl.zeros([BLOCK_P], dtype=tl.float32)
    l_odd = tl.zeros([BLOCK_P], dtype=tl.float32)
    a_even = tl.zeros([BLOCK_P], dtype=tl.float32)
    a_odd = tl.zeros([BLOCK_P], dtype=tl.float32)

    for r0 in range(0, n_slots, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < n_slots
        rows = tl.load(idx_ptr + entry * idx_stride + offs_r, mask=mask_r, other=-1).to(tl.int64)
        cols = tl.load(col_off_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)[:, None] + col_even[None, :]
        valid = (rows >= 0)[:, None] & mask_p[None, :]
        kv_even_ptr = kv_ptr + rows[:, None] * kv_stride_row + cols * kv_stride_col
        score_even_ptr = score_ptr + rows[:, None] * score_stride_row + cols * score_stride_col
        ape_even_ptr = ape_ptr + offs_r[:, None] * ape_stride + col_even[None, :]
        ape_mask = mask_r[:, None] & mask_p[None, :]

        kv_e = tl.load(kv_even_ptr, mask=valid, other=0.0).to(tl.float32)
        kv_o = tl.load(kv_even_ptr + kv_stride_col, mask=valid, other=0.0).to(tl.float32)
        s_e = tl.load(score_even_ptr, mask=valid, other=0.0).to(tl.float32)
        s_o = tl.load(score_even_ptr + score_stride_col, mask=valid, other=0.0).to(tl.float32)
        s_e = tl.where(valid, s_e + tl.load(ape_even_ptr, mask=ape_mask, other=0.0).to(tl.float32), float("-inf"))
        s_o = tl.where(valid, s_o + tl.load(ape_even_ptr + 1, mask=ape_mask, other=0.0).to(tl.float32), float("-inf"))

        # per-channel online softmax; a channel that has seen only empty slots keeps max = -inf, sum = 0
        new_m_e = tl.maximum(m_even, tl.max(s_e, axis=0))
        safe_m_e = tl.where(new_m_e == float("-inf"), 0.0, new_m_e)
        alpha_e = tl.exp(m_even - safe_m_e)
        p_e = tl.exp(s_e - safe_m_e[None, :])
        l_even = l_even * alpha_e + tl.sum(p_e, axis=0)
        a_even = a_even * alpha_e + tl.sum(p_e * kv_e, axis=0)
        m_even = new_m_e

        new_m_o = tl.maximum(m_odd, tl.max(s_o, axis=0))
        safe_m_o = tl.where(new_m_o == float("-inf"), 0.0, new_m_o)
        alpha_o = tl.exp(m_odd - safe_m_o)
        p_o = tl.exp(s_o - safe_m_o[None, :])
        l_odd = l_odd * alpha_o + tl.sum(p_o, axis=0)
        a_odd = a_odd * alpha_o + tl.sum(p_o * kv_o, axis=0)
        m_odd = new_m_o

    pooled_e = tl.where(mask_p, a_even / tl.where(l_even > 0, l_even, 1.0), 0.0)
    pooled_o = tl.where(mask_p, a_odd / tl.where(l_odd > 0, l_odd, 1.0), 0.0)
    mean_sq = (tl.sum(pooled_e * pooled_e, axis=0) + tl.sum(pooled_o * pooled_o, axis=0)) / (2 * n_pairs)
    inv_rms = 1.0 / tl.sqrt(mean_sq + eps)
    y_e = pooled_e * inv_rms * tl.load(norm_w_ptr + col_even, mask=mask_p, other=0.0).to(tl.float32)
    y_o = pooled_o * inv_rms * tl.load(norm_w_ptr + col_even + 1, mask=mask_p, other=0.0).to(tl.float32)

    if HAS_ROPE:
        # pairs before rope_first_pair are the "nope" channels: cos = 1, sin = 0 leaves them unchanged
        offs_j = offs_p - rope_first_pair
        mask_j = mask_p & (offs_j >= 0)
        c = tl.load(cos_ptr + entry * rope_stride + offs_j, mask=mask_j, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + entry * rope_stride + offs_j, mask=mask_j, other=0.0).to(tl.float32)
        rot_e = y_e * c - y_o * s
        rot_o = y_o * c + y_e * s
        y_e = rot_e
        y_o = rot_o

    out_row = out_ptr + entry * out_stride + col_even
    tl.store(out_row, y_e.to(out_ptr.dtype.element_ty), mask=mask_p)
    tl.store(out_row + 1, y_o.to(out_ptr.dtype.element_ty), mask=mask_p)


def launch_config(width: int, n_slots: int) -> tuple[int, int, int]:
    """(BLOCK_R slots per step, BLOCK_P channel pairs, num_warps) for C = width channels and R = n_slots."""
    return min(8, max(2, triton.next_power_of_2(n_slots))), max(16, triton.next_power_of_2(width // 2)), 4


def compress_entries_triton(
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
    """Launch the kernel; same contract as `reference.compress_entries_ref` (checked in `ops.py`)."""
    n_entries, n_slots = idx.shape
    width = ape.shape[1]
    if out is None:
        out = torch.empty((n_entries, width), dtype=out_dtype or kv_store.dtype, device=kv_store.device)
    if n_entries == 0:
        return out
    if out.stride(1) != 1:
        raise ValueError("compress_entries: out must have unit column stride")
    idx = idx.contiguous()
    col_off = col_off.to(device=idx.device, dtype=torch.int64).contiguous()
    ape = ape.contiguous()
    norm_w = norm_w.contiguous()
    has_rope = cos is not None and sin is not None and cos.shape[-1] > 0
    if has_rope:
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        rope_pairs = cos.shape[1]
    else:
        cos = sin = ape  # never read
        rope_pairs = 0

    n_pairs = width // 2
    block_r, block_p, num_warps = launch_config(width, n_slots)
    _compress_entries_kernel[(n_entries,)](
        kv_store, kv_store.stride(0), kv_store.stride(1),
        score_store, score_store.stride(0), score_store.stride(1),
        idx, idx.stride(0), col_off,
        ape, ape.stride(0),
        norm_w,
        cos, sin, cos.stride(0) if has_rope else 0,
        out, out.stride(0),
        n_slots, n_pairs, n_pairs - rope_pairs, float(eps),
        HAS_ROPE=has_rope, BLOCK_R=block_r, BLOCK_P=block_p,
        num_warps=num_warps,
    )
    return out
