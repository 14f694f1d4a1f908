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
from ..tree import DraftStep


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
    return _mtp_rows(model, mtp_store, streams, req_table, positions, query_req, next_ids, torch.cumsum(counts, 0) - 1)


def catch_up_fixed(model, mtp_store: SlotStore, streams: SlotStore, req_table: torch.Tensor, lens: torch.Tensor,
                   next_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``catch_up`` with fixed shapes (no host sync): every request runs the last ``C`` positions
    ``lens[b] - C .. lens[b] - 1`` with ``next_tokens [B, C]`` (the tokens one ahead, the bonus last).

    Usable when every request needs at most C positions and has at least C: positions before its start are
    recomputed, which rewrites the same rows (a position's MTP row depends on that position's token and target
    stream alone). After one verify round the need is the accepted count, so ``C`` = the largest D fits."""
    B, C = next_tokens.shape
    device = req_table.device
    positions = (lens.long()[:, None] - C + torch.arange(C, device=device)).flatten()
    query_req = torch.arange(B, device=device).repeat_interleave(C)
    last = torch.arange(B, device=device) * C + C - 1
    return _mtp_rows(model, mtp_store, streams, req_table, positions, query_req, next_tokens.flatten(), last)


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


def _mtp_rows(model, mtp_store, streams, req_table, positions, query_req, next_ids,
              last) -> tuple[torch.Tensor, torch.Tensor]:
    """One MTP forward over committed positions (their target streams read from ``streams``, piece ``h``); the
    ``last`` rows' logits and hidden streams as the root drafts ``[B, 1, ...]``."""
    out_slots = req_table[query_req, positions]
    hc, hidden = model.cfg.hc_mult, model.cfg.hidden_size
    h = streams.read(0, "h", out_slots).view(-1, hc, hidden).to(model.embed.weight.dtype)
    batch = ForwardBatch(next_ids.long(), positions, out_slots, SlotTable.for_requests(req_table, query_req, positions))
    out = mtp_forward(model, batch, h, mtp_store, logits_rows=last)
    return out.logits[:, None], out.streams[last][:, None]


class MTPTreeDrafter:
    """Implements ``tree.Drafter`` for draft steps >= 1 (the root's draft comes from ``catch_up``)."""

    def __init__(self, model, mtp_store: SlotStore, req_table: torch.Tensor, prefix_lens: torch.Tensor,
                 topk: int, steps: int):
        """``steps``: the most draft steps (S) a tree of this round may take; ``req_table``: one row per request."""
        self.model = model
        self.store = mtp_store
        self.req_table = req_table
        self.prefix_lens = prefix_lens.long()
        self.topk = topk
        self.stride = draft_scratch_rows(topk, steps)
        if req_table.shape[0] * self.stride > mtp_store.window_scratch_rows:
            raise ValueError(f"the MTP store has {mtp_store.window_scratch_rows} draft scratch rows; "
                             f"{req_table.shape[0]} requests drafting K={topk}, S={steps} trees need "
                             f"{req_table.shape[0] * self.stride}")

    def _scratch(self, rows: torch.Tensor, draft_slots: torch.Tensor) -> torch.Tensor:
        """The store's scratch code (``-2 - j``) of draft slot ``s >= 1`` of batch row ``b``."""
        return -2 - (rows * self.stride + draft_slots - 1)

    def __call__(self, step: DraftStep) -> tuple[torch.Tensor, torch.Tensor]:
        B, n = step.tokens.shape
        depth = step.step  # every node fed at step s has depth s
        rows = torch.arange(B, device=step.tokens.device)[:, None]
        out_slots = self._scratch(rows, step.slots)
        # Ancestors at depths 1..depth (itself last): one fed slot per depth among that depth's K slots.
        by_depth = step.ancestors[:, :, 1 : 1 + depth * self.topk].reshape(B, n, depth, self.topk)
        anc_draft_slots = 1 + torch.arange(depth, device=rows.device) * self.topk + by_depth.int().argmax(-1)
        anc_slots = self._scratch(rows[:, :, None], anc_draft_slots)
        positions = (step.positions - 1).reshape(-1)
        query_req = rows.expand(B, n).reshape(-1)
        table = SlotTable(self.req_table, query_req, self.prefix_lens[query_req], anc_slots.reshape(B * n, depth))
        batch = ForwardBatch(step.tokens.reshape(-1), positions, out_slots.reshape(-1), table)
        hidden = step.parent_hidden.reshape(B * n, *step.parent_hidden.shape[2:])
        out = mtp_forward(self.model, batch, hidden, self.store)
        return out.logits.view(B, n, -1), out.streams.view(B, n, *out.streams.shape[1:])
