"""The fuse-the-projections step, run once the weights are loaded: linears that read the same input become one
matmul, and weights the forward would otherwise rearrange every step are stored rearranged.

Why: at decode sizes a V4 layer is launch-bound (``step_cost``); each of these is a launch per layer per forward:

* attention: ``wq_a`` and ``wkv`` (both read the normalised block input) -> ``Attention.q_kv_a``;
* the compressors' ``wkv`` and ``wgate``, and in a CSA layer the indexer compressor's and the indexer's head
  weights ``weights_proj`` -> ``Attention.compress_proj``. Its columns are the compressor pieces in the store's row
  order, so a CSA layer writes all four with one scatter (``SlotStore.write_pieces``);
* the shared expert's ``w1`` and ``w3`` -> ``MLP.w13``;
* a CSA compressor's position biases as the pooling reads them (``Compressor.pooled_ape``), an HCA compressor's in
  fp32 (``HcaCompressor.ape_f32``).

Stacking rows changes no product: every output column is the same dot product as before. FP8 block-scaled parts
stack with their scale rows, which needs every part but the last to end on a 128-row block and every part to start
on one (a tensor-parallel shard that starts inside a block keeps its own linear). The model's forward takes the
fused module where it exists and the separate ones otherwise (a model used for training or saved as a checkpoint is
never fused). DSpark's stages are left alone: its context writer calls their ``wkv`` directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sgl_kernel_ext.fp8_linear import fp8_block_linear
from sgl_kernel_ext.weight_formats import FP8_BLOCK, FP8_DTYPE

from ..dsv4.attention import Attention
from ..dsv4.compressor import Compressor
from ..dsv4.hca_compressor import HcaCompressor
from ..dsv4.moe import MLP


class FusedLinear(nn.Module):
    """``y = x [W_1; W_2; ...]^T``: several column-parallel or replicated linears of one input as one matmul (FP8
    block-scaled or dense); ``widths`` are the parts' output columns, for the caller's split."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None, widths: list[int]):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.widths = widths

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            return fp8_block_linear(x, self.weight, self.scale)
        return F.linear(x, self.weight.to(x.dtype))

    @staticmethod
    def of(parts: list[nn.Module]) -> "FusedLinear | None":
        """The parts stacked, or None where they cannot be (mixed formats, a bias, an FP8 part off the blocks)."""
        held = [_local(p) for p in parts]
        if any(h is None for h in held):
            return None
        weights = [w for w, _, _ in held]
        if len({w.shape[1] for w in weights}) != 1 or len({w.dtype for w in weights}) != 1:
            return None
        widths = [w.shape[0] for w in weights]
        if weights[0].dtype != FP8_DTYPE:
            return FusedLinear(torch.cat(weights), None, widths)
        scales = [s for _, s, _ in held]
        if any(off != (0, 0) for _, _, off in held) or any(n % FP8_BLOCK for n in widths[:-1]) \
                or len({s.shape[1] for s in scales}) != 1 or len({s.dtype for s in scales}) != 1:
            return None
        scales = [s[: -(-n // FP8_BLOCK)] for s, n in zip(scales, widths, strict=True)]
        return FusedLinear(torch.cat(weights), torch.cat(scales), widths)


def _local(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int]] | None:
    """(weight, FP8 scale or None, block offsets) this rank holds of a bias-free linear whose forward is a local
    matmul: ``nn.Linear``, ``FP8BlockLinear`` or SGLang's column-parallel layer (which gathers nothing)."""
    if getattr(linear, "bias", None) is not None or getattr(linear, "gather_output", False):
        return None
    if getattr(linear, "reduce_results", False) or getattr(linear, "input_is_parallel", False):
        return None  # row-parallel: its matmul is followed by (or needs) a collective
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    scale = getattr(linear, "scale", None) if weight.dtype == FP8_DTYPE else None
    if weight.dtype == FP8_DTYPE and scale is None:
        return None
    return weight.data, None if scale is None else scale.data, tuple(getattr(linear, "offsets", (0, 0)))


def fuse_attention(attn: Attention) -> int:
    """Fuse one attention module's projections (``Attention.q_kv_a``, ``compress_proj``) and store its
    compressors' biases as read; returns how many fused linears it made."""
    made = 0
    q_kv = FusedLinear.of([attn.wq_a, attn.wkv])
    if q_kv is not None:
        attn.q_kv_a, attn.wq_a, attn.wkv = q_kv, None, None
        made += 1
    comp = attn.compressor
    if comp is None:
        return made
    parts = [comp.wkv, comp.wgate]
    if attn.indexer is not None:
        ic = attn.indexer.compressor
        parts += [ic.wkv, ic.wgate, attn.indexer.weights_proj]
    proj = FusedLinear.of(parts)
    if proj is not None:
        attn.compress_proj = proj
        comp.wkv = comp.wgate = None
        if attn.indexer is not None:
            ic.wkv = ic.wgate = attn.indexer.weights_proj = None
        made += 1
    for c in (comp, attn.indexer.compressor if attn.indexer is not None else None):
        if isinstance(c, Compressor):
            c.pooled_ape = c.pool_ape().detach().clone()
        elif isinstance(c, HcaCompressor):
            c.ape_f32 = c.ape.detach().float().clone()
    return made


def fuse_mlp(mlp: MLP) -> int:
    w13 = FusedLinear.of([mlp.w1, mlp.w3])
    if w13 is None:
        return 0
    mlp.w13, mlp.w1, mlp.w3 = w13, None, None
    return 1


def fuse_projections(model: nn.Module) -> int:
    """Fuse every target and MTP layer of ``model`` in place (after its weights are loaded, or on meta); returns
    the number of fused linears made."""
    made = 0
    for name, module in list(model.named_modules()):
        if name.split(".")[0] == "dspark":
            continue
        if isinstance(module, Attention):
            made += fuse_attention(module)
        elif isinstance(module, MLP):
            made += fuse_mlp(module)
    return made
