"""Triton kernel: tree sparse attention (MQA, K = V, two indexed sources, per-head sink, online softmax).

Why one kernel for both sources: V4 puts the sliding-window raw KV and the compressed entries (HCA: all, CSA: the
indexer's top-k) in one softmax, so a node's two index lists are walked one after the other by the same program with
one running (max, sum, accumulator) state. The sink enters as the initial state (max = sink, sum = 1, acc = 0): it
adds exp(sink) to the denominator and nothing to the numerator, and a node with no entries ends at 0 without a
special case.

Grid: (nodes, head blocks, splits). Each program holds BLOCK_H query heads of one node (all heads read the same
rows, so a row is loaded once per head block) and walks its part of the lists BLOCK_T rows at a time. With one
split the program finishes the softmax itself. With several (flash-decoding: small batches leave most of a GPU idle
otherwise) the concatenated list a ++ b is cut into equal chunks of whole tiles; each program writes its partial
(max, sum, accumulator) and a second kernel merges them. Only split 0 carries the sink (sum starts at 1); the
others start at max = sink, sum = 0, which is an exact empty state that keeps every max finite.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _interpreting() -> bool:
    """Triton's CPU interpreter computes tl.dot on bf16/fp16 operands wrongly (raw 16-bit patterns, seen with
    triton 3.8); under it the half-precision dots run on fp32 copies instead, and p is not rounded to bf16 before
    the second dot (the interpreter's fp32 -> bf16 cast truncates, a bias the GPU's round-to-nearest does not
    have). On a GPU both dots stay half precision."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _attend_range(
    q, m, lsum, acc,
    kv_ptr, kv_stride_row, kv_stride_col,
    idx_ptr, start, stop,
    offs_d, mask_d, scale,
    BLOCK_T: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Fold the rows kv[idx_ptr[start:stop]] (entries < 0 skipped) into the running softmax state."""
    for t0 in range(start, stop, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        rows = tl.load(idx_ptr + offs_t, mask=offs_t < stop, other=-1).to(tl.int64)
        valid = rows >= 0
        k = tl.load(
            kv_ptr + rows[:, None] * kv_stride_row + offs_d[None, :] * kv_stride_col,
            mask=valid[:, None] & mask_d[None, :],
            other=0.0,
        )
        if DOT_FP32:
            k32 = k.to(tl.float32)
            s = tl.dot(q.to(tl.float32), tl.trans(k32), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            pv = tl.dot(p, k32, input_precision="ieee")
        else:
            pv = tl.dot(p.to(k.dtype), k)
        acc = acc * alpha[:, None] + pv
        m = m_new
    return m, lsum, acc


@triton.jit
def _tree_sparse_attention_kernel(
    q_ptr, q_stride_n, q_stride_h, q_stride_d,
    kv_a_ptr, kv_a_stride_row, kv_a_stride_col, idx_a_ptr, idx_a_stride, n_idx_a,
    kv_b_ptr, kv_b_stride_row, kv_b_stride_col, idx_b_ptr, idx_b_stride, n_idx_b,
    sink_ptr,
    out_ptr, out_stride_n, out_stride_h, out_stride_d,
    part_ml_ptr, part_acc_ptr,
    num_heads, head_dim, scale, split_len,
    HAS_B: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    node = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < num_heads
    mask_d = offs_d < head_dim

    q = tl.load(
        q_ptr + node * q_stride_n + offs_h[:, None] * q_stride_h + offs_d[None, :] * q_stride_d,
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    m = tl.load(sink_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    lsum = tl.where(split == 0, 1.0, 0.0) + tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    # this program's chunk [lo, hi) of the concatenated list a ++ b
    lo = split * split_len
    hi = lo + split_len
    m, lsum, acc = _attend_range(
        q, m, lsum, acc, kv_a_ptr, kv_a_stride_row, kv_a_stride_col, idx_a_ptr + node * idx_a_stride,
        tl.minimum(lo, n_idx_a), tl.minimum(hi, n_idx_a), offs_d, mask_d, scale, BLOCK_T, DOT_FP32,
    )
    if HAS_B:
        m, lsum, acc = _attend_range(
            q, m, lsum, acc, kv_b_ptr, kv_b_stride_row, kv_b_stride_col, idx_b_ptr + node * idx_b_stride,
            tl.maximum(lo - n_idx_a, 0), tl.minimum(tl.maximum(hi - n_idx_a, 0), n_idx_b),
            offs_d, mask_d, scale, BLOCK_T, DOT_FP32,
        )

    mask_hd = mask_h[:, None] & mask_d[None, :]
    if SPLIT:
        # partials laid out [node, split, head] for (m, lsum) and [node, split, head, d] for acc
        n_splits = tl.num_programs(2)
        row = (node * n_splits + split) * num_heads + offs_h
        tl.store(part_ml_ptr + 2 * row, m, mask=mask_h)
        tl.store(part_ml_ptr + 2 * row + 1, lsum, mask=mask_h)
        tl.store(part_acc_ptr + row[:, None] * head_dim + offs_d[None, :], acc, mask=mask_hd)
    else:
        o = acc / lsum[:, None]
        tl.store(
            out_ptr + node * out_stride_n + offs_h[:, None] * out_stride_h + offs_d[None, :] * out_stride_d,
            o.to(out_ptr.dtype.element_ty),
            mask=mask_hd,
        )


@triton.jit
def _merge_splits_kernel(
    part_ml_ptr, part_acc_ptr,
    out_ptr, out_stride_n, out_stride_h, out_stride_d,
    num_heads, head_dim, n_splits,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out = sum_s acc_s * exp(m_s - M) / sum_s l_s * exp(m_s - M); split 0 holds the sink, so the sum is > 0."""
    node = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < num_heads
    mask_hd = mask_h[:, None] & (offs_d < head_dim)[None, :]

    m_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for split in range(0, n_splits):
        row = (node * n_splits + split) * num_heads + offs_h
        m_max = tl.maximum(m_max, tl.load(part_ml_ptr + 2 * row, mask=mask_h, other=0.0))
    l_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for split in range(0, n_splits):
        row = (node * n_splits + split) * num_heads + offs_h
        w = tl.exp(tl.load(part_ml_ptr + 2 * row, mask=mask_h, other=0.0) - m_max)
        l_sum += w * tl.load(part_ml_ptr + 2 * row + 1, mask=mask_h, other=1.0)
        acc += w[:, None] * tl.load(part_acc_ptr + row[:, None] * head_dim + offs_d[None, :], mask=mask_hd, other=0.0)
    o = acc / l_sum[:, None]
    tl.store(
        out_ptr + node * out_stride_n + offs_h[:, None] * out_stride_h + offs_d[None, :] * out_stride_d,
        o.to(out_ptr.dtype.element_ty),
        mask=mask_hd,
    )


