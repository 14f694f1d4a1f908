"""DeepSeek-V4's hyper-connection mixing as two ops, one launch each on a GPU: ``hc_pre`` and ``hc_post``.

Why ops: in plain torch the pair is about 150 tiny launches per block (the Sinkhorn alone is 2 x iters), which at
decode sizes costs more than the block's matmuls. Each is one pass over a token's streams.

Contracts
---------
hc_pre(streams[N, hc, D], fn[(2 + hc) * hc, hc * D], base[(2 + hc) * hc], scale[3], iters, eps, norm_eps,
       *, out_weight[D] | None = None, out_eps = 0.0)
    -> (collapsed[N, D] in streams' dtype, post[N, hc] fp32, comb[N, hc, hc] fp32), all math in fp32:
    ``mix = rms(flat) @ fn^T`` with ``flat = streams[n].flatten()`` and ``rms(v) = v * rsqrt(mean(v^2) + norm_eps)``;
    ``mix`` splits into ``[hc | hc | hc * hc]`` columns (``base`` likewise; ``scale`` = one factor per part):
    ``pre = sigmoid(mix_pre * scale[0] + base_pre) + eps``, ``post = 2 sigmoid(mix_post * scale[1] + base_post)``,
    ``comb = softmax_j(mix_comb[i, j] * scale[2] + base_comb[i, j]) + eps``, then ``comb /= colsum + eps`` and
    ``iters - 1`` rounds of ``comb /= rowsum + eps; comb /= colsum + eps`` (Sinkhorn; colsum over i, rowsum over j);
    ``collapsed = round(sum_i pre[i] * streams[n, i])``.
    With ``out_weight`` the first output is instead the sub-block's RMSNorm of that (rounded) collapse, exactly
    ``rms_norm_ref(collapsed, out_weight, out_eps)`` (see ``rms_norm``): ``round_X(c * rsqrt(mean(c^2) + out_eps))``
    then ``round_Y(out_weight * that)``, in Y = the promoted dtype of streams and out_weight; post and comb unchanged.
    One launch either way (the norm costs one more write and read of the [N, D] output, see ``hc_pre_traffic``).
hc_post(out[N, D], streams[N, hc, D], post[N, hc], comb[N, hc, hc]) -> [N, hc, D] in streams' dtype X:
    ``new[i] = round(round(post_X[i] * out) + round(sum_j comb_X[j, i] * streams[j]))`` with ``post_X`` and
    ``comb_X`` post and comb rounded to X, products and the sum over j in fp32.

The two paths agree up to fp32 summation order (and the GPU's exp). The references are the CPU path and what
autograd runs (training): the custom ops have no backward.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import traffic
from .ops import _backend, plain_reference
from .rms_norm import norm_dtype, rms_norm_ref


def hc_pre_ref(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
               eps: float, norm_eps: float, out_weight: torch.Tensor | None = None,
               out_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hc = streams.shape[1]
    flat = streams.flatten(1).float()
    normed = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mix = normed @ fn.float().t()
    pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * s_comb + comb_b.view(hc, hc), dim=-1) + eps
    comb = sinkhorn(comb, iters, eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)
    if out_weight is not None:
        collapsed = rms_norm_ref(collapsed, out_weight, out_eps)
    return collapsed, post, comb


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Column-normalise, then ``iters - 1`` rounds of row + column normalisation (each sum offset by eps); in
    place unless autograd needs the intermediate values."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    if torch.is_grad_enabled() and comb.requires_grad:
        for _ in range(iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + eps)
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
        return comb
    e = torch.full((), eps, dtype=comb.dtype, device=comb.device)  # a tensor: no per-op scalar wrapping
    for _ in range(iters - 1):
        comb.div_(comb.sum(-1, keepdim=True).add_(e))
        comb.div_(comb.sum(-2, keepdim=True).add_(e))
    return comb


def hc_post_ref(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(1) + comb.to(dt).transpose(1, 2) @ streams


def _check_pre(streams, fn, base, scale, out_weight=None):
    if streams.dim() != 3:
        raise ValueError(f"streams must be [N, hc, D], got {tuple(streams.shape)}")
    _, hc, dim = streams.shape
    rows = (2 + hc) * hc
    if fn.shape != (rows, hc * dim) or base.shape != (rows,) or scale.shape != (3,):
        raise ValueError(f"fn [{rows}, {hc * dim}], base [{rows}], scale [3] expected for streams "
                         f"{tuple(streams.shape)}, got {tuple(fn.shape)}, {tuple(base.shape)}, {tuple(scale.shape)}")
    if out_weight is not None and out_weight.shape != (dim,):
        raise ValueError(f"out_weight must be [{dim}] for streams {tuple(streams.shape)}, got "
                         f"{tuple(out_weight.shape)}")


@torch.library.custom_op("sgl_kernel_ext::hc_pre", mutates_args=())
def _hc_pre_op(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
               eps: float, norm_eps: float, out_weight: Optional[torch.Tensor] = None, out_eps: float = 0.0,
               backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _backend(backend, streams) == "torch":
        return hc_pre_ref(streams, fn, base, scale, iters, eps, norm_eps, out_weight, out_eps)
    from .triton_hyper_connection import hc_pre_triton

    return hc_pre_triton(streams, fn, base, scale, iters, eps, norm_eps, out_weight, out_eps,
                         norm_dtype(streams, out_weight))


@_hc_pre_op.register_fake
def _(streams, fn, base, scale, iters, eps, norm_eps, out_weight=None, out_eps=0.0, backend=None):
    n, hc, dim = streams.shape
    f32 = torch.float32
    return (streams.new_empty(n, dim, dtype=norm_dtype(streams, out_weight)),
            streams.new_empty(n, hc, dtype=f32), streams.new_empty(n, hc, hc, dtype=f32))


@traffic.declare("sgl_kernel_ext::hc_pre")
def hc_pre_traffic(streams, fn, base, scale, iters, eps, norm_eps, out_weight=None, out_eps=0.0,
                   backend=None) -> traffic.Traffic:
    """Streams read twice (the mix, then the collapse: a token's hc x D values do not stay in registers), the
    projection once (its tiles are shared by the token blocks through L2), the three outputs written once; one
    launch. With ``out_weight``: the weight read once (shared through L2 like the projection), and the [N, D]
    output written twice and read once in between (the collapse pass stores the rounded collapse there while
    summing its squares, then the norm pass reads it back and overwrites it with the normalised values)."""
    n, hc, dim = streams.shape
    read = 2 * traffic.nbytes(streams) + traffic.nbytes(fn) + traffic.nbytes(base) + traffic.nbytes(scale)
    out = n * dim * torch.empty((), dtype=norm_dtype(streams, out_weight), device="meta").element_size()
    written = out + 4 * n * (hc + hc * hc)
    if out_weight is not None:
        read += traffic.nbytes(out_weight) + out
        written += out
    return traffic.Traffic(read, written, 1)


@torch.library.custom_op("sgl_kernel_ext::hc_post", mutates_args=())
def _hc_post_op(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                backend: str | None = None) -> torch.Tensor:
    if _backend(backend, streams) == "torch":
        return hc_post_ref(out, streams, post, comb)
    from .triton_hyper_connection import hc_post_triton

    return hc_post_triton(out, streams, post, comb)


@_hc_post_op.register_fake
def _(out, streams, post, comb, backend=None):
    return torch.empty_like(streams)


@traffic.declare("sgl_kernel_ext::hc_post")
def hc_post_traffic(out, streams, post, comb, backend=None) -> traffic.Traffic:
    """Every input read once, the new streams written once; one launch."""
    read = sum(traffic.nbytes(t) for t in (out, streams, post, comb))
    return traffic.Traffic(read, traffic.nbytes(streams), 1)


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
           norm_eps: float, *, out_weight: torch.Tensor | None = None, out_eps: float = 0.0,
           backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(collapsed, post, comb) of the streams, collapsed RMS-normalised with ``out_weight`` when given (see the
    module doc)."""
    _check_pre(streams, fn, base, scale, out_weight)
    if plain_reference(backend, streams, fn, base, scale, out_weight):
        return hc_pre_ref(streams, fn, base, scale, iters, eps, norm_eps, out_weight, out_eps)
    return torch.ops.sgl_kernel_ext.hc_pre(streams, fn, base, scale, int(iters), float(eps), float(norm_eps),
                                           out_weight, float(out_eps), backend)


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
            backend: str | None = None) -> torch.Tensor:
    """The new streams after a sub-block whose output is ``out`` (see the module doc)."""
    n, hc, dim = streams.shape
    if out.shape != (n, dim) or post.shape != (n, hc) or comb.shape != (n, hc, hc):
        raise ValueError(f"hc_post: out [{n}, {dim}], post [{n}, {hc}], comb [{n}, {hc}, {hc}] expected, got "
                         f"{tuple(out.shape)}, {tuple(post.shape)}, {tuple(comb.shape)}")
    if plain_reference(backend, streams, out, post, comb):
        return hc_post_ref(out, streams, post, comb)
    return torch.ops.sgl_kernel_ext.hc_post(out, streams, post, comb, backend)
