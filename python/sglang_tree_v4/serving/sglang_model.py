"""The one adapter between our DeepSeek-V4 (plain torch over per-slot storage) and SGLang's model interface.

SGLang sees a hybrid sliding-window model with one KV "head" per layer (``sglang_pool``): window layers hold each
target layer's window row (window key; see ``storage``) and the MTP layer's row; the window sub-pool's ring buffers
hold the CSA compressor rows, the HCA running states and the last block's streams before the HC head (the MTP's
hidden input, read again when the MTP catches up);
entry layers hold one row per block of each compressed layer's ratio (pages are whole blocks, so a slot's block
row is ``slot // r``) and the draft trees' scratch. Everything per token therefore lives in SGLang's own KV
buffers, so its allocator, SWA eviction and radix cache carry all of it; its accepted-token move
(``move_kv_cache``) moves the window rows, and the worker copies accepted entries out of the scratch
(``commit_tree_entries``).

The forward maps SGLang's batch onto our slot tables: extend / decode queries read their request's ``req_to_token``
row; target-verify queries (draft-tree nodes) read the committed row below the committed length and their own
ancestors' verify slots above it, with the ancestry taken from ``spec_info.custom_mask``.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Iterable

import torch
from torch import nn

from ..checkpoint.fuse import fuse_projections
from ..checkpoint.swap import build_model, parameter_bytes
from ..checkpoint.tp import shard_model
from ..checkpoint.weights import StreamingLoader, iter_safetensors
from ..dsv4.config import DSV4Config
from ..dsv4.storage import ForwardBatch as SlotBatch
from ..dsv4.storage import (
    LayerLayout,
    SlotStore,
    SlotTable,
    StepCaps,
    model_token_layouts,
    mtp_layouts,
    paged_layouts,
    streams_layouts,
)
from . import step_graphs
from .sglang_pool import entry_ratios, window_layer_widths

logger = logging.getLogger(__name__)

ARCHITECTURE = "TreeV4DSV4ForCausalLM"  # no "DeepseekV4" substring: SGLang keys V4 special cases on it
RAW_CONFIG_ATTR = "tree_v4_dsv4_config"
ENTRY_FORMAT_ATTR = "tree_v4_entry_format"  # how entries are kept (``entry_codec.entry_codecs``; None: pool dtype)


def tree_ancestor_slots(custom_mask: torch.Tensor, out_slots: torch.Tensor, bs: int, n: int) -> torch.Tensor:
    """``anc[q, d]`` = verify slot of the depth-``d`` node on query ``q``'s root path (-1 beyond its depth).

    ``custom_mask`` is SGLang's per-request ancestors-or-self mask, flat ``[bs * n * n]`` (row = node). Fixed
    shapes, no host sync: every (node i, node j) pair scatters slot(j) to column depth(j) of row i when j is an
    ancestor of i, and to a spare last column otherwise (ancestors of one node have distinct depths).
    """
    anc = custom_mask.view(bs, n, n).bool()
    depth = anc.sum(-1) - 1  # [bs, n]
    slots = out_slots.view(bs, 1, n).long().expand(bs, n, n)
    cols = torch.where(anc, depth[:, None, :], n)
    table = torch.full((bs, n, n + 1), -1, dtype=torch.long, device=out_slots.device)
    table.scatter_(2, cols, torch.where(anc, slots, -1))
    return table[..., :n].reshape(bs * n, n)


def tree_entry_slots(custom_mask: torch.Tensor, out_slots: torch.Tensor, bs: int, n: int) -> torch.Tensor:
    """Where each draft node's compressed entries go: node ``i`` of a request sits in the slot reserved for position
    ``committed + i`` and is at position ``committed + depth``, so where ``depth == i`` (the root, a chain, a tree's
    first branch) its slot is its position's own and the entry goes to the canonical row; any other node's entry
    goes to tree scratch row ``q`` (its index in the forward), written ``-2 - q`` (``storage.SlotStore``)."""
    depth = custom_mask.view(bs, n, n).bool().sum(-1) - 1
    own = depth == torch.arange(n, device=depth.device)
    q = torch.arange(bs * n, device=depth.device)
    return torch.where(own.flatten(), out_slots.long(), -2 - q)


def verify_table(req_table: torch.Tensor, committed: torch.Tensor, custom_mask: torch.Tensor,
                 out_slots: torch.Tensor, n: int) -> tuple[SlotTable, torch.Tensor]:
    """Slot table of a target-verify forward of ``n`` draft nodes per request -- the committed row below each
    request's committed length, the node's own ancestors' verify slots above it -- and where each node's entries
    go (``tree_entry_slots``; the table's ``anc_entry`` holds the same for the ancestors)."""
    bs = committed.shape[0]
    if n == 1:  # the root alone (a step without speculation): a decode query in its own reserved slot
        return SlotTable.for_requests(req_table, torch.arange(bs, device=committed.device), committed.long()), out_slots
    query_req = torch.arange(bs, device=committed.device).repeat_interleave(n)
    anc = tree_ancestor_slots(custom_mask, out_slots, bs, n)
    entry_out = tree_entry_slots(custom_mask, out_slots, bs, n)
    anc_entry = tree_ancestor_slots(custom_mask, entry_out, bs, n)
    return SlotTable(req_table, query_req, committed.long().repeat_interleave(n), anc, anc_entry), entry_out


def verify_forward(model, store: SlotStore, req_table: torch.Tensor, seq_lens: torch.Tensor, mask: torch.Tensor,
                   input_ids: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor, n: int,
                   caps: StepCaps | None, taps: tuple[int, ...] = (), logits_rows: torch.Tensor | None = None):
    """A verify forward's device work from device tensors alone (nothing read back to the host): the draft-tree
    block's slot tables (``verify_table``) and the target's forward over them. The server's verify (replayed from
    a graph on a GPU, eager elsewhere) and the step-cost report run this one function."""
    table, entry_out = verify_table(req_table, seq_lens, mask, out_slots, n)
    batch = SlotBatch(input_ids, positions, out_slots, table, caps, entry_out)
    return model(batch, store, logits_rows=logits_rows, taps=taps)


def accept_index_of(accepted_nodes: torch.Tensor, draft_tokens: int) -> torch.Tensor:
    """``[bs, A]``: the flat verify-block row (``b * draft_tokens + i``) of each request's j-th accepted node, -1
    past its accepted length: what SGLang's accepted-token move and ``commit_accepted_entries`` take."""
    offset = torch.arange(accepted_nodes.shape[0], device=accepted_nodes.device)[:, None] * draft_tokens
    return torch.where(accepted_nodes >= 0, accepted_nodes + offset, -1)


def commit_accepted_entries(store: SlotStore, accept_index: torch.Tensor, block_slots: torch.Tensor,
                            committed: torch.Tensor, draft_tokens: int) -> None:
    """Copy the entries of accepted draft nodes that sat in tree scratch (``tree_entry_slots``) to the canonical
    rows of their positions. ``accept_index [bs, A]``: flat node index (``b * draft_tokens + i``) of the j-th
    accepted node, -1 past the accepted length; the j-th accepted node is at position ``committed + j`` and its
    canonical slot is ``block_slots[b, j]`` (``block_slots [bs, A]``: the request's slots of positions
    ``committed .. committed + A - 1``, not its whole row of the request table)."""
    bs, A = accept_index.shape
    j = torch.arange(A, device=accept_index.device)
    node = accept_index - torch.arange(bs, device=accept_index.device)[:, None] * draft_tokens
    scratch = (accept_index >= 0) & (node != j)
    positions = committed.long()[:, None] + j
    dst = block_slots.long()
    store.commit_entries(torch.where(scratch, -2 - accept_index, -1).flatten(),
                         torch.where(scratch, dst, -1).flatten(), positions.flatten())


FIXED_SHAPES_ENV = "SGLANG_TREE_V4_FIXED_SHAPES"  # "1": fixed shapes on any device, "0": never; unset: on CUDA


def fixed_shapes(device: torch.device | str) -> bool:
    """Whether a verify step runs with fixed shapes (``StepCaps``, fixed-shape acceptance and MTP catch-up).

    On a GPU yes: a host read drains the device, and only fixed shapes can be captured. On a CPU nothing drains, and
    the eager step is cheaper (a query pools a compressed entry only where it closes a block, lists are as wide as
    the batch needs), so it is used there unless ``SGLANG_TREE_V4_FIXED_SHAPES=1`` asks for the GPU's path (tests
    serve through it on the CPU)."""
    forced = os.environ.get(FIXED_SHAPES_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return torch.device(device).type == "cuda"


def verify_caps(seq_lens: torch.Tensor, n: int, capacity: int, seq_lens_cpu: torch.Tensor | None = None
                ) -> StepCaps | None:
    """Capacities of a verify forward of ``n`` nodes per request over committed lengths ``seq_lens``; None (the
    eager forward) where ``fixed_shapes`` says no.

    While a CUDA graph is being captured: the startup capacity (``req_to_token``'s width), the only value that is
    right for every later replay, whatever the contexts then. Otherwise a power-of-two bucket of the longest
    context: padding costs in proportion to its width, and the longest context is read from host data (SGLang's
    ``seq_lens_cpu``, or lengths that live on the CPU anyway), so nothing is drained."""
    if not fixed_shapes(seq_lens.device):
        return None
    if seq_lens.is_cuda and torch.cuda.is_current_stream_capturing():
        return StepCaps(capacity, n)
    lens = seq_lens_cpu if seq_lens_cpu is not None else seq_lens
    if lens.numel() == 0:
        return StepCaps(capacity, n)
    return StepCaps.bucket(int(lens.max()) + n, capacity, n)


class TreeV4DeepseekV4ForCausalLM(nn.Module):
    """SGLang entry class (registered under ``ARCHITECTURE`` by the plugin's model override)."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        from sglang.srt.layers.logits_processor import LogitsProcessor

        self.config = config
        raw = getattr(config, RAW_CONFIG_ATTR)
        self.cfg = DSV4Config.from_dict(raw)
        # Built on the meta device with the checkpoint's quantization swapped in and cut to this tensor-parallel
        # rank's share (``tp``), then allocated in SGLang's dtype and device (its loader sets both as defaults
        # around this constructor).
        self.model = build_model(self.cfg, raw, with_mtp=self.cfg.num_nextn_predict_layers > 0,
                                 dtype=torch.get_default_dtype(), shard=shard_model)
        # The head is vocabulary-parallel: SGLang's logits processor gathers the ranks' parts.
        self.logits_processor = LogitsProcessor(config, skip_all_gather=self.model.tp_rank_size[1] == 1)
        self.last_streams: torch.Tensor | None = None
        # DSpark's taps of the last extend or verify forward (``dsv4.dspark.target_features``), for its context.
        self.taps = self.model.dspark.dcfg.target_layer_ids if self.model.dspark is not None else ()
        self.last_features: torch.Tensor | None = None
        self._graphs: step_graphs.StepGraphs | None = None
        self._stores: tuple[SlotStore, SlotStore | None, SlotStore] | None = None

    # --- storage over SGLang's KV pool ---------------------------------------------------------------------
    def stores(self) -> tuple[SlotStore, SlotStore | None, SlotStore]:
        """(target store, MTP store, streams store), views over the hybrid pool's K buffers (window layers first,
        then one entry layer per compressed layer: a row per block, then tree scratch) and the window sub-pool's
        ring buffers (CSA compressor rows, HCA states, the streams), with SGLang's full-to-SWA mapping as the window
        index."""
        if self._stores is None:
            from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

            pool = get_token_to_kv_pool()
            n, cfg = self.cfg.num_layers, self.cfg
            nw = len(window_layer_widths(cfg))
            window = [pool.get_key_buffer(i).flatten(1) for i in range(nw)]
            token_iter = iter(pool.get_key_buffer(nw + i).flatten(1) for i in range(pool.layer_num - nw))
            entry_format = getattr(self.config, ENTRY_FORMAT_ATTR, None)
            token_lays = model_token_layouts(cfg, entry_format)
            token = [next(token_iter) if lay.width else window[0][:, :0] for lay in token_lays]
            common = dict(window_index=pool.full_to_swa_index_mapping)
            num_slots = pool.size + pool.page_size
            window_lays, ring_lays = paged_layouts(cfg, entry_format)
            swa = pool.swa_kv_pool
            ring = dict(ring_period=swa.ring_period, page=pool.page_size)
            target = SlotStore(window_lays, num_slots, buffers=window[:n], token_layouts=token_lays,
                               token_buffers=token, entry_ratios=entry_ratios(cfg), ring_layouts=ring_lays,
                               ring_buffers=swa.ring_buffers[:n], **ring, **common)
            # The streams are ring rows only (``sglang_pool.ring_layouts``): no window columns.
            streams = SlotStore([LayerLayout.of([])], num_slots, buffers=[window[0][:, :0]],
                                ring_layouts=streams_layouts(cfg), ring_buffers=swa.ring_buffers[n:], **ring,
                                **common)
            # The MTP layers' rows past the target layers' are its draft scratch (``sglang_pool``).
            # The drafter's window keys: the MTP layers', or DSpark's stages' (as many layers; ``DSV4Config``).
            mtp = (SlotStore(mtp_layouts(cfg), num_slots, buffers=window[n:], **common,
                             window_scratch_rows=window[-1].shape[0] - window[0].shape[0])
                   if len(self.model.mtp) or self.model.dspark is not None else None)
            self._stores = (target, mtp, streams)
        return self._stores

    # --- SGLang model interface ----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch, **kwargs):
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool

        store = self.stores()[0]
        mode = forward_batch.forward_mode
        bs = forward_batch.batch_size
        req_to_token = get_req_to_token_pool().req_to_token
        out_slots = forward_batch.out_cache_loc.long()
        positions = positions.long()
        device = positions.device
        if mode.is_target_verify():
            n = forward_batch.spec_info.draft_token_num
            caps = verify_caps(forward_batch.seq_lens, n, req_to_token.shape[1], forward_batch.seq_lens_cpu)
            capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()  # SGLang's own capture
            if caps is not None and step_graphs.enabled(device) and not capturing:
                return self._graph_verify(input_ids, positions, forward_batch, n, caps)
        req_table = req_to_token[forward_batch.req_pool_indices].long()
        no_rows = torch.empty(0, dtype=torch.long, device=device)  # logits come from SGLang's processor below
        if mode.is_target_verify():
            out = verify_forward(self.model, store, req_table, forward_batch.seq_lens,
                                 forward_batch.spec_info.custom_mask, input_ids.long(), positions, out_slots, n, caps,
                                 self.taps, no_rows)
        else:
            counts = (forward_batch.extend_seq_lens if mode.is_extend() else
                      torch.ones(bs, dtype=torch.long, device=device))
            query_req = torch.arange(bs, device=device).repeat_interleave(counts.long())
            table = SlotTable.for_requests(req_table, query_req, positions)
            out = self.model(SlotBatch(input_ids.long(), positions, out_slots, table), store, logits_rows=no_rows,
                             taps=self.taps)
        self.last_features = out.features
        return self._logits(input_ids, out_slots, out.streams, forward_batch)

    def _logits(self, input_ids: torch.Tensor, out_slots: torch.Tensor, out: torch.Tensor, forward_batch):
        streams = self.stores()[2]
        streams.write(0, "h", streams.ring_write_slots(out_slots), out.flatten(1))
        self.last_streams = out
        final = self.model.norm(self.model.hc_head(out))
        return self.logits_processor(input_ids, final, self.model.head, forward_batch)

    def _graph_verify(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch, n: int, caps: StepCaps):
        """The verify forward as a replayed graph of its (batch bucket, D, context bucket) (``step_graphs``)."""
        bs = forward_batch.batch_size
        padded = step_graphs.batch_bucket(bs)
        if padded * n > self._scratch_capacity():
            padded = bs  # the tree scratch has no rows for the padding's entries
        pad = step_graphs.pad_rows
        inputs = {"input_ids": pad(input_ids.long(), bs, padded, n), "positions": pad(positions.long(), bs, padded, n),
                  "out_slots": pad(forward_batch.out_cache_loc.long(), bs, padded, n),
                  "req_pool_indices": pad(forward_batch.req_pool_indices.long(), bs, padded),
                  "seq_lens": pad(forward_batch.seq_lens.long(), bs, padded),
                  "mask": pad(forward_batch.spec_info.custom_mask, bs, padded, n * n)}
        key = ("verify", ("batch", padded), ("D", n), ("context", caps.max_context))
        out = self.graphs(input_ids.device).run(key, inputs)
        if self.taps:
            out, features = out
            self.last_features = features[: bs * n].clone()
        out = out[: bs * n].clone()
        return self._logits(input_ids, forward_batch.out_cache_loc.long(), out, forward_batch)

    def graphs(self, device: torch.device) -> step_graphs.StepGraphs:
        """The server's graphs (the verify forward's here; the worker adds the MTP's), one pool and one cap."""
        if self._graphs is None:
            self._graphs = step_graphs.StepGraphs({"verify": self._verify_streams}, step_graphs.capture_for(device))
        return self._graphs

    def _verify_streams(self, static: dict[str, torch.Tensor], key: tuple):
        """What a verify graph captures: the slot tables (the request table cut to the bucket's columns) and the
        model's forward over the target store, from the static inputs alone; its streams (and DSpark's taps)."""
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool

        named = dict(key[1:])
        n, capacity = named["D"], named["context"]
        req_to_token = get_req_to_token_pool().req_to_token
        req_table = req_to_token[static["req_pool_indices"], :capacity].long()
        out_slots = static["out_slots"]
        no_rows = torch.empty(0, dtype=torch.long, device=out_slots.device)
        out = verify_forward(self.model, self.stores()[0], req_table, static["seq_lens"], static["mask"],
                             static["input_ids"], static["positions"], out_slots, n, StepCaps(capacity, n), self.taps,
                             no_rows)
        return (out.streams, out.features) if self.taps else out.streams

    def _scratch_capacity(self) -> int:
        """Tree-scratch entry rows of the target store (the fewest over its compressed layers)."""
        store = self.stores()[0]
        rows = [buf.shape[0] - base for buf, base, r in zip(store.token_buffers, store.scratch_base,
                                                            entry_ratios(self.cfg), strict=False) if r > 1]
        return min(rows, default=1 << 30)

    def commit_tree_entries(self, accept_index: torch.Tensor, block_slots: torch.Tensor, committed: torch.Tensor,
                            draft_tokens: int) -> None:
        """After SGLang's accepted-token move (``commit_accepted_entries``)."""
        commit_accepted_entries(self.stores()[0], accept_index, block_slots, committed, draft_tokens)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Streams the checkpoint into the model one tensor at a time. From a local folder the files are read
        directly through safetensors slice handles, so each rank reads only its own part of every sharded tensor
        (and none of another rank's experts); otherwise SGLang's ``(name, tensor)`` iterator is used. A checkpoint
        without ``mtp.*`` tensors (e.g. transformers' ``save_pretrained``, which has no MTP module) is served
        without the MTP layer; TREE_V4 then refuses to start, naming the missing layer."""
        loader = StreamingLoader(self.model)
        folder = getattr(self.config, "_name_or_path", "")
        if folder and os.path.isdir(folder) and glob.glob(os.path.join(folder, "*.safetensors")):
            weights = iter_safetensors(folder, lazy=True)
        with torch.no_grad():
            for name, tensor in weights:
                loader.feed(name, tensor)
        missing = loader.missing()
        if missing and all(k.startswith("mtp.") for k in missing) and not any(
                k.startswith("mtp.") for k in loader.filled | set(loader.experts)):
            logger.warning("the checkpoint has no mtp.* tensors: serving without the MTP layer")
            self.model.mtp = nn.ModuleList()
            loader.forget("mtp.")
        loader.finish()
        fuse_projections(self.model)  # after loading: the checkpoint's tensors fill the separate linears
        rank, size = self.model.tp_rank_size
        logger.info("TREE_V4 DeepSeek-V4 parameters: %s",
                    json.dumps(dict(parameter_bytes(self.model), tp_rank=rank, tp=size)))


EntryClass = [TreeV4DeepseekV4ForCausalLM]