def launch_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_T, BLOCK_D, num_warps). BLOCK_H = 16 because tl.dot needs 16 rows (fewer heads are masked);
    larger row tiles make ptxas spill for sm_90 at head 512 or with fp32 dots (test_kernels_compile checks)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_t = 16 if block_d > 256 or dtype == torch.float32 else 32
    return 16, block_t, block_d, 8 if block_d >= 256 else 4


def _auto_splits(device: torch.device, programs: int, n_tiles: int) -> int:
    """Enough splits to give every SM about two programs, never a split under two tiles; 1 off-GPU."""
    if device.type != "cuda" or n_tiles < 4:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * sms, max(programs, 1))
    return max(1, min(wanted, n_tiles // 2))


def tree_sparse_attention_triton(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    idx_a: torch.Tensor,
    kv_b: torch.Tensor | None,
    idx_b: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Launch the kernel(s); same contract as `reference.tree_sparse_attention_ref` (checked in `ops.py`).

    num_splits: how many programs share one node's lists (None = chosen from the GPU's SM count; 1 on CPU).
    """
    n_nodes, num_heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    if n_nodes == 0:
        return out
    has_b = kv_b is not None and idx_b is not None and idx_b.shape[1] > 0
    if not has_b:
        kv_b, idx_b = kv_a, idx_a[:, :0]
    idx_a = idx_a if idx_a.stride(-1) == 1 else idx_a.contiguous()
    idx_b = idx_b if idx_b.stride(-1) == 1 or idx_b.shape[1] == 0 else idx_b.contiguous()
    sink = sink.float().contiguous()

    block_h, block_t, block_d, num_warps = launch_config(head_dim, q.dtype)
    head_blocks = triton.cdiv(num_heads, block_h)
    total = idx_a.shape[1] + idx_b.shape[1]
    n_tiles = triton.cdiv(total, block_t)
    if num_splits is None:
        num_splits = _auto_splits(q.device, n_nodes * head_blocks, n_tiles)
    num_splits = max(1, min(num_splits, max(n_tiles, 1)))
    split_len = max(triton.cdiv(n_tiles, num_splits), 1) * block_t
    num_splits = triton.cdiv(max(total, 1), split_len)  # drop splits that would start past the end

    split = num_splits > 1
    if split:
        part_ml = torch.empty((n_nodes, num_splits, num_heads, 2), dtype=torch.float32, device=q.device)
        part_acc = torch.empty((n_nodes, num_splits, num_heads, head_dim), dtype=torch.float32, device=q.device)
    else:
        part_ml = part_acc = sink  # never touched
    _tree_sparse_attention_kernel[(n_nodes, head_blocks, num_splits)](
        q, q.stride(0), q.stride(1), q.stride(2),
        kv_a, kv_a.stride(0), kv_a.stride(1), idx_a, idx_a.stride(0), idx_a.shape[1],
        kv_b, kv_b.stride(0), kv_b.stride(1), idx_b, max(idx_b.stride(0), 0), idx_b.shape[1],
        sink,
        out, out.stride(0), out.stride(1), out.stride(2),
        part_ml, part_acc,
        num_heads, head_dim, float(scale), split_len,
        HAS_B=has_b, SPLIT=split, DOT_FP32=q.dtype == torch.float32 or _interpreting(),
        BLOCK_H=block_h, BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=num_warps,
    )
    if split:
        _merge_splits_kernel[(n_nodes, head_blocks)](
            part_ml, part_acc,
            out, out.stride(0), out.stride(1), out.stride(2),
            num_heads, head_dim, num_splits,
            BLOCK_H=block_h, BLOCK_D=block_d,
            num_warps=num_warps,
        )
    return out
