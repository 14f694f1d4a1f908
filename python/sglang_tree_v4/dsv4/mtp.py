"""The MTP (next-n) layer as DeepSeek's checkpoints lay it out (``mtp.{i}.*``).

Input of query j: the target's last-block streams ``h`` (before the HC head) at some position p and the embedding
of the token at p + 1: ``streams = e_proj(enorm(embed(token))) + h_proj(hnorm(h))`` per stream. Then one V4 block
with sliding-window attention only (main rope, no compression) and a non-hash MoE, the MTP's own HC head,
``norm``, and the target's LM head (shared, as is the embedding). Outputs the logits of the token at p + 2 and the
block's streams, which feed the next MTP step when the layer is applied recurrently.

Position convention: the query runs at position p, the position of the target hidden state it consumes (so its
window key for p lives in the slot of position p, and its slot table is the target's). For a draft chain from a
committed prefix of length L: step 1 runs at position L - 1 with (h_{L-1}, token_L) ... exactly SGLang's EAGLE
convention. The MTP's own state is its window keys in a separate ``SlotStore`` (``mtp_layouts``).
"""
from __future__ import annotations

import torch
from torch import nn

from .block import Block, ModelOutput
from .config import DSV4Config
from .hyper import HyperHead
from .norm import RMSNorm
from .storage import ForwardBatch, SlotStore, mtp_layouts, streams_layouts


class MTPBlock(Block):
    def __init__(self, cfg: DSV4Config):
        super().__init__(cfg, ratio=0, hashed=False)
        D = cfg.hidden_size
        self.e_proj = nn.Linear(D, D, bias=False)
        self.h_proj = nn.Linear(D, D, bias=False)
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hc_mult, D, cfg.hc_eps, cfg.rms_norm_eps)


def draft_scratch_rows(topk: int, steps: int) -> int:
    """MTP scratch rows one request's draft tree needs: K nodes fed at each of steps 1 .. S - 1 (the root's draft
    comes from the committed rows; ``speculative.mtp_drafter``)."""
    return topk * max(steps - 1, 0)


def new_mtp_store(cfg: DSV4Config, num_slots: int, dtype=torch.float32, device="cpu",
                  scratch_rows: int = 0) -> SlotStore:
    """The MTP's window keys per slot, and ``scratch_rows`` rows for draft-tree nodes (``mtp_drafter``)."""
    return SlotStore(mtp_layouts(cfg), num_slots, dtype, device, window_scratch_rows=scratch_rows)


def new_streams_store(cfg: DSV4Config, num_slots: int, dtype=torch.float32, device="cpu") -> SlotStore:
    """The target's last-block streams per slot (piece ``h``), which the MTP reads when it catches up."""
    return SlotStore(streams_layouts(cfg), num_slots, dtype, device)


def mtp_forward(model: nn.Module, fb: ForwardBatch, hidden_streams: torch.Tensor, store: SlotStore,
                depth: int = 0, logits_rows: torch.Tensor | None = None) -> ModelOutput:
    """Run MTP layer ``depth`` of ``model`` (a ``DSV4Model``). ``fb.input_ids`` are the NEXT tokens (p + 1),
    ``fb.positions`` the positions p of ``hidden_streams [N, hc, D]``; writes only ``fb.out_slots`` of ``store``."""
    blk: MTPBlock = model.mtp[depth]
    e = blk.e_proj(blk.enorm(model.embed(fb.input_ids)))
    h = blk.h_proj(blk.hnorm(hidden_streams)) + e.unsqueeze(1)
    h = blk(h, fb, store, depth, model.ropes["main"])
    hs = h if logits_rows is None else h[logits_rows]
    return ModelOutput(model.head(blk.norm(blk.hc_head(hs))), h)
