"""DeepSeek-V4's MTP layer as the tree core's drafter, inside one SGLang decode round.

Positions follow the MTP convention of ``dsv4.mtp``: the query that drafts the children of a node at position
``p`` runs at ``p - 1`` with the node's token and its parent's hidden streams. For a round over committed length
``L`` with root (bonus) token ``b`` at position ``L``:

* ``catch_up_prefill`` runs in a prefill round, over the prompt's last window, from the streams that forward
  produced (the pool keeps only a few per page).
* ``catch_up`` brings each request's committed MTP rows up to position ``L - 1`` (the last row uses ``b``), reading
  the target's streams from their slots (at most D positions back). Its last query is the root's draft: children
  logits and hidden. Where it
  starts: ``catch_up_start`` (at most ``D`` positions back after steps without speculation, the MTP's window then
  masked below them by ``mtp_window_from``).
  ``catch_up_fixed`` does the same over the last C positions of every request, with shapes fixed by (B, C).
* draft nodes of depth ``d >= 1`` run at ``L + d - 1``. Their MTP rows are the MTP store's window scratch
  (``SlotStore`` ``window_scratch_rows``: K (S - 1) rows per request of the step, row ``b * K (S - 1) + s - 1`` for
  draft slot ``s`` of batch row ``b``), never a slot: a round needs no KV slots beyond its D verify slots, and
  nothing a draft writes outlives the step. A node reads the committed rows below ``L`` plus its own ancestors'.
"""

from __future__ import annotations

import torch

from ..dsv4.mtp import draft_scratch_rows, mtp_forward
from ..dsv4.storage import ForwardBatch, SlotStore, SlotTable
from ..tree import DraftStep, DraftTree, build_draft_tree


