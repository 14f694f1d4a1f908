"""Triton kernel of ``indexer.indexer_scores``: one program per (query, BLOCK_E listed entries). The query's heads
``[H, d]`` and weights stay in registers; each program gathers its BLOCK_E key rows once, takes the ``[H, BLOCK_E]``
dot products (bf16 / fp16 operands on the tensor cores with fp32 accumulation, which is exact per product; fp32
operands, and everything under the interpreter, as an IEEE fp32 dot), then ReLU, the per-head weights and the sum
over heads, and writes ``BLOCK_E`` scores."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _indexer_scores_kernel(
    q_ptr, q_sn, q_sh, q_sd,
    w_ptr, w_sn, w_sh,
    k_ptr, k_sr, k_sd,
    r_ptr, r_sn, r_se,
    o_ptr, o_sn,
    H, D, E, scale, w_scale,
    DOT_FP32: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_e = offs_e < E
    mask_h = offs_h < H
    mask_d = offs_d < D
    q = tl.load(q_ptr + n * q_sn + offs_h[:, None] * q_sh + offs_d[None, :] * q_sd,
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    w = tl.load(w_ptr + n * w_sn + offs_h * w_sh, mask=mask_h, other=0.0).to(tl.float32) * w_scale
    rows = tl.load(r_ptr + n * r_sn + offs_e * r_se, mask=mask_e, other=-1)
    listed = rows >= 0
    k = tl.load(k_ptr + tl.maximum(rows, 0).to(tl.int64)[:, None] * k_sr + offs_d[None, :] * k_sd,
                mask=listed[:, None] & mask_d[None, :], other=0.0)
    if DOT_FP32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    s = tl.maximum(s, 0.0) * scale
    score = tl.sum(s * w[:, None], axis=0)
    score = tl.where(listed, score, float("-inf"))
    tl.store(o_ptr + n * o_sn + offs_e, score, mask=mask_e)


def indexer_scores_triton(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor,
                          scale: float, w_scale: float = 1.0) -> torch.Tensor:
    n, heads, dim = q.shape
    e = rows.shape[1]
    out = torch.empty((n, e), dtype=torch.float32, device=q.device)
    if n == 0 or e == 0:
        return out
    block_h = max(16, triton.next_power_of_2(heads))
    block_d = max(16, triton.next_power_of_2(dim))
    block_e = 32 if block_h * block_d <= 8192 else 16
    dot_fp32 = (q.dtype == torch.float32 or keys.dtype == torch.float32
                or os.environ.get("TRITON_INTERPRET", "0") == "1")
    _indexer_scores_kernel[(n, triton.cdiv(e, block_e))](
        q, q.stride(0), q.stride(1), q.stride(2),
        w, w.stride(0), w.stride(1),
        keys, keys.stride(0), keys.stride(1),
        rows, rows.stride(0), rows.stride(1),
        out, out.stride(0),
        heads, dim, e, float(scale), float(w_scale),
        DOT_FP32=dot_fp32, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_E=block_e,
        num_warps=4,
    )
    return out
