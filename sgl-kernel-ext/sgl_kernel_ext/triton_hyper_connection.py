"""Triton kernels of ``hyper_connection``: ``hc_pre`` and ``hc_post``, one launch each.

hc_pre: one program per BLOCK_N tokens. Pass 1 walks the flattened streams (hc x D) in BLOCK_K tiles, summing the
squares and the three projections (pre, post, comb rows of ``fn``) as broadcast products reduced over K, in fp32
(IEEE: no TF32; at decode sizes this is a few hundred thousand MACs per token, not worth tensor cores). The RMS
factor is applied to the sums afterwards. The 2 hc + hc^2 values per token then go through the sigmoids, the
softmax and the Sinkhorn rounds in registers (hc padded to HCP, a power of two >= 4, padded cells held at 0). Pass 2
re-reads the streams in BLOCK_D tiles for the collapse. With an output weight (HAS_W), pass 2 also sums the squares of
the collapse rounded to the streams' dtype and stores that rounded collapse in the output as scratch (exact: the
output's dtype holds the streams'); after a block barrier, pass 3 reads the program's own rows back and overwrites
them with the weighted RMSNorm (a token's D values do not stay in registers either). hc_post: one program per
(token, BLOCK_D channels).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _hc_pre_kernel(
    x_ptr, x_sn, x_sh, x_sd,
    fn_ptr, fn_sr, fn_sk,
    base_ptr, scale_ptr,
    col_ptr, col_sn,
    post_ptr, comb_ptr,
    w_ptr, w_sd,
    N, DIM, eps, norm_eps, out_eps,
    HC: tl.constexpr, HCP: tl.constexpr, ITERS: tl.constexpr, HAS_W: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    x_rows = x_ptr + offs_n.to(tl.int64) * x_sn
    offs_p = tl.arange(0, HCP)  # stream i (pre / post rows)
    mask_p = offs_p < HC
    offs_c = tl.arange(0, HCP * HCP)  # comb cell (i, j) = (c // HCP, c % HCP)
    ci = offs_c // HCP
    cj = offs_c % HCP
    mask_c = (ci < HC) & (cj < HC)
    comb_rows = 2 * HC + ci * HC + cj
    K = HC * DIM

    sq = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_pre = tl.zeros([BLOCK_N, HCP], dtype=tl.float32)
    acc_post = tl.zeros([BLOCK_N, HCP], dtype=tl.float32)
    acc_comb = tl.zeros([BLOCK_N, HCP * HCP], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        h = offs_k // DIM
        d = offs_k % DIM
        x = tl.load(x_rows[:, None] + h[None, :] * x_sh + d[None, :] * x_sd,
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        sq += tl.sum(x * x, axis=1)
        f_pre = tl.load(fn_ptr + offs_p[:, None] * fn_sr + offs_k[None, :] * fn_sk,
                        mask=mask_p[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        f_post = tl.load(fn_ptr + (HC + offs_p)[:, None] * fn_sr + offs_k[None, :] * fn_sk,
                         mask=mask_p[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        f_comb = tl.load(fn_ptr + comb_rows[:, None] * fn_sr + offs_k[None, :] * fn_sk,
                         mask=mask_c[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc_pre += tl.sum(x[:, None, :] * f_pre[None, :, :], axis=2)
        acc_post += tl.sum(x[:, None, :] * f_post[None, :, :], axis=2)
        acc_comb += tl.sum(x[:, None, :] * f_comb[None, :, :], axis=2)
    inv = 1.0 / tl.sqrt(sq / K + norm_eps)

    s_pre = tl.load(scale_ptr).to(tl.float32)
    s_post = tl.load(scale_ptr + 1).to(tl.float32)
    s_comb = tl.load(scale_ptr + 2).to(tl.float32)
    b_pre = tl.load(base_ptr + offs_p, mask=mask_p, other=0.0).to(tl.float32)
    b_post = tl.load(base_ptr + HC + offs_p, mask=mask_p, other=0.0).to(tl.float32)
    b_comb = tl.load(base_ptr + comb_rows, mask=mask_c, other=0.0).to(tl.float32)
    pre = tl.sigmoid(acc_pre * inv[:, None] * s_pre + b_pre[None, :]) + eps
    post = 2.0 * tl.sigmoid(acc_post * inv[:, None] * s_post + b_post[None, :])

    z = acc_comb * inv[:, None] * s_comb + b_comb[None, :]
    z3 = tl.reshape(tl.where(mask_c[None, :], z, float("-inf")), (BLOCK_N, HCP, HCP))
    valid3 = tl.reshape(tl.broadcast_to(mask_c[None, :], (BLOCK_N, HCP * HCP)), (BLOCK_N, HCP, HCP))
    row_max = tl.max(z3, axis=2)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # a padded row: no -inf - -inf
    z3 = tl.where(valid3, z3 - row_max[:, :, None], float("-inf"))
    e3 = tl.where(valid3, tl.exp(z3), 0.0)
    comb = tl.where(valid3, e3 / (tl.sum(e3, axis=2)[:, :, None] + 1e-30) + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)

    out_n = offs_n.to(tl.int64)
    tl.store(post_ptr + out_n[:, None] * HC + offs_p[None, :], post, mask=mask_n[:, None] & mask_p[None, :])
    comb_flat = tl.reshape(comb, (BLOCK_N, HCP * HCP))
    tl.store(comb_ptr + out_n[:, None] * (HC * HC) + (ci * HC + cj)[None, :], comb_flat,
             mask=mask_n[:, None] & mask_c[None, :])

    x_dt = x_ptr.dtype.element_ty
    col_dt = col_ptr.dtype.element_ty
    col_rows = col_ptr + out_n[:, None] * col_sn
    sq_col = tl.zeros([BLOCK_N], dtype=tl.float32)
    for d0 in range(0, DIM, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < DIM
        x3 = tl.load(x_rows[:, None, None] + offs_p[None, :, None] * x_sh + offs_d[None, None, :] * x_sd,
                     mask=mask_n[:, None, None] & mask_p[None, :, None] & mask_d[None, None, :],
                     other=0.0).to(tl.float32)
        collapsed = tl.sum(x3 * pre[:, :, None], axis=1).to(x_dt)
        if HAS_W:
            c = collapsed.to(tl.float32)
            sq_col += tl.sum(c * c, axis=1)  # padded lanes and rows collapse to 0
        tl.store(col_rows + offs_d[None, :], collapsed.to(col_dt), mask=mask_n[:, None] & mask_d[None, :])

    if HAS_W:
        tl.debug_barrier()  # this program's scratch stores are visible to all its threads
        inv_col = 1.0 / tl.sqrt(sq_col / DIM + out_eps)
        for d0 in range(0, DIM, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < DIM
            mask = mask_n[:, None] & mask_d[None, :]
            c = tl.load(col_rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs_d * w_sd, mask=mask_d, other=0.0).to(tl.float32)
            y = (c * inv_col[:, None]).to(x_dt).to(tl.float32) * w[None, :]
            tl.store(col_rows + offs_d[None, :], y.to(col_dt), mask=mask)


@triton.jit
def _hc_post_kernel(
    o_ptr, o_sn, o_sd,
    x_ptr, x_sn, x_sh, x_sd,
    post_ptr, post_sn, post_sh,
    comb_ptr, comb_sn, comb_si, comb_sj,
    y_ptr, y_sn, y_sh,
    DIM,
    HC: tl.constexpr, HCP: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < DIM
    offs_h = tl.arange(0, HCP)
    mask_h = offs_h < HC
    dt = y_ptr.dtype.element_ty
    o = tl.load(o_ptr + n * o_sn + offs_d * o_sd, mask=mask_d, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + n * x_sn + offs_h[:, None] * x_sh + offs_d[None, :] * x_sd,
                mask=mask_h[:, None] & mask_d[None, :], other=0.0).to(tl.float32)  # [j, d]
    post = tl.load(post_ptr + n * post_sn + offs_h * post_sh, mask=mask_h, other=0.0).to(dt).to(tl.float32)
    comb = tl.load(comb_ptr + n * comb_sn + offs_h[:, None] * comb_si + offs_h[None, :] * comb_sj,
                   mask=mask_h[:, None] & mask_h[None, :], other=0.0).to(dt).to(tl.float32)  # [j, i]
    spread = (post[:, None] * o[None, :]).to(dt).to(tl.float32)  # [i, d]
    mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0).to(dt).to(tl.float32)  # [i, d]
    tl.store(y_ptr + n * y_sn + offs_h[:, None] * y_sh + offs_d[None, :], (spread + mixed).to(dt),
             mask=mask_h[:, None] & mask_d[None, :])


def _hcp(hc: int) -> int:
    return max(4, triton.next_power_of_2(hc))


def hc_pre_triton(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                  eps: float, norm_eps: float, out_weight: torch.Tensor | None = None, out_eps: float = 0.0,
                  out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out_dtype: the first output's dtype (the promoted dtype of streams and out_weight; streams' without it)."""
    n, hc, dim = streams.shape
    collapsed = streams.new_empty(n, dim, dtype=out_dtype or streams.dtype)
    post = streams.new_empty(n, hc, dtype=torch.float32)
    comb = streams.new_empty(n, hc, hc, dtype=torch.float32)
    if n == 0:
        return collapsed, post, comb
    hcp = _hcp(hc)
    block_n = min(8, triton.next_power_of_2(n))
    block_k = max(16, 4096 // (block_n * hcp * hcp))
    block_d = max(16, 4096 // (block_n * hcp))
    _hc_pre_kernel[(triton.cdiv(n, block_n),)](
        streams, streams.stride(0), streams.stride(1), streams.stride(2),
        fn, fn.stride(0), fn.stride(1),
        base.contiguous(), scale.contiguous(),
        collapsed, collapsed.stride(0),
        post, comb,
        collapsed if out_weight is None else out_weight, 0 if out_weight is None else out_weight.stride(0),
        n, dim, float(eps), float(norm_eps), float(out_eps),
        HC=hc, HCP=hcp, ITERS=max(int(iters), 1), HAS_W=out_weight is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_D=block_d,
        num_warps=4,
    )
    return collapsed, post, comb


def hc_post_triton(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    n, hc, dim = streams.shape
    y = torch.empty((n, hc, dim), dtype=streams.dtype, device=streams.device)
    if n == 0:
        return y
    hcp = _hcp(hc)
    block_d = min(1024, triton.next_power_of_2(dim))
    _hc_post_kernel[(n, triton.cdiv(dim, block_d))](
        out, out.stride(0), out.stride(1),
        streams, streams.stride(0), streams.stride(1), streams.stride(2),
        post, post.stride(0), post.stride(1),
        comb, comb.stride(0), comb.stride(1), comb.stride(2),
        y, y.stride(0), y.stride(1),
        dim,
        HC=hc, HCP=hcp, BLOCK_D=block_d,
        num_warps=4,
    )
    return y
