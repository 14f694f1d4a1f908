"""Triton kernel of ``rope.rope_rotate``: one program per (token, BLOCK_H heads); the copy of the unrotated channels
and the rotation of the pairs in one pass, the token's cos/sin loaded once for its heads."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, x_st, x_sh, x_sd, c_ptr, s_ptr, cs_st, y_ptr, y_st, y_sh,
                 H, D, R, sign,
                 BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    nope = D - 2 * R
    offs_n = tl.arange(0, BLOCK_N)
    xrow = x_ptr + t * x_st + offs_h[:, None] * x_sh
    yrow = y_ptr + t * y_st + offs_h[:, None] * y_sh
    for n0 in range(0, nope, BLOCK_N):
        m = mask_h[:, None] & ((n0 + offs_n) < nope)[None, :]
        v = tl.load(xrow + (n0 + offs_n)[None, :] * x_sd, mask=m, other=0.0)
        tl.store(yrow + (n0 + offs_n)[None, :], v, mask=m)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    c = tl.load(c_ptr + t * cs_st + offs_r, mask=mask_r, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + t * cs_st + offs_r, mask=mask_r, other=0.0).to(tl.float32) * sign
    m2 = mask_h[:, None] & mask_r[None, :]
    even_at = nope + 2 * offs_r
    e = tl.load(xrow + even_at[None, :] * x_sd, mask=m2, other=0.0).to(tl.float32)
    o = tl.load(xrow + (even_at + 1)[None, :] * x_sd, mask=m2, other=0.0).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    tl.store(yrow + even_at[None, :], (e * c[None, :] - o * s[None, :]).to(dt), mask=m2)
    tl.store(yrow + (even_at + 1)[None, :], (o * c[None, :] + e * s[None, :]).to(dt), mask=m2)


def rope_rotate_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    t, h, d = x.shape
    y = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t == 0 or h == 0:
        return y
    r = cos.shape[1]
    cos, sin = cos.contiguous(), sin.contiguous()
    block_r = max(triton.next_power_of_2(r), 2)
    block_h = min(16, triton.next_power_of_2(h))
    block_n = min(256, max(16, triton.next_power_of_2(max(d - 2 * r, 1))))
    _rope_kernel[(t, triton.cdiv(h, block_h))](
        x, x.stride(0), x.stride(1), x.stride(2), cos, sin, cos.stride(0), y, y.stride(0), y.stride(1),
        h, d, r, -1.0 if inverse else 1.0,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=block_r, num_warps=4,
    )
    return y
