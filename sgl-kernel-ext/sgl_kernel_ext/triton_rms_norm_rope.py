"""Triton kernel of ``rms_norm_rope``: one program per BLOCK_M (token, head) rows, the whole row in registers.

A row is loaded as its unrotated part (``D - 2R`` channels) and its even and odd rotated channels, so every element
of x is read once and the rotation finds both members of a pair in registers (an unrotated part of odd length puts
the pairs at odd offsets, which a split of the whole row into halves would get wrong). The sum of squares runs over
the three parts; the normalised values are rounded to x's dtype and, with a weight, the products to the output's
before the rotation, as the two ops the kernel replaces rounded them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_rope_kernel(x_ptr, x_st, x_sh, x_sd, w_ptr, w_sd, c_ptr, c_st, c_sr, s_ptr, s_st, s_sr, y_ptr,
                          M, H, D, R, eps,
                          HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    t = offs_m // H
    xrow = x_ptr + (t * x_st + (offs_m % H) * x_sh)[:, None]
    yrow = y_ptr + (offs_m * D)[:, None]  # the output is contiguous [T, H, D]
    nope = D - 2 * R
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < nope
    mn = mask_m[:, None] & mask_n[None, :]
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    mr = mask_m[:, None] & mask_r[None, :]
    even_at = nope + 2 * offs_r

    xn = tl.load(xrow + offs_n[None, :] * x_sd, mask=mn, other=0.0)
    xdt = xn.dtype
    xn = xn.to(tl.float32)
    xe = tl.load(xrow + even_at[None, :] * x_sd, mask=mr, other=0.0).to(tl.float32)
    xo = tl.load(xrow + (even_at + 1)[None, :] * x_sd, mask=mr, other=0.0).to(tl.float32)
    ss = tl.sum(xn * xn, axis=1) + tl.sum(xe * xe, axis=1) + tl.sum(xo * xo, axis=1)
    inv = (1.0 / tl.sqrt(ss / D + eps))[:, None]

    ydt = y_ptr.dtype.element_ty
    yn = (xn * inv).to(xdt).to(tl.float32)
    ye = (xe * inv).to(xdt).to(tl.float32)
    yo = (xo * inv).to(xdt).to(tl.float32)
    if HAS_W:
        yn = yn * tl.load(w_ptr + offs_n * w_sd, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        we = tl.load(w_ptr + even_at * w_sd, mask=mask_r, other=0.0).to(tl.float32)[None, :]
        wo = tl.load(w_ptr + (even_at + 1) * w_sd, mask=mask_r, other=0.0).to(tl.float32)[None, :]
        ye = (ye * we).to(ydt).to(tl.float32)  # the rotation starts from the values the norm op returned
        yo = (yo * wo).to(ydt).to(tl.float32)
    tl.store(yrow + offs_n[None, :], yn.to(ydt), mask=mn)

    c = tl.load(c_ptr + t[:, None] * c_st + offs_r[None, :] * c_sr, mask=mr, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + t[:, None] * s_st + offs_r[None, :] * s_sr, mask=mr, other=0.0).to(tl.float32)
    tl.store(yrow + even_at[None, :], (ye * c - yo * s).to(ydt), mask=mr)
    tl.store(yrow + (even_at + 1)[None, :], (yo * c + ye * s).to(ydt), mask=mr)


def launch_config(d: int, r: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_R, num_warps) for rows of d channels, the last 2r rotated: about 2K elements per
    program, at most 8 rows (4 rows at D = 512, 8 at D = 128: many programs for a decode step's few rows; 16 rows
    of 128 made ptxas spill for sm_90)."""
    block_n = max(16, triton.next_power_of_2(max(d - 2 * r, 1)))
    block_r = max(2, triton.next_power_of_2(r))
    width = triton.next_power_of_2(d)
    return max(1, min(8, 2048 // width)), block_n, block_r, 4 if width <= 2048 else 8


def rms_norm_rope_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                         sin: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    t, h, d = x.shape
    r = cos.shape[1]
    y = torch.empty((t, h, d), dtype=out_dtype, device=x.device)
    m = t * h
    if m == 0:
        return y
    block_m, block_n, block_r, num_warps = launch_config(d, r)
    w = weight if weight is not None else x
    _rms_norm_rope_kernel[(triton.cdiv(m, block_m),)](
        x, x.stride(0), x.stride(1), x.stride(2), w, w.stride(-1), cos, cos.stride(0), cos.stride(1),
        sin, sin.stride(0), sin.stride(1), y, m, h, d, r, float(eps),
        HAS_W=weight is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, num_warps=num_warps,
    )
    return y
