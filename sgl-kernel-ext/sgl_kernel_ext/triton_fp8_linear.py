"""Triton kernel: ``y = x W^T`` with ``W`` FP8 e4m3 and one scale per 128 x 128 block, in one launch.

Tiling: one program per (BLOCK_M rows of x, BLOCK_N rows of W); the K loop walks tiles of BLOCK_K (a divisor of
128) from column 0, so the loads stay aligned and Triton pipelines them (cp.async). The weight tile is loaded as
fp8 and converted to x's dtype (exact: every e4m3 value is a bf16 / fp16 / fp32 value), the dot accumulates in
fp32, and its partial sum is multiplied by the scales of its block before it joins the accumulator -- for
power-of-two scales the same real number as dotting with the dequantised weight, so the kernel and the reference
differ only in the order of fp32 additions. Nothing dequantised is ever written to memory.

Scales: one per output column and K tile, ``scale[(n + off_r) // 128, (k0 + off_c) // 128]`` (a BLOCK_N tile may
cross a scale row when ``off_r`` is not 0; the per-column load covers that). When ``off_c`` is not a multiple of
BLOCK_K (a shard starting inside a block), a K tile can cross into the next scale column; such shards compile the
STRADDLE variant, which splits the tile at the block boundary into two masked dots, one per scale column. Only scale
blocks touched by the shard's rows and columns are read; rows past N and columns past K are masked.

fp32 x uses an IEEE fp32 dot (no TF32). Small M (decode: batch x tree width) is the case that matters: the tile
table (``launch_config``) keeps the weight streaming with about one program per SM or more.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

SCALE_BLOCK = tl.constexpr(128)  # rows / columns per scale block (a constexpr global, usable in kernels)


def _interpreting() -> bool:
    """Under Triton's CPU interpreter half-precision dots are computed wrongly (see triton_tree_attention), so
    every dot runs on fp32 copies there."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@triton.jit
def _fp8_block_linear_kernel(
    x_ptr, x_stride_m, x_stride_k,
    w_ptr, w_stride_n, w_stride_k,
    s_ptr, s_stride_r, s_stride_c,
    out_ptr, out_stride_m, out_stride_n,
    M, N, K, off_r, off_c,
    SCALE_E8M0: tl.constexpr, DOT_FP32: tl.constexpr, STRADDLE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)  # fastest: programs that share a weight tile run side by side
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * x_stride_m
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * w_stride_n
    s_rows = s_ptr + ((offs_n + off_r) // SCALE_BLOCK).to(tl.int64) * s_stride_r

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_rows + offs_k[None, :] * x_stride_k, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_cols + offs_k[:, None] * w_stride_k, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        else:
            w = w.to(x.dtype)
        col = (k0 + off_c) // SCALE_BLOCK  # the scale column of the tile's first element
        s = _load_scale(s_rows + col * s_stride_c, mask_n, SCALE_E8M0)
        if STRADDLE:
            # the tile crosses into scale column col + 1 at local index `cut` (when cut < BLOCK_K): one dot per side
            cut = SCALE_BLOCK - (k0 + off_c) % SCALE_BLOCK
            first = (tl.arange(0, BLOCK_K) < cut)[None, :]
            s_next = _load_scale(s_rows + (col + 1) * s_stride_c, mask_n & (cut < BLOCK_K) & (k0 + cut < K),
                                 SCALE_E8M0)
            acc += _dot(tl.where(first, x, 0.0), w, DOT_FP32) * s[None, :]
            acc += _dot(tl.where(first, 0.0, x), w, DOT_FP32) * s_next[None, :]
        else:
            acc += _dot(x, w, DOT_FP32) * s[None, :]

    out = out_ptr + offs_m.to(tl.int64)[:, None] * out_stride_m + offs_n.to(tl.int64)[None, :] * out_stride_n
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _load_scale(ptrs, mask, SCALE_E8M0: tl.constexpr):
    """float32 scales at ptrs (0 where masked); an e8m0 byte b is 2^(b - 127), whose float bits are b << 23 (b = 0
    is the subnormal 2^-127)."""
    s = tl.load(ptrs, mask=mask, other=0)
    if SCALE_E8M0:
        b = s.to(tl.int32)
        return tl.where(b == 0, 0x400000, b << 23).to(tl.float32, bitcast=True)
    return s.to(tl.float32)


@triton.jit
def _dot(x, w, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(x, w, input_precision="ieee")
    return tl.dot(x, w)


def launch_config(m: int, n: int, dtype: torch.dtype, sms: int | None = None,
                  off_c: int = 0) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for an [m, K] x [n, K]^T product.

    Small m (decode: batch x tree width) is bound by reading the weight: one M tile of 16 or 32 rows, 128-deep K
    tiles, and BLOCK_N shrunk from its largest towards 32 until there are about as many programs as SMs. Larger m
    takes 64-deep K tiles and 64 or 128 rows. Every entry compiles for sm_90 with its loads pipelined and without
    register spills, also with the two dots of a shard whose K tiles straddle scale blocks (test_kernel_fp8_linear
    checks); fp32 x (IEEE fp32 dots) takes small tiles."""
    if dtype == torch.float32:
        return (16 if m <= 16 else 32), 32, 32, 4, 3
    if m <= 16:
        block_m, block_n, block_k, num_warps, num_stages = 16, 128, 128, 4, 4
    elif m <= 32:
        block_m, block_n, block_k, num_warps, num_stages = 32, 64, 128, 4, 4
    elif m <= 64:
        block_m, block_n, block_k, num_warps, num_stages = 64, 64, 64, 4, 4
    else:
        block_m, block_n, block_k, num_warps, num_stages = 128, 64 if off_c % 64 else 128, 64, 8, 3
    while block_n > 32 and sms is not None and triton.cdiv(m, block_m) * triton.cdiv(n, block_n) < sms:
        block_n //= 2
    return block_m, block_n, block_k, num_warps, num_stages


def fp8_block_linear_triton(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, off_r: int, off_c: int,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the kernel on ``x2 [M, K]`` (any strides), ``weight [N, K]`` fp8 e4m3, ``scale`` float32 / bf16 /
    fp16, or e8m0 (``float8_e8m0fnu`` or uint8 bytes); returns ``[M, N]`` in x's dtype (checks in ``fp8_linear``)."""
    m, k = x2.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if m == 0 or n == 0:
        return out
    e8m0 = scale.dtype not in (torch.float32, torch.bfloat16, torch.float16)
    if e8m0:
        scale = scale.view(torch.uint8)  # Triton has no e8m0 type; the kernel decodes the byte
    sms = _sm_count(x2.device.index or 0) if x2.is_cuda else None
    block_m, block_n, block_k, num_warps, num_stages = launch_config(m, n, x2.dtype, sms, off_c)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_block_linear_kernel[grid](
        x2, x2.stride(0), x2.stride(1),
        weight, weight.stride(0), weight.stride(1),
        scale, scale.stride(0), scale.stride(1),
        out, out.stride(0), out.stride(1),
        m, n, k, off_r, off_c,
        SCALE_E8M0=e8m0, DOT_FP32=x2.dtype == torch.float32 or _interpreting(), STRADDLE=off_c % block_k != 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
