"""Triton kernel of ``gather_rows``: one program per BLOCK_R listed rows, the row's columns in BLOCK_C tiles."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_rows_kernel(buf_ptr, b_sr, b_sc, rows_ptr, out_ptr, n, off, width,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = offs_r < n
    rows = tl.load(rows_ptr + offs_r, mask=live, other=-1).to(tl.int64)
    listed = rows >= 0
    for c0 in range(0, width, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        cols = offs_c < width
        got = tl.load(buf_ptr + tl.maximum(rows, 0)[:, None] * b_sr + (off + offs_c)[None, :] * b_sc,
                      mask=(listed[:, None] & cols[None, :]), other=0.0)
        tl.store(out_ptr + offs_r.to(tl.int64)[:, None] * width + offs_c[None, :], got,
                 mask=live[:, None] & cols[None, :])


def gather_rows_triton(buf: torch.Tensor, rows: torch.Tensor, off: int, width: int) -> torch.Tensor:
    flat = rows.reshape(-1)
    out = torch.empty(flat.shape[0], width, dtype=buf.dtype, device=buf.device)
    n = flat.shape[0]
    if n and width:
        block_c = min(triton.next_power_of_2(width), 256)
        block_r = max(1, min(64, 4096 // block_c))
        _gather_rows_kernel[(triton.cdiv(n, block_r),)](buf, buf.stride(0), buf.stride(1), flat, out, n, off, width,
                                                         BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return out.view(*rows.shape, width)
