"""DeepSeek-V4 target model over explicit per-slot state.

``DSV4Model.forward(batch, store)`` runs N query tokens -- any mix of prefill chunks, decode tokens and draft-tree
nodes from several requests -- against a ``SlotStore`` through the batch's slot tables (see ``storage``), writing
only the queries' own slots. It returns per-query logits and the last block's output streams *before* the
hyper-connection head (the MTP layer's hidden input).

``forward_sequences(input_ids [B, T])`` is the differentiable full-sequence forward (training from empty state): the
same code with a throw-away store of ``B*T`` slots.
"""
from __future__ import annotations

import torch
from torch import nn

from .block import Block, ModelOutput
from .config import DSV4Config
from .dspark import DSparkConfig, DSparkDrafter, target_features
from .hyper import HyperHead
from .mtp import MTPBlock
from .norm import RMSNorm
from .rope import Rope, ropes_for
from .storage import (
    ForwardBatch,
    SlotStore,
    SlotTable,
    model_token_layouts,
    paged_layouts,
)


class DSV4Model(nn.Module):
    def __init__(self, cfg: DSV4Config, with_mtp: bool = True, dspark: DSparkConfig | None = None):
        """``dspark``: the checkpoint's drafter is DSpark (``self.dspark``; no MTP layers then)."""
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [Block(cfg, cfg.compress_ratios[i], cfg.hash_layers[i]) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)
        self.ropes = ropes_for(cfg)
        if with_mtp and cfg.num_nextn_predict_layers > 0 and dspark is None:
            self.mtp = nn.ModuleList([MTPBlock(cfg) for _ in range(cfg.num_nextn_predict_layers)])
        else:
            self.mtp = nn.ModuleList()
        self.dspark = DSparkDrafter(cfg, dspark) if with_mtp and dspark is not None else None

    def rope_of(self, ratio: int) -> Rope:
        return self.ropes["main"] if ratio == 0 else self.ropes["compress"]

    def new_store(self, num_slots: int, dtype: torch.dtype = torch.float32, device="cpu",
                  entry_format: str | None = None) -> SlotStore:
        """``entry_format``: None keeps entries and window keys in ``dtype``, ``fp8_e4m3`` as upstream's fp8 bytes.
        Compressor pieces in ring rows (one per slot here), so that an HCA layer's state keeps its own dtype
        (``paged_layouts``)."""
        window, ring = paged_layouts(self.cfg, entry_format)
        return SlotStore(window, num_slots, dtype, device, ring_layouts=ring,
                         token_layouts=model_token_layouts(self.cfg, entry_format))

    def forward(self, fb: ForwardBatch, store: SlotStore, logits_rows: torch.Tensor | None = None,
                taps: tuple[int, ...] = ()) -> ModelOutput:
        """``logits_rows``: optional indices of the queries whose logits are wanted (default: all); ``taps``: layers
        whose output streams DSpark reads (``ModelOutput.features``)."""
        h = self.embed(fb.input_ids).unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        store.forward_memo = fb.memo_  # slot rows once per forward (``SlotStore._rows``)
        tapped = {}
        try:
            for i, blk in enumerate(self.layers):
                h = blk(h, fb, store, i, self.rope_of(blk.ratio))
                if i in taps:
                    tapped[i] = h
        finally:
            store.forward_memo = None
        hs = h if logits_rows is None else h[logits_rows]
        features = target_features([tapped[i] for i in taps]) if taps else None
        return ModelOutput(self.head(self.norm(self.hc_head(hs))), h, features)

    def forward_sequences(self, input_ids: torch.Tensor, taps: tuple[int, ...] = ()) -> ModelOutput:
        """Full sequences from an empty state, differentiable: input_ids [B, T] -> logits [B, T, V]."""
        B, T = input_ids.shape
        dev = input_ids.device
        store = self.new_store(B * T, self.embed.weight.dtype, dev)
        pos = torch.arange(T, device=dev).repeat(B)
        req = torch.arange(B, device=dev).repeat_interleave(T)
        table = SlotTable.for_requests(torch.arange(B * T, device=dev).view(B, T), req, pos)
        out = self.forward(ForwardBatch(input_ids.reshape(-1), pos, torch.arange(B * T, device=dev), table), store,
                           taps=taps)
        return ModelOutput(out.logits.view(B, T, -1), out.streams.view(B, T, *out.streams.shape[1:]),
                           None if out.features is None else out.features.view(B, T, -1))
