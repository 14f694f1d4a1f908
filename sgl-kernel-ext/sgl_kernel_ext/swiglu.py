"""DeepSeek-V4's clamped SwiGLU as one op (one launch on a GPU instead of four): ``swiglu_op(gate, up, limit)``.

Contract
--------
swiglu_op(gate[..., I], up[..., I], limit) -> ``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in gate's dtype:
the silu rounded to that dtype, then the product (of two values of it, in fp32) rounded once, as torch computes
them. The paths agree up to the last bit of exp.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import traffic
from .ops import _backend, plain_reference
from .routed_experts import swiglu as swiglu_ref


@torch.library.custom_op("sgl_kernel_ext::swiglu", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor, limit: float, backend: Optional[str] = None) -> torch.Tensor:
    if _backend(backend, gate) == "torch":
        return swiglu_ref(gate, up, limit)
    from .triton_swiglu import swiglu_triton

    return swiglu_triton(gate, up, limit)


@_swiglu_op.register_fake
def _(gate, up, limit, backend=None):
    return gate.new_empty(gate.shape)


@traffic.declare("sgl_kernel_ext::swiglu")
def swiglu_traffic(gate, up, limit, backend=None) -> traffic.Traffic:
    """gate and up read once, the product written once; one launch (plus a copy of an input whose rows do not have
    one stride with unit-strided columns: rows at any stride, e.g. column slices of a fused projection, need
    none)."""
    moved = traffic.Traffic(traffic.nbytes(gate) + traffic.nbytes(up), traffic.nbytes(gate), 1)
    for t in (gate, up):
        if not _row_strided(t):
            moved = moved + traffic.Traffic(traffic.nbytes(t), traffic.nbytes(t), 1)
    return moved


def _row_strided(t: torch.Tensor) -> bool:
    """Whether ``t`` flattens to ``[rows, columns]`` without a copy, columns unit-strided (what the kernel reads
    in place)."""
    if t.dim() == 0 or t.shape[-1] <= 1:
        return True
    if t.stride(-1) != 1:
        return False
    lead = [(size, stride) for size, stride in zip(t.shape[:-1], t.stride()[:-1], strict=True) if size > 1]
    return all(outer == inner_size * inner for (_, outer), (inner_size, inner) in zip(lead, lead[1:], strict=False))


def swiglu_op(gate: torch.Tensor, up: torch.Tensor, limit: float, *, backend: str | None = None) -> torch.Tensor:
    """The clamped SwiGLU of the module doc."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must match, got {tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} "
                         f"{up.dtype}")
    if plain_reference(backend, gate, up):
        return swiglu_ref(gate, up, limit)
    return torch.ops.sgl_kernel_ext.swiglu(gate, up, float(limit), backend)
