"""RMSNorm then V4's partial interleaved RoPE as one op (one launch on a GPU instead of two, and one round trip of
the normalised rows through memory fewer): ``rms_norm_rope(x, weight, eps, cos, sin)``.

Contract
--------
rms_norm_rope(x[T, H, D], weight[D] | None, eps, cos[T, R], sin[T, R]) -> [T, H, D], exactly
``rope_rotate(rms_norm(x, weight, eps), cos, sin)`` (the forward rotation): each (token, head) row is normalised
over D as ``rms_norm``'s contract says (fp32, rounded to x's dtype X, then with a weight the product in fp32
rounded to Y, the promoted dtype of x and the weight; Y = X without one), then its last ``2R`` channels, as pairs
``(2i, 2i+1)``, rotated by the token's angle as ``rope_rotate``'s contract says (fp32 from the values in Y, rounded
once to Y); the first ``D - 2R`` channels are the normalised ones. Output dtype Y. The two roundings before the
rotation are the model's (it ran the two ops back to back), so the fused kernel keeps them rather than rotating
the fp32 normalised values. The paths agree up to the fp32 order of the sum of squares and the GPU's fused
multiply-adds.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import traffic
from .ops import _backend, plain_reference
from .rms_norm import norm_dtype, rms_norm_ref
from .rope import rope_rotate_ref


def rms_norm_rope_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
    """The two references composed, so the CPU path is bit for bit what the model computed with the two ops."""
    return rope_rotate_ref(rms_norm_ref(x, weight, eps), cos, sin)


@torch.library.custom_op("sgl_kernel_ext::rms_norm_rope", mutates_args=())
def _rms_norm_rope_op(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, cos: torch.Tensor,
                      sin: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
    if _backend(backend, x) == "torch":
        return rms_norm_rope_ref(x, weight, eps, cos, sin)
    from .triton_rms_norm_rope import rms_norm_rope_triton

    return rms_norm_rope_triton(x, weight, eps, cos, sin, norm_dtype(x, weight))


@_rms_norm_rope_op.register_fake
def _(x, weight, eps, cos, sin, backend=None):
    return x.new_empty(x.shape, dtype=norm_dtype(x, weight))


@traffic.declare("sgl_kernel_ext::rms_norm_rope")
def rms_norm_rope_traffic(x, weight, eps, cos, sin, backend=None) -> traffic.Traffic:
    """x, the weight, cos and sin read once, the result written once; one launch. The kernel takes x, the weight
    and cos/sin at any strides, so no copy is ever made (the normalised rows never reach memory)."""
    out = x.numel() * torch.empty((), dtype=norm_dtype(x, weight), device="meta").element_size()
    read = traffic.nbytes(x) + traffic.nbytes(weight) + traffic.nbytes(cos) + traffic.nbytes(sin)
    return traffic.Traffic(read, out, 1)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  *, backend: str | None = None) -> torch.Tensor:
    """RMS-normalise every head of x over its D channels, then rotate the last ``2 * cos.shape[-1]`` of them (see
    the module doc)."""
    if x.dim() != 3:
        raise ValueError(f"rms_norm_rope: x must be [T, H, D], got {tuple(x.shape)}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != x.shape[0]:
        raise ValueError(f"rms_norm_rope: cos and sin must both be [T, R] with T = {x.shape[0]} (x's tokens), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if not 1 <= cos.shape[1] <= x.shape[2] // 2:  # R = 0 too: the reference's ``x[..., -0:]`` is the whole row
        raise ValueError(f"rms_norm_rope: the rotated width 2R = {2 * cos.shape[1]} must be in [2, D] with D = "
                         f"{x.shape[2]}")
    if weight is not None and weight.shape != (x.shape[2],):
        raise ValueError(f"rms_norm_rope: weight must be [{x.shape[2]}], got {tuple(weight.shape)}")
    for name, t in (("x", x), ("weight", weight), ("cos", cos), ("sin", sin)):
        if t is not None and not t.is_floating_point():
            raise ValueError(f"rms_norm_rope: {name} must be a floating-point tensor, got {t.dtype}")
    if plain_reference(backend, x, weight, cos, sin):
        return rms_norm_rope_ref(x, weight, eps, cos, sin)
    return torch.ops.sgl_kernel_ext.rms_norm_rope(x, weight, float(eps), cos, sin, backend)
