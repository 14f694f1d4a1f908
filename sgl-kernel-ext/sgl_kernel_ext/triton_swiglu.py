"""Triton kernel of ``swiglu_op``: one program per (row, BLOCK columns); rows may sit at any stride (the gate and
up halves of one fused projection are column slices of its output), columns must be unit-strided."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _swiglu_kernel(g_ptr, g_sm, u_ptr, u_sm, y_ptr, n, limit, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    g = tl.load(g_ptr + row * g_sm + offs, mask=live, other=0.0)
    dt = g.dtype
    g = tl.minimum(g.to(tl.float32), limit).to(dt).to(tl.float32)
    u = tl.load(u_ptr + row * u_sm + offs, mask=live, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit).to(dt).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(y_ptr + row * n + offs, (silu * u).to(dt), mask=live)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, columns]`` without a copy where its layout allows one stride per row."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    g, u = _rows(gate), _rows(up)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    m, n = g.shape
    if m and n:
        block = min(1024, triton.next_power_of_2(n))
        _swiglu_kernel[(m, triton.cdiv(n, block))](g, g.stride(0), u, u.stride(0), y, n, float(limit), BLOCK=block,
                                                   num_warps=4)
    return y
