"""The pieces the target model and the MTP layer share: one V4 block (hyper-connected attention + MoE) and the
output both return. A module of its own so that ``model`` (which owns the MTP layers) and ``mtp`` (whose block is a
V4 block) import it and not each other."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .attention import Attention
from .config import DSV4Config
from .hyper import HyperConnection
from .moe import MoE
from .norm import RMSNorm
from .rope import Rope
from .storage import ForwardBatch, SlotStore


class Block(nn.Module):
    """HC-pre -> RMSNorm -> attention -> HC-post, then the same around the MoE."""

    def __init__(self, cfg: DSV4Config, ratio: int, hashed: bool):
        super().__init__()
        self.ratio = ratio
        self.attn = Attention(cfg, ratio)
        self.ffn = MoE(cfg, hashed)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        args = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.hc_attn = HyperConnection(*args)
        self.hc_ffn = HyperConnection(*args)

    def forward(self, h: torch.Tensor, fb: ForwardBatch, store: SlotStore, layer: int, rope: Rope) -> torch.Tensor:
        x, post, comb = self.hc_attn.pre(h, self.attn_norm)  # x normalised: the norm in the same op
        h = HyperConnection.post(self.attn(x, fb, store, layer, rope), h, post, comb)
        x, post, comb = self.hc_ffn.pre(h, self.ffn_norm)
        return HyperConnection.post(self.ffn(x, fb.input_ids), h, post, comb)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [N, vocab]
    streams: torch.Tensor  # [N, hc_mult, hidden]: last block's output before the HC head (MTP input)
    features: torch.Tensor | None = None  # [N, k hidden]: DSpark's taps (``dspark.target_features``), if asked
