"""Triton kernel of ``swiglu_op``: elementwise over BLOCK elements per program (rows need not be contiguous with
each other; the last dimension must be)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, y_ptr, n, limit, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    g = tl.load(g_ptr + offs, mask=live, other=0.0)
    dt = g.dtype
    g = tl.minimum(g.to(tl.float32), limit).to(dt).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=live, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit).to(dt).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(y_ptr + offs, (silu * u).to(dt), mask=live)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty_like(g)
    n = g.numel()
    if n:
        block = 1024
        _swiglu_kernel[(triton.cdiv(n, block),)](g, u, y, n, float(limit), BLOCK=block, num_warps=4)
    return y.view(gate.shape)