def catch_up(model, mtp_store: SlotStore, streams: SlotStore, req_table: torch.Tensor,
             starts: list[int], lens: list[int], next_tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP rows for positions ``[starts[b], lens[b])`` of every request; returns the root draft.

    ``next_tokens[b]`` are the tokens one ahead of those positions, ``starts[b] + 1 .. lens[b]`` (the bonus last).
    Returns ``(logits [B, 1, V], hidden [B, 1, hc, D])`` of each request's query at ``lens[b] - 1``.
    """
    device = req_table.device
    counts = torch.tensor([n - s for s, n in zip(starts, lens, strict=False)], device=device)
    positions = torch.cat([torch.arange(s, n, device=device) for s, n in zip(starts, lens, strict=False)])
    next_ids = torch.cat([torch.tensor(t, device=device) for t in next_tokens])
    query_req = torch.arange(len(lens), device=device).repeat_interleave(counts)
    table = SlotTable.for_requests(req_table, query_req, positions)
    return _mtp_rows(model, mtp_store, streams, table, positions, next_ids, torch.cumsum(counts, 0) - 1)


def catch_up_fixed(model, mtp_store: SlotStore, streams: SlotStore, req_table: torch.Tensor, lens: torch.Tensor,
                   next_tokens: torch.Tensor, graphs: MTPGraphs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``catch_up`` with fixed shapes (no host sync): every request runs the last ``C`` positions
    ``lens[b] - C .. lens[b] - 1`` with ``next_tokens [B, C]`` (the tokens one ahead, the bonus last).

    Usable when every request needs at most C positions and has at least C: positions before its start are
    recomputed, which rewrites the same rows (a position's MTP row depends on that position's token and target
    stream alone). After one verify round the need is the accepted count, so ``C`` = the largest D fits.
    ``graphs``: replayed from a CUDA graph of its (batch bucket, C)."""
    C = next_tokens.shape[1]
    table, offset = window_table(req_table, lens, C + model.cfg.window)
    inputs = {"table": table, "offset": offset, "lens": lens.long(), "next_tokens": next_tokens.long()}
    if graphs is not None:
        return graphs.run(("catch_up", ("C", C)), inputs)
    return _catch_up_fixed(model, mtp_store, streams, inputs)


def _catch_up_fixed(model, mtp_store: SlotStore, streams: SlotStore,
                    inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    next_tokens = inputs["next_tokens"]
    B, C = next_tokens.shape
    device = next_tokens.device
    positions = (inputs["lens"][:, None] - C + torch.arange(C, device=device)).flatten()
    query_req = torch.arange(B, device=device).repeat_interleave(C)
    last = torch.arange(B, device=device) * C + C - 1
    table = SlotTable(inputs["table"], query_req, positions + 1, torch.zeros(B * C, 0, dtype=torch.long,
                                                                               device=device),
                      offset=inputs["offset"][query_req])
    return _mtp_rows(model, mtp_store, streams, table, positions, next_tokens.flatten(), last)


def window_table(req_table: torch.Tensor, lens: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's slots of positions ``lens[b] - width .. lens[b] - 1`` (-1 below 0), and ``lens - width``:
    all an MTP forward over its last positions reads of the request table (a sliding-window layer), as a
    ``SlotTable`` with ``offset``. A graph's static input of this width needs no context bucket."""
    offset = lens.long() - width
    cols = offset[:, None] + torch.arange(width, device=req_table.device)
    T = req_table.shape[1]
    table = req_table.gather(1, cols.clamp(0, T - 1))
    return torch.where((cols >= 0) & (cols < T), table, -1), offset


def prefill_span(a: int, b: int, known: int, window: int) -> tuple[int, int]:
    """Positions ``[lo, hi)`` whose MTP rows a prefill forward over ``[a, b)`` computes from the streams it produced,
    for a sequence of ``known`` tokens (a position's row needs the token after it).

    The last ``window`` positions of the chunk (earlier ones no later query of the MTP reads, unless a later chunk
    is shorter than the window, and then it starts at this chunk's end), from ``a - 1`` on: the position before
    the chunk, whose row needs the chunk's first token (its stream is one position back, in the ring). A final
    chunk stops before its last position, whose row needs the token the prefill samples (the next round's
    catch-up)."""
    lo = max(a - 1, b - window, 0)
    return lo, max(lo, min(b, known - 1))


def catch_up_prefill(model, mtp_store: SlotStore, streams: SlotStore, req_table: torch.Tensor,
                     chunks: list[tuple[int, int]], spans: list[tuple[int, int]], own: torch.Tensor,
                     tokens: list) -> None:
    """The MTP rows of a prefill round, from the streams its forward produced (``own [sum(b - a), hc, D]``, the
    requests' chunks ``[a, b)`` in order): no stream is read back from further than one position before a chunk,
    so the pool keeps only a few per page (``storage.ring_period``).

    Request ``i`` gets rows ``spans[i] = [lo, hi)`` (``prefill_span``) from its known tokens ``tokens[i]``; the
    stream of a position before its chunk comes from ``streams``."""
    positions, query_req, next_ids, rows, starts = [], [], [], [], []
    offset = 0
    for i, ((a, b), (lo, hi), toks) in enumerate(zip(chunks, spans, tokens, strict=False)):
        positions += range(lo, hi)
        query_req += [i] * (hi - lo)
        next_ids += [toks[p + 1] for p in range(lo, hi)]
        rows += [offset + p - a for p in range(lo, hi)]
        starts += [a] * (hi - lo)
        offset += b - a
    if not positions:
        return
    device = req_table.device
    positions, query_req, rows, starts = (torch.tensor(x, device=device) for x in (positions, query_req, rows, starts))
    out_slots = req_table[query_req, positions]
    hc, hidden = model.cfg.hc_mult, model.cfg.hidden_size
    stored = streams.read(0, "h", out_slots).view(-1, hc, hidden)
    h = torch.where((positions >= starts)[:, None, None], own[rows.clamp(min=0)].to(stored.dtype), stored)
    batch = ForwardBatch(torch.tensor(next_ids, device=device).long(), positions, out_slots,
                         SlotTable.for_requests(req_table, query_req, positions))
    mtp_forward(model, batch, h.to(model.embed.weight.dtype), mtp_store,
                logits_rows=torch.empty(0, dtype=torch.long, device=device))


def catch_up_start(mtp_len: int, prefill_len: int, L: int, window: int, cap: int) -> tuple[int, bool]:
    """Where the MTP's catch-up of a request at committed length ``L`` starts, and whether it leaves a gap.

    Right after a prefill the prefill round has run it up to the prompt's last position (``catch_up_prefill``),
    so it covers that one (or, for a one-token prompt, ``mtp_len`` being 0, from ``prefill_len``'s window start).
    Otherwise the positions since ``mtp_len`` -- or, when steps without speculation left
    more than ``cap`` of them, only the last ``cap``: the MTP's window then starts there (a gap below it is masked,
    not read as stale rows), which costs its first drafts a little context and spares a catch-up over a whole window
    whenever speculation resumes (the adaptive budget's explorations among steps without it)."""
    done = mtp_len or prefill_len
    if L - done > cap:
        return L - cap, True
    return max(mtp_len, L - window, 0), False


def deferred_start(a: int, b: int, cap: int) -> int:
    """Where the MTP's rows of a request start when its prefill chunk ``[a, b)`` skipped them (the batch it joins
    is not speculating): the chunk's last ``cap`` positions, not before the position ahead of the chunk (the
    furthest back a prefill's MTP reads the streams' ring). The worker records it as both the MTP's length and
    the start of its window, so the first catch-up (``catch_up_start``) covers the positions from there, masked
    below, as after steps without speculation."""
    return max(b - cap, a - 1, 0)


def mtp_window_from(req_table: torch.Tensor, first: list[int]) -> torch.Tensor:
    """``req_table`` with every position below request ``b``'s ``first[b]`` unknown (-1): what the MTP may read."""
    if not any(first):
        return req_table
    cols = torch.arange(req_table.shape[1], device=req_table.device)
    return torch.where(cols[None, :] >= torch.tensor(first, device=req_table.device)[:, None], req_table, -1)


def _mtp_rows(model, mtp_store, streams, table: SlotTable, positions, next_ids,
              last) -> tuple[torch.Tensor, torch.Tensor]:
    """One MTP forward over committed positions (their target streams read from ``streams``, piece ``h``); the
    ``last`` rows' logits and hidden streams as the root drafts ``[B, 1, ...]``."""
    out_slots = table.lookup(positions[:, None])[:, 0]
    hc, hidden = model.cfg.hc_mult, model.cfg.hidden_size
    h = streams.read(0, "h", out_slots).view(-1, hc, hidden).to(model.embed.weight.dtype)
    batch = ForwardBatch(next_ids.long(), positions, out_slots, table)
    out = mtp_forward(model, batch, h, mtp_store, logits_rows=last)
    return out.logits[:, None], out.streams[last][:, None]


class MTPTreeDrafter:
    """Implements ``tree.Drafter`` for draft steps >= 1 (the root's draft comes from ``catch_up``)."""

    def __init__(self, model, mtp_store: SlotStore, req_table: torch.Tensor, prefix_lens: torch.Tensor,
                 topk: int, steps: int, graphs: MTPGraphs | None = None):
        """``steps``: the most draft steps (S) a tree of this round may take; ``req_table``: one row per request;
        ``graphs``: each step replayed from a CUDA graph of its (batch bucket, K, depth)."""
        self.model = model
        self.store = mtp_store
        self.prefix_lens = prefix_lens.long()
        # The window below the prefix is all a draft query reads of the request table (later positions are its
        # ancestors').
        self.table, self.offset = window_table(req_table, self.prefix_lens, model.cfg.window)
        self.topk = topk
        self.stride = draft_scratch_rows(topk, steps)
        self.graphs = graphs
        if req_table.shape[0] * self.stride > mtp_store.window_scratch_rows:
            raise ValueError(f"the MTP store has {mtp_store.window_scratch_rows} draft scratch rows; "
                             f"{req_table.shape[0]} requests drafting K={topk}, S={steps} trees need "
                             f"{req_table.shape[0] * self.stride}")

    def __call__(self, step: DraftStep) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = {"tokens": step.tokens, "slots": step.slots, "ancestors": step.ancestors,
                  "positions": step.positions, "parent_hidden": step.parent_hidden, "table": self.table,
                  "offset": self.offset, "prefix_lens": self.prefix_lens}
        if self.graphs is not None:
            key = ("draft", ("K", self.topk), ("depth", step.step), ("fed", step.ancestors.shape[-1]),
                   ("stride", self.stride))
            return self.graphs.run(key, inputs, scratch_stride=self.stride)
        return draft_step(self.model, self.store, inputs, step.step, self.topk, self.stride)


def draft_tree(model, mtp_store: SlotStore, req_table: torch.Tensor, prefix_lens: torch.Tensor, roots: torch.Tensor,
               root_draft, topk: int, max_steps: int, steps: int, draft_tokens: int,
               graphs: MTPGraphs | None = None, score_temperature: float | torch.Tensor = 1.0,
               logits_hook=None) -> DraftTree:
    """A round's draft tree after the catch-up (``root_draft``: its root logits and hidden state): the MTP's
    ``steps - 1`` further steps and the rerank to ``draft_tokens`` nodes, on the device alone. The server's round
    and the step-cost report run this one function."""
    drafter = MTPTreeDrafter(model, mtp_store, req_table, prefix_lens, topk, max_steps, graphs)
    return build_draft_tree(roots, prefix_lens.long(), drafter, steps, topk, draft_tokens, root_draft=root_draft,
                            score_temperature=score_temperature, logits_hook=logits_hook)


def draft_step(model, store: SlotStore, inputs: dict[str, torch.Tensor], depth: int, topk: int,
               stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One MTP forward over the nodes fed at draft step ``depth`` (every one of them at that depth), from tensors
    alone (``MTPTreeDrafter``'s inputs): what a draft graph captures. Request ``b``'s draft slot ``s >= 1`` is the
    store's scratch row ``b * stride + s - 1`` (code ``-2 - row``)."""
    tokens = inputs["tokens"]
    B, n = tokens.shape
    rows = torch.arange(B, device=tokens.device)[:, None]
    out_slots = -2 - (rows * stride + inputs["slots"] - 1)
    # Ancestors at depths 1..depth (itself last): one fed slot per depth among that depth's K slots.
    by_depth = inputs["ancestors"][:, :, 1 : 1 + depth * topk].reshape(B, n, depth, topk)
    anc_draft_slots = 1 + torch.arange(depth, device=rows.device) * topk + by_depth.int().argmax(-1)
    anc_slots = -2 - (rows[:, :, None] * stride + anc_draft_slots - 1)
    positions = (inputs["positions"] - 1).reshape(-1)
    query_req = rows.expand(B, n).reshape(-1)
    table = SlotTable(inputs["table"], query_req, inputs["prefix_lens"][query_req], anc_slots.reshape(B * n, depth),
                      offset=inputs["offset"][query_req])
    batch = ForwardBatch(tokens.reshape(-1), positions, out_slots.reshape(-1), table)
    parent = inputs["parent_hidden"]
    out = mtp_forward(model, batch, parent.reshape(B * n, *parent.shape[2:]), store)
    return out.logits.view(B, n, -1), out.streams.view(B, n, *out.streams.shape[1:])


class MTPGraphs:
    """The MTP's fixed-shape forwards (catch-up, draft steps) as graphs of the server's ``StepGraphs``, batches
    padded to their bucket by repeating the last request. A padded draft row drafts into scratch rows of its own
    (row index past the batch), so the padding needs that many scratch rows; where the store has too few, the
    batch runs at its own size."""

    def __init__(self, model, mtp_store: SlotStore, streams: SlotStore, graphs):
        self.model, self.store, self.streams, self.graphs = model, mtp_store, streams, graphs
        graphs.fns["catch_up"] = lambda static, key: _catch_up_fixed(model, mtp_store, streams, static)
        graphs.fns["draft"] = self._draft

    def _draft(self, static: dict[str, torch.Tensor], key: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        named = dict(key[1:])
        return draft_step(self.model, self.store, static, named["depth"], named["K"], named["stride"])

    def run(self, key: tuple, inputs: dict[str, torch.Tensor], scratch_stride: int = 0):
        from ..serving.step_graphs import batch_bucket

        bs = next(iter(inputs.values())).shape[0]
        padded = batch_bucket(bs)
        if padded * scratch_stride > self.store.window_scratch_rows:
            padded = bs
        return self.graphs.run_padded(key, inputs, bs, padded)
