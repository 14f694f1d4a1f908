"""V4's partial, interleaved RoPE as one op (one launch on a GPU instead of seven): ``rope_rotate``.

Contract
--------
rope_rotate(x[T, H, D], cos[T, R], sin[T, R], inverse=False) -> [T, H, D] in x's dtype: the first ``D - 2R``
channels copied, the last ``2R`` rotated as pairs ``(2i, 2i+1)`` by each token's angle, in fp32:
``(e, o) -> (e c - o s, o c + e s)`` with ``s = sin`` (``-sin`` when ``inverse``: the rotation back), then rounded
once to x's dtype. The same rotation for every head of a token. The two paths agree up to the GPU's fused
multiply-adds.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import traffic
from .ops import _backend, plain_reference


def rope_rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    rd = 2 * cos.shape[-1]
    c, s = cos[:, None].float(), sin[:, None].float()
    if inverse:
        s = -s
    nope, rope = x[..., :-rd], x[..., -rd:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack([even * c - odd * s, odd * c + even * s], dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


@torch.library.custom_op("sgl_kernel_ext::rope_rotate", mutates_args=())
def _rope_rotate_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool,
                    backend: Optional[str] = None) -> torch.Tensor:
    if _backend(backend, x) == "torch":
        return rope_rotate_ref(x, cos, sin, inverse)
    from .triton_rope import rope_rotate_triton

    return rope_rotate_triton(x, cos, sin, inverse)


@_rope_rotate_op.register_fake
def _(x, cos, sin, inverse, backend=None):
    return torch.empty_like(x)


@traffic.declare("sgl_kernel_ext::rope_rotate")
def rope_rotate_traffic(x, cos, sin, inverse, backend=None) -> traffic.Traffic:
    """x, cos and sin read once, the result written once; one launch."""
    return traffic.Traffic(traffic.nbytes(x) + traffic.nbytes(cos) + traffic.nbytes(sin), traffic.nbytes(x), 1)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False, *,
                backend: str | None = None) -> torch.Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` channels of every head of x (see the module doc)."""
    if x.dim() != 3 or cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != x.shape[0] \
            or 2 * cos.shape[1] > x.shape[2]:
        raise ValueError(f"rope_rotate: x [T, H, D], cos/sin [T, R] with 2R <= D expected, got {tuple(x.shape)}, "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    if plain_reference(backend, x, cos, sin):
        return rope_rotate_ref(x, cos, sin, inverse)
    return torch.ops.sgl_kernel_ext.rope_rotate(x, cos, sin, bool(inverse), backend)
