"""RMSNorm as one op (one launch on a GPU instead of six): ``rms_norm(x, weight, eps)``.

Contract
--------
rms_norm(x[..., C], weight[C] | None, eps) -> ``y = round_X(x * rsqrt(mean(x^2) + eps))`` over the last dimension
(x upcast to fp32, X = x's dtype), then with a weight ``round_Y(weight * y)`` with Y the promoted dtype of weight
and x (the product of two values of X computed in fp32 and rounded once, as torch does). The two paths agree up to
the fp32 order of the sum of squares.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import traffic
from .ops import _backend, plain_reference


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y


def norm_dtype(x: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    """The dtype of ``rms_norm(x, weight, ...)`` (Y of the contract): x's, or promoted with the weight's."""
    return x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)


@torch.library.custom_op("sgl_kernel_ext::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                 backend: Optional[str] = None) -> torch.Tensor:
    if _backend(backend, x) == "torch":
        return rms_norm_ref(x, weight, eps)
    from .triton_rms_norm import rms_norm_triton

    return rms_norm_triton(x, weight, eps, norm_dtype(x, weight))


@_rms_norm_op.register_fake
def _(x, weight, eps, backend=None):
    return x.new_empty(x.shape, dtype=norm_dtype(x, weight))


@traffic.declare("sgl_kernel_ext::rms_norm")
def rms_norm_traffic(x, weight, eps, backend=None) -> traffic.Traffic:
    """x and the weight read once, y written once; one launch (plus a copy when x's rows are not unit-strided)."""
    out = math.prod(x.shape) * torch.empty((), dtype=norm_dtype(x, weight), device="meta").element_size()
    moved = traffic.Traffic(traffic.nbytes(x) + traffic.nbytes(weight), out, 1)
    if x.dim() and x.stride(-1) != 1:
        moved = moved + traffic.Traffic(traffic.nbytes(x), traffic.nbytes(x), 1)
    return moved


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, backend: str | None = None) -> torch.Tensor:
    """RMS-normalise the last dimension of x (see the module doc)."""
    if weight is not None and weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if plain_reference(backend, x, weight):
        return rms_norm_ref(x, weight, eps)
    return torch.ops.sgl_kernel_ext.rms_norm(x, weight, float(eps), backend)
