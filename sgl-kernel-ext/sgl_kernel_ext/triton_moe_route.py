"""Triton kernel of ``moe_route``: one program per BLOCK_M tokens holds their ``[BLOCK_M, E]`` logits in registers
(the router's E is a few hundred), scores them, picks the top k by k passes of a row max, and normalises. Under
Triton's CPU interpreter the half-precision dot runs on fp32 copies (the interpreter's half dots are wrong) and its
casts to bf16 truncate where a GPU rounds, so there a score may differ from the reference by an ulp."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


@triton.jit
def _moe_route_kernel(x_ptr, x_sm, w_ptr, w_se, bias_ptr, chosen_ptr, idx_ptr, out_ptr, M, E, C, scaling,
                      K: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_SEL: tl.constexpr,
                      CHOSEN: tl.constexpr, DOT_FP32: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    rows = offs_m.to(tl.int64)
    live_m = offs_m < M
    live_e = offs_e < E
    acc = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        xt = tl.load(x_ptr + rows[:, None] * x_sm + offs_c[None, :],
                     mask=live_m[:, None] & (offs_c < C)[None, :], other=0.0)
        wt = tl.load(w_ptr + offs_e.to(tl.int64)[:, None] * w_se + offs_c[None, :],
                     mask=live_e[:, None] & (offs_c < C)[None, :], other=0.0)
        if DOT_FP32:  # fp32 inputs, or half precision under the interpreter (its half dots are wrong)
            acc += tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(wt))
    dt = x_ptr.dtype.element_ty
    logits = acc.to(dt).to(tl.float32)  # rounded once, as the matmul's output
    if SCORING == 0:  # sqrt(softplus(l)), each rounded; log1p(u) by its series where 1 + u would lose u
        u = tl.exp(-tl.abs(logits))
        log1p = tl.where(u < 1e-4, u - 0.5 * u * u, tl.log(1.0 + u))
        sp = tl.where(logits > 20.0, logits, tl.maximum(logits, 0.0) + log1p).to(dt).to(tl.float32)
        s = tl.sqrt(sp).to(dt).to(tl.float32)
    elif SCORING == 1:
        s = (1.0 / (1.0 + tl.exp(-logits))).to(dt).to(tl.float32)
    else:
        z = tl.where(live_e[None, :], logits, float("-inf"))
        z = tl.exp(z - tl.max(z, axis=1)[:, None])
        s = (z / tl.sum(z, axis=1)[:, None]).to(dt).to(tl.float32)
    if HAS_BIAS:
        sel = s + tl.load(bias_ptr + offs_e, mask=live_e, other=0.0).to(tl.float32)
        if ROUND_SEL:  # a bias of x's (16-bit) dtype: the sum is rounded to it, as torch's add
            sel = sel.to(dt).to(tl.float32)
    else:
        sel = s
    sel = tl.where(live_e[None, :], sel, float("-inf"))
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for j in tl.static_range(K):  # the picks and their scores, kept in the outputs until normalised
        if CHOSEN:
            pick = tl.load(chosen_ptr + rows * K + j, mask=live_m, other=0).to(tl.int32)
        else:
            best = tl.max(sel, axis=1)
            pick = tl.min(tl.where(sel == best[:, None], offs_e[None, :], BLOCK_E), axis=1)
            sel = tl.where(offs_e[None, :] == pick[:, None], float("-inf"), sel)
        w = tl.sum(tl.where(offs_e[None, :] == pick[:, None], s, 0.0), axis=1)
        total += w
        tl.store(idx_ptr + rows * K + j, pick.to(tl.int64), mask=live_m)
        tl.store(out_ptr + rows * K + j, w.to(dt), mask=live_m)  # exact: s is of x's dtype
    denom = (total.to(dt).to(tl.float32) + 1e-20).to(dt).to(tl.float32)
    for j in tl.static_range(K):
        w = tl.load(out_ptr + rows * K + j, mask=live_m, other=0.0).to(tl.float32)
        w = (w / denom).to(dt).to(tl.float32) * scaling
        tl.store(out_ptr + rows * K + j, w.to(dt), mask=live_m)


def moe_route_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, scaling: float,
                     scoring: str, chosen: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    n, c = x.shape
    e = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    idx = torch.empty(n, k, dtype=torch.long, device=x.device)
    w = torch.empty(n, k, dtype=x.dtype, device=x.device)
    if n:
        block_m, block_e = 16, max(16, triton.next_power_of_2(e))
        block_c = max(16, min(64, 8192 // block_e))
        chosen_t = chosen.contiguous() if chosen is not None else idx
        _moe_route_kernel[(triton.cdiv(n, block_m),)](
            x, x.stride(0), weight, weight.stride(0), bias if bias is not None else x, chosen_t, idx, w, n, e, c,
            float(scaling), K=k, SCORING=_SCORING[scoring], HAS_BIAS=bias is not None,
            ROUND_SEL=bias is not None and torch.promote_types(x.dtype, bias.dtype) == x.dtype != torch.float32,
            CHOSEN=chosen is not None,
            DOT_FP32=x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET", "0") == "1",
            BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_C=block_c,
            num_warps=4 if block_e <= 256 else 8,
        )
    return idx, w
