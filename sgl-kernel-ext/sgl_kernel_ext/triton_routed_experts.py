"""Triton path of ``routed_experts``: a grouped MoE that reads only the weights of experts some pair is routed to.

Four launches, every grid sized from shapes (N, k, E, D, I), never from routing values, so the whole path can be
captured in a CUDA graph:

1. ``_sort_pairs_kernel`` (one program): counts the (token, slot) pairs of each local expert and writes ``order``,
   the pair ids sorted by expert (stable: within an expert in pair order). Pairs routed to another rank are left
   out. Deterministic, no atomics.
2. ``_gate_up_kernel``, grid (row blocks, I / BLOCK_N): row block b belongs to the expert whose run of
   ``ceil(count_e / BLOCK_M)`` blocks covers b (each program finds it from the counts, ``_block_rows``); a block
   past the last routed expert's run returns before it loads any weight, which is why an unrouted expert is never
   read. The weight tile is dequantised in registers (dense / FP4 e2m1 + e8m0 per 32 / FP8 e4m3 + 128 x 128 block
   scales), both GEMMs share the activation tile, and SwiGLU is applied before the [pairs, I] activation ``h`` is
   written (rows in sorted order).
3. ``_down_kernel``, grid (row blocks, D / BLOCK_N): ``y = h W2^T`` per pair, written at the pair's own row of a
   [pairs, D] buffer.
4. ``_combine_kernel``, grid (N, D / BLOCK_D): ``out[n] = sum_j w[n, j] y[n k + j]`` over the local pairs, in j
   order, in fp32, rounded once.

The row-block grid has the worst case ``floor((P + min(E, P) (BLOCK_M - 1)) / BLOCK_M)`` blocks (P = N k): every
routed expert wastes at most BLOCK_M - 1 rows of its last block.

Numerics follow the reference exactly up to fp32 summation order: GEMM results, SiLU, SwiGLU's product and ``y`` are
rounded to x's dtype where the torch code rounds them. Rounding to bf16 is done by bit arithmetic (``_round_to``)
because Triton's CPU interpreter truncates on fp32 -> bf16 casts; under the interpreter, and for fp32 activations,
the dots run on fp32 operands in IEEE precision (the interpreter computes half-precision dots wrongly).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .routed_experts import intermediate_shapes
from .weight_formats import E8M0_DTYPE

FORMATS = {"dense": 0, "fp4": 1, "fp8": 2}
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _round_to(v, KIND: tl.constexpr):
    """fp32 ``v`` rounded to nearest-even in x's dtype (KIND 0 fp32, 1 bf16, 2 fp16), returned as fp32."""
    if KIND == 1:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        v = tl.where(v == v, bits.to(tl.float32, bitcast=True), v)
    elif KIND == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def _e8m0(b):
    """e8m0 bytes -> fp32 ``2^(b - 127)`` built bit by bit (b = 0 is the subnormal 2^-127, b = 255 is inf)."""
    b = b.to(tl.int32)
    bits = tl.where(b == 0, 0x400000, b << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(code):
    """4-bit e2m1 codes (int32) -> fp32: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign."""
    m = code & 7
    normal = ((((m >> 1) + 126) << 23) | ((m & 1) << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(m >= 2, normal, m.to(tl.float32) * 0.5)
    return tl.where(code >= 8, -mag, mag)


@triton.jit
def _weight_tile(w_ptr, s_ptr, offs_k, offs_n, k0, mask_k, mask_n, sw_r, sw_c, ss_r, ss_c,
                 FMT: tl.constexpr, SCALE_E8M0: tl.constexpr):
    """fp32 tile ``W[offs_n, offs_k]`` laid out [BLOCK_K, BLOCK_N] (the GEMM's B operand) of one expert's
    ``W [out, in]``; out-of-range elements are 0."""
    mask = mask_k[:, None] & mask_n[None, :]
    if FMT == 1:
        b = tl.load(w_ptr + offs_n[None, :] * sw_r + (offs_k // 2)[:, None] * sw_c, mask=mask, other=0)
        code = (b.to(tl.int32) >> ((offs_k % 2) * 4)[:, None]) & 0xF
        s = tl.load(s_ptr + offs_n[None, :] * ss_r + (offs_k // 32)[:, None] * ss_c, mask=mask, other=0)
        if SCALE_E8M0:
            s = _e8m0(s)
        w = _e2m1(code) * s.to(tl.float32)
    else:
        w = tl.load(w_ptr + offs_n[None, :] * sw_r + offs_k[:, None] * sw_c, mask=mask, other=0.0).to(tl.float32)
        if FMT == 2:
            # BLOCK_K divides 128 and k0 is a multiple of BLOCK_K: the tile sits in one column of scale blocks
            s = tl.load(s_ptr + (offs_n // 128) * ss_r + (k0 // 128) * ss_c, mask=mask_n, other=0)
            if SCALE_E8M0:
                s = _e8m0(s)
            w = w * s.to(tl.float32)[None, :]
    return w


@triton.jit
def _mma(a, w, acc, KIND: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc += a @ w with ``w`` (fp32 [BLOCK_K, BLOCK_N]) first rounded to a's dtype, as the reference casts the
    dequantised weight to x's dtype."""
    if DOT_FP32:
        acc = tl.dot(a.to(tl.float32), _round_to(w, KIND), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w.to(a.dtype), acc)
    return acc


@triton.jit
def _block_rows(counts_ptr, n_experts, block, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first sorted row, end of the expert's sorted rows) of row block ``block``. Expert e owns blocks
    [sum_{f<e} nb_f, sum_{f<=e} nb_f) with nb_f = ceil(count_f / BLOCK_M); an unowned block gives an empty range."""
    bins = tl.arange(0, BLOCK_E)
    c = tl.load(counts_ptr + bins, mask=bins < n_experts, other=0)
    nb = (c + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(nb, axis=0)
    e = tl.sum((block_end <= block).to(tl.int32), axis=0)
    own = bins == e
    row_end = tl.cumsum(c, axis=0)
    row0 = tl.sum(tl.where(own, row_end - c + (block - (block_end - nb)) * BLOCK_M, 0), axis=0)
    end = tl.sum(tl.where(own, row_end, 0), axis=0)
    return e, row0, end


@triton.jit
def _sort_pairs_kernel(idx_ptr, counts_ptr, order_ptr, n_pairs, first, n_experts,
                       BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    bins = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, n_pairs, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        local = tl.load(idx_ptr + offs, mask=offs < n_pairs, other=-1).to(tl.int64) - first
        mine = (offs < n_pairs) & (local >= 0) & (local < n_experts)
        onehot = ((local[:, None] == bins[None, :]) & mine[:, None]).to(tl.int32)
        counts += tl.sum(onehot, axis=0)
    tl.store(counts_ptr + bins, counts, mask=bins < n_experts)
    nxt = tl.cumsum(counts, axis=0) - counts  # next free sorted row of each expert
    for p0 in range(0, n_pairs, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        local = tl.load(idx_ptr + offs, mask=offs < n_pairs, other=-1).to(tl.int64) - first
        mine = (offs < n_pairs) & (local >= 0) & (local < n_experts)
        onehot = ((local[:, None] == bins[None, :]) & mine[:, None]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot  # same-expert pairs earlier in this chunk
        pos = tl.sum(onehot * (nxt[None, :] + before), axis=1)
        tl.store(order_ptr + pos, offs, mask=mine)
        nxt += tl.sum(onehot, axis=0)


@triton.jit
def _gate_up_kernel(
    x_ptr, sx_n, sx_d, order_ptr, counts_ptr,
    w1_ptr, w3_ptr, sw_e, sw_r, sw_c, s1_ptr, s3_ptr, ss_e, ss_r, ss_c,
    h_ptr, n_experts, top_k, dim, inter, limit,
    FMT: tl.constexpr, SCALE_E8M0: tl.constexpr, KIND: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):
    e, row0, row_end = _block_rows(counts_ptr, n_experts, tl.program_id(0), BLOCK_M, BLOCK_E)
    if row0 >= row_end:
        return  # no routed expert owns this block: nothing is loaded
    rows = row0 + tl.arange(0, BLOCK_M)
    mask_m = rows < row_end
    token = (tl.load(order_ptr + rows, mask=mask_m, other=0) // top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter
    w_off = e.to(tl.int64) * sw_e
    s_off = e.to(tl.int64) * ss_e
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, dim, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < dim
        a = tl.load(x_ptr + token[:, None] * sx_n + offs_k[None, :] * sx_d, mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        wg = _weight_tile(w1_ptr + w_off, s1_ptr + s_off, offs_k, offs_n, k0, mask_k, mask_n, sw_r, sw_c, ss_r, ss_c,
                          FMT, SCALE_E8M0)
        acc_g = _mma(a, wg, acc_g, KIND, DOT_FP32)
        wu = _weight_tile(w3_ptr + w_off, s3_ptr + s_off, offs_k, offs_n, k0, mask_k, mask_n, sw_r, sw_c, ss_r, ss_c,
                          FMT, SCALE_E8M0)
        acc_u = _mma(a, wu, acc_u, KIND, DOT_FP32)
    # swiglu as the reference evaluates it in x's dtype: silu(min(g, limit)) rounded, times clamp(u), rounded
    g = _round_to(acc_g, KIND)
    u = _round_to(acc_u, KIND)
    g = tl.where(g > limit, limit, g)
    u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
    act = _round_to(g / (1.0 + tl.exp(-g)), KIND)
    h = _round_to(act * u, KIND)
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * inter + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(
    h_ptr, order_ptr, counts_ptr,
    w2_ptr, sw_e, sw_r, sw_c, s2_ptr, ss_e, ss_r, ss_c,
    y_ptr, n_experts, dim, inter,
    FMT: tl.constexpr, SCALE_E8M0: tl.constexpr, KIND: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):
    e, row0, row_end = _block_rows(counts_ptr, n_experts, tl.program_id(0), BLOCK_M, BLOCK_E)
    if row0 >= row_end:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    mask_m = rows < row_end
    pair = tl.load(order_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < dim
    w_off = e.to(tl.int64) * sw_e
    s_off = e.to(tl.int64) * ss_e
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < inter
        a = tl.load(h_ptr + rows.to(tl.int64)[:, None] * inter + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = _weight_tile(w2_ptr + w_off, s2_ptr + s_off, offs_k, offs_n, k0, mask_k, mask_n, sw_r, sw_c, ss_r, ss_c,
                         FMT, SCALE_E8M0)
        acc = _mma(a, w, acc, KIND, DOT_FP32)
    y = _round_to(acc, KIND)
    tl.store(y_ptr + pair[:, None] * dim + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _combine_kernel(y_ptr, idx_ptr, wt_ptr, out_ptr, so_n, so_d, first, n_experts, top_k, dim,
                    KIND: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < dim
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(0, top_k):
        p = n * top_k + j
        local = tl.load(idx_ptr + p).to(tl.int64) - first
        mine = (local >= 0) & (local < n_experts)
        wj = tl.where(mine, tl.load(wt_ptr + p).to(tl.float32), 0.0)
        yj = tl.load(y_ptr + p * dim + offs, mask=mask & mine, other=0.0).to(tl.float32)
        acc += wj * yj
    tl.store(out_ptr + n * so_n + offs * so_d, _round_to(acc, KIND).to(out_ptr.dtype.element_ty), mask=mask)


class LaunchConfig:
    """Tile sizes, all functions of shapes only."""

    def __init__(self, n_pairs: int, n_experts: int, dim: int, dtype: torch.dtype = torch.bfloat16):
        avg = n_pairs / max(n_experts, 1)  # rows per expert if routing were even
        self.block_m = 16 if avg <= 16 else 32 if avg <= 32 or dtype == torch.float32 else 64
        self.block_n = 64
        # divides 128 (an FP8 tile has one scale column). fp32 operands (IEEE dots on FMA units) take smaller
        # tiles, which spill on sm_90 otherwise
        self.block_k = 32 if dtype == torch.float32 else 64
        self.block_e = max(16, triton.next_power_of_2(n_experts))
        self.block_p = 32 if self.block_e <= 256 else 16
        self.block_d = min(1024, max(16, triton.next_power_of_2(dim)))
        self.num_warps = 8  # at 4 warps the dequantised tiles and two accumulators spill on sm_90 (BLOCK_M = 64)
        self.sort_warps = 8 if self.block_e >= 128 else 4
        self.row_blocks = (n_pairs + min(n_experts, n_pairs) * (self.block_m - 1)) // self.block_m


def _scale_arg(s: torch.Tensor | None, w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if s is None:
        return w, False
    if E8M0_DTYPE is not None and s.dtype == E8M0_DTYPE:
        return s.view(torch.uint8), True
    return s, s.dtype == torch.uint8


def routed_experts_triton(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, first: int, fmt: str,
                          w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, s1: torch.Tensor | None,
                          s3: torch.Tensor | None, s2: torch.Tensor | None, limit: float) -> torch.Tensor:
    """Launch the four kernels; same contract as ``routed_experts.routed_experts_ref`` (arguments checked there)."""
    n_tokens, dim = x.shape
    top_k = idx.shape[1]
    n_experts, inter = w1.shape[0], w1.shape[1]
    n_pairs = n_tokens * top_k
    out = torch.empty_like(x)
    if n_pairs == 0:
        return out.zero_()
    fmt_id = FORMATS[fmt]
    if fmt == "fp4":
        w1, w3, w2 = (w.view(torch.uint8) for w in (w1, w3, w2))
    (s1, e8m0), (s3, e8m0_3), (s2, e8m0_2) = (_scale_arg(s, w) for s, w in ((s1, w1), (s3, w3), (s2, w2)))
    if not e8m0 == e8m0_3 == e8m0_2:
        raise ValueError("s1, s3 and s2 must all be e8m0 or all be float")
    if w1.stride() != w3.stride() or (s1 is not w1 and s1.stride() != s3.stride()):
        raise ValueError("w1/w3 (and s1/s3) must share strides")
    idx = idx.contiguous()
    weights = weights.contiguous()
    cfg = LaunchConfig(n_pairs, n_experts, dim, x.dtype)
    kind = _KINDS[x.dtype]
    dot_fp32 = x.dtype == torch.float32 or _interpreting()
    shapes = intermediate_shapes(n_pairs, n_experts, dim, inter)
    counts = torch.empty(shapes["counts"], dtype=torch.int32, device=x.device)
    order = torch.empty(shapes["order"], dtype=torch.int32, device=x.device)
    h = torch.empty(shapes["h"], dtype=x.dtype, device=x.device)
    y = torch.empty(shapes["y"], dtype=x.dtype, device=x.device)

    _sort_pairs_kernel[(1,)](idx, counts, order, n_pairs, first, n_experts,
                             BLOCK_P=cfg.block_p, BLOCK_E=cfg.block_e, num_warps=cfg.sort_warps)
    common = dict(FMT=fmt_id, SCALE_E8M0=e8m0, KIND=kind, DOT_FP32=dot_fp32, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=cfg.block_e, num_warps=cfg.num_warps)
    _gate_up_kernel[(cfg.row_blocks, triton.cdiv(inter, cfg.block_n))](
        x, x.stride(0), x.stride(1), order, counts,
        w1, w3, w1.stride(0), w1.stride(1), w1.stride(2), s1, s3, s1.stride(0), s1.stride(1), s1.stride(2),
        h, n_experts, top_k, dim, inter, float(limit), **common,
    )
    _down_kernel[(cfg.row_blocks, triton.cdiv(dim, cfg.block_n))](
        h, order, counts,
        w2, w2.stride(0), w2.stride(1), w2.stride(2), s2, s2.stride(0), s2.stride(1), s2.stride(2),
        y, n_experts, dim, inter, **common,
    )
    _combine_kernel[(n_tokens, triton.cdiv(dim, cfg.block_d))](
        y, idx, weights, out, out.stride(0), out.stride(1), first, n_experts, top_k, dim,
        KIND=kind, BLOCK_D=cfg.block_d, num_warps=4,
    )
    return out

