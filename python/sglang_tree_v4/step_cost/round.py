"""One TREE_V4 round's device work on the meta device, as the server runs it on a GPU: the MTP catch-up that drafts
the root, the rest of the draft tree (S - 1 MTP steps and the rerank), the target's verify forward over SGLang's
pool layout with the live context's capacities, greedy acceptance, and the accepted entries' commit. Without
speculation: one decode forward and its argmax. Under tensor parallelism SGLang's collectives, which need a
process group, are replaced by stand-ins that return their input's shape and report what each rank would send
and receive (a ring: all-reduce 2 (n - 1) / n of the tensor each way, all-gather (n - 1) shards each way)."""

from __future__ import annotations

import contextlib

import torch

from ..dsv4.mtp import new_mtp_store, new_streams_store
from ..dsv4.storage import ForwardBatch, SlotStore, StepCaps, model_token_layouts, paged_layouts
from ..serving.sglang_model import accept_index_of, commit_accepted_entries, verify_forward
from ..serving.sglang_pool import entry_ratios
from ..speculative.mtp_drafter import catch_up_fixed, draft_tree
from ..tree import verify_greedy
from .counter import StepCounter


def _meta(*shape, dtype=torch.long):
    return torch.empty(*shape, dtype=dtype, device="meta")


class CountingGroup:
    """Stands in for SGLang's TP group: each collective returns its output's shape and records what this rank
    would send and receive in a ring."""

    def __init__(self, counter: StepCounter, size: int, rank: int):
        self.counter, self.world_size, self.rank_in_group = counter, size, rank

    def all_reduce(self, x, *args, **kwargs):
        moved = 2 * (self.world_size - 1) * x.numel() * x.element_size() // self.world_size
        self.counter.record("all_reduce", moved, moved)
        return torch.empty_like(x)

    def all_gather(self, x, dim=-1, *args, **kwargs):
        shard = x.numel() * x.element_size()
        self.counter.record("all_gather", (self.world_size - 1) * shard, (self.world_size - 1) * shard)
        shape = list(x.shape)
        shape[dim] *= self.world_size
        return x.new_empty(shape)


@contextlib.contextmanager
def collectives(counter: StepCounter, size: int, rank: int):
    """This rank's view of TP: SGLang's parallel context naming a counting group."""
    from sglang.srt.runtime_context import get_parallel

    if size == 1:
        yield
        return
    group = CountingGroup(counter, size, rank)
    with get_parallel().override(tp_size=size, tp_rank=rank, tp_group=group, attn_tp_group=group):
        yield


def _layer_marks(model, counter: StepCounter) -> list:
    """Hooks that tag every op with the decoder layer running it."""
    handles = []
    for i, block in enumerate(model.layers):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=i: setattr(counter, "layer", i)))
        handles.append(block.register_forward_hook(lambda m, a, o: setattr(counter, "layer", None)))
    return handles


@contextlib.contextmanager
def forward_metadata(counter: StepCounter):
    """Charge the forward's metadata to the forward: what ``ForwardBatch.memo`` and ``SlotStore._per_forward``
    compute once per forward and every layer shares (rope tables, slot lists and their rows, block closers). The
    layer that first needs them computes them; a layer's own work is what every layer repeats."""
    memo, per_forward = ForwardBatch.memo, SlotStore._per_forward

    def charged(fn):
        def run():
            counter.metadata += 1
            try:
                return fn()
            finally:
                counter.metadata -= 1
        return run

    ForwardBatch.memo = lambda self, key, fn: memo(self, key, charged(fn))
    SlotStore._per_forward = lambda self, key, inputs, fn: per_forward(self, key, inputs, charged(fn))
    try:
        yield
    finally:
        ForwardBatch.memo, SlotStore._per_forward = memo, per_forward


def stores(model, batch: int, context: int, draft: int, topk: int, steps: int, entry_format: str | None):
    """The server's pools for ``batch`` requests of ``context`` tokens (meta: no memory)."""
    cfg = model.cfg
    dt = model.embed.weight.dtype
    slots = batch * (context + draft) + 64
    window_index = _meta(slots)
    ring = model.new_store(1, dt, "meta").ring_layouts
    paged = SlotStore(paged_layouts(cfg, entry_format)[0], slots, dt, "meta", ring_layouts=ring,
                      token_layouts=model_token_layouts(cfg, entry_format), window_index=window_index,
                      entry_ratios=entry_ratios(cfg), scratch_rows=batch * draft)
    mtp_store = new_mtp_store(cfg, slots, dt, "meta", batch * topk * max(steps - 1, 0))
    streams = new_streams_store(cfg, slots, dt, "meta")
    for s in (mtp_store, streams):
        s.window_index = window_index
    return paged, mtp_store, streams


def run_round(model, counter: StepCounter, batch: int, context: int, draft: int, topk: int, steps: int,
              tp_size: int = 1, tp_rank: int = 0, entry_format: str | None = None) -> None:
    """One round under ``counter`` (``draft`` = 1: no speculation)."""
    cfg = model.cfg
    B, D = batch, draft
    paged, mtp_store, streams = stores(model, B, context, D, topk, steps, entry_format)
    req_table = _meta(B, context + D)
    lens = _meta(B)
    counter.add_state(list(paged.buffers) + list(paged.token_buffers) + list(mtp_store.buffers)
                      + list(streams.buffers) + [req_table])
    caps = StepCaps.bucket(context + D, 1 << 30, D)
    handles = _layer_marks(model, counter)
    try:
        with collectives(counter, tp_size, tp_rank), forward_metadata(counter), torch.no_grad(), counter:
            if D > 1:  # the server's own stage functions, in its order (``speculative.worker``)
                counter.phase = "draft"
                root_draft = catch_up_fixed(model, mtp_store, streams, req_table, lens, _meta(B, D))
                tree = draft_tree(model, mtp_store, req_table, lens, _meta(B), root_draft, topk, steps, steps, D)
            counter.phase = "verify"
            mask = _meta(B * D * D, dtype=torch.bool)
            out_slots = _meta(B * D)
            logits = verify_forward(model, paged, req_table, lens, mask, _meta(B * D), torch.empty_like(out_slots),
                                    out_slots, D, caps).logits
            counter.phase = "accept"
            if D > 1:
                verdict = verify_greedy(tree, logits.view(B, D, cfg.vocab_size))
                counter.phase = "commit"
                accept_index = accept_index_of(verdict.accepted_nodes, D)
                block = req_table.gather(1, lens[:, None] + torch.arange(D, device="meta"))  # the worker's
                commit_accepted_entries(paged, accept_index, block, lens, D)
            else:
                logits.argmax(-1)
    finally:
        for h in handles:
            h.remove()
