"""Weights kept in the checkpoint's own low precision, dequantised tile by tile inside the matmul.

The published DeepSeek-V4 layout keeps FP8 block-scaled linears (attention, indexer ``wq_b``, shared experts, MTP
projections) and FP4 routed experts; the formats themselves are ``sgl_kernel_ext.weight_formats``.

Resident bytes stay those of the checkpoint: FP8 scales are kept in the dense dtype (one per 16,384 weights; powers
of two are exact in bf16 too), FP4 scales as their e8m0 byte (one per 32 weights; float32 would add 25 %). The torch
code here is the CPU path and the reference for GPU kernels: each forward dequantises one block of output rows (or
one expert) at a time, so temporaries are bounded by a block, never the whole weight.
"""

from __future__ import annotations

import torch
from torch import nn

from sgl_kernel_ext.fp8_linear import fp8_block_linear
from sgl_kernel_ext.weight_formats import (
    FP4_GROUP,
    FP8_BLOCK,
    FP8_DTYPE,
    dequantize_fp4,
)

from ..dsv4.moe import Experts


class FP8BlockLinear(nn.Module):
    """``y = x W^T`` with ``W`` FP8 e4m3 and one power-of-two scale per 128 x 128 block (DeepSeek's layout), as
    one ``sgl_kernel_ext.fp8_block_linear`` call: the Triton kernel on a GPU, the block-by-block reference on the
    CPU, shapes only on meta."""

    offsets = (0, 0)  # a whole matrix starts on a block boundary

    def __init__(self, in_features: int, out_features: int, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer("scale", torch.empty(-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK),
                                                  dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_block_linear(x, self.weight, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, 128x128 block scales"


class FP4Experts(Experts):
    """Routed experts with FP4 weights: ``w1, w3 [E, I, D/2]``, ``w2 [E, D, I/2]`` packed bytes and their e8m0
    scales ``w*_scale [E, out, in/32]``. Used through ``Experts``' interface: ``expert(e)`` dequantises one expert;
    the forward (``Experts``') hands the packed bytes to ``sgl_kernel_ext.routed_experts``, which dequantises only
    the routed experts (tile by tile in registers on a GPU, one expert at a time on the CPU)."""

    def __init__(self, n: int, dim: int, inter: int, limit: float, device=None, first: int = 0):
        nn.Module.__init__(self)
        self.limit, self.first = limit, first
        for name, (out, inp) in (("w1", (inter, dim)), ("w2", (dim, inter)), ("w3", (inter, dim))):
            self.register_buffer(name, torch.empty(n, out, inp // 2, dtype=torch.uint8, device=device))
            self.register_buffer(name + "_scale", torch.empty(n, out, inp // FP4_GROUP, dtype=torch.uint8,
                                                              device=device))

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(dequantize_fp4(getattr(self, n)[e], getattr(self, n + "_scale")[e]) for n in ("w1", "w3", "w2"))

    def kernel_weights(self) -> tuple:
        return "fp4", self.w1, self.w3, self.w2, self.w1_scale, self.w3_scale, self.w2_scale
