"""Triton kernel of ``rms_norm``: one program per BLOCK_M rows, the whole row in registers (C up to 16K)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, x_sm, w_ptr, y_ptr, y_sm, M, C, eps,
                     HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, BLOCK_C)
    mask = (offs_m < M)[:, None] & (offs_c < C)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * x_sm + offs_c[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / C + eps)
    y = (xf * inv[:, None]).to(x.dtype).to(tl.float32)
    if HAS_W:
        w = tl.load(w_ptr + offs_c, mask=offs_c < C, other=0.0).to(tl.float32)
        y = y * w[None, :]
    tl.store(y_ptr + rows * y_sm + offs_c[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    c = x.shape[-1]
    x2 = x.reshape(-1, c)
    if x2.numel() and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    m = x2.shape[0]
    if m == 0:
        return y.view(x.shape)
    block_c = triton.next_power_of_2(c)
    block_m = max(1, min(16, 4096 // block_c))
    _rms_norm_kernel[(triton.cdiv(m, block_m),)](
        x2, x2.stride(0), weight if weight is not None else x2, y, y.stride(0), m, c, float(eps),
        HAS_W=weight is not None, BLOCK_M=block_m, BLOCK_C=block_c, num_warps=4 if block_c <= 2048 else 8,
    )
    return y.view(x.shape)
