"""Drafting a tree with V4's MTP layer, and refreshing the MTP state after acceptance.

Position convention (see ``mtp``): an MTP query at position p consumes a hidden state for position p and the token
at p + 1, and predicts the token at p + 2. With L committed target positions and the bonus token b at position L:

* refresh: MTP queries at positions ``P .. L-1`` (P = positions the MTP has already processed) with the TARGET's
  streams and tokens one ahead (the last one uses b). They write the MTP's window keys into the canonical slots
  of those positions. The last query is the tree root's draft: its logits propose depth-1 tokens, its output
  streams are the hidden input of their queries.
* draft step d >= 1: a node n at depth d with token t_n runs an MTP query at position ``L + d - 1`` with its
  parent's MTP output streams and t_n (so it predicts depth d + 1). It writes only its own slot of the MTP store
  and reads committed MTP keys (positions < L) plus its path's draft keys (depths 1..d) -- the same per-query
  slot tables as target verification, so siblings never see each other.

After verification and commit of the accepted path, ``refresh`` runs over the newly committed positions with the
verify streams of the accepted nodes, overwriting the draft-time rows (which were computed from the MTP's own
streams and are not what sequential processing leaves).

``expand_topk`` is a simple expansion policy (every frontier node takes its top-k tokens) for tests and the CPU
runner; the EAGLE-2 build with reranking lives in the tree core and only needs ``draft_step``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import ModelOutput
from .mtp import mtp_forward
from .storage import ForwardBatch, SlotTable


@dataclass
class DraftState:
    """A tree being drafted for one request."""

    rid: int
    L: int  # committed target length; the root (bonus token) sits at position L
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    slots: torch.Tensor  # [budget] node slots (also the target verify slots)
    logits: list[torch.Tensor]  # per node: MTP logits proposing its children
    streams: list[torch.Tensor]  # per node: MTP output streams (hidden input of its children's queries)

    def path(self, n: int) -> list[int]:
        out = []
        while n >= 0:
            out.append(n)
            n = self.parents[n]
        return out[::-1]


class MTPTreeDrafter:
    def __init__(self, runner):
        if runner.mtp_store is None:
            raise ValueError("the model has no MTP layer")
        self.r = runner

    def refresh(self, rid: int, target_streams: torch.Tensor, next_tokens: list[int]) -> ModelOutput:
        """MTP over the committed positions it has not processed yet; ``target_streams`` [n, hc, D] are the target's
        streams of those positions, ``next_tokens`` the tokens one ahead (the last = the bonus token).
        Returns the last query's output (the root draft of the next tree)."""
        out = self.r.mtp_extend([rid], [next_tokens], [target_streams])[0]
        return ModelOutput(out.logits[-1:], out.streams[-1:])

    def start(self, rid: int, bonus: int, root: ModelOutput, budget: int) -> DraftState:
        slots = torch.tensor(self.r.alloc.alloc(budget), dtype=torch.long, device=self.r.device)
        return DraftState(rid, self.r.lens[rid], [bonus], [-1], [0], slots, [root.logits[0]], [root.streams[0]])

    @torch.no_grad()
    def draft_step(self, states: list[DraftState], new_nodes: list[list[tuple[int, int]]]) -> None:
        """Add nodes ``(parent, token)`` to each tree (all at one depth or not: any mix) and run their MTP queries in
        one forward. New nodes get the next free indices in ``state.slots``."""
        dev = self.r.device
        ids, pos, out, req, base, anc_rows, hs, where = [], [], [], [], [], [], [], []
        for st, nodes in zip(states, new_nodes):
            for parent, tok in nodes:
                n = len(st.tokens)
                if n >= len(st.slots):
                    raise ValueError(f"request {st.rid}: tree budget {len(st.slots)} exceeded")
                st.tokens.append(tok)
                st.parents.append(parent)
                st.depths.append(st.depths[parent] + 1)
                st.logits.append(None)
                st.streams.append(None)
                d = st.depths[n]
                ids.append(tok)
                pos.append(st.L + d - 1)
                out.append(st.slots[n])
                req.append(st.rid)
                base.append(st.L)
                anc_rows.append(st.slots[torch.tensor(st.path(n)[1:], device=dev)])  # depths 1..d
                hs.append(st.streams[parent])
                where.append((st, n))
        if not ids:
            return
        width = max(a.numel() for a in anc_rows)
        anc = torch.full((len(ids), width), -1, dtype=torch.long, device=dev)
        for i, a in enumerate(anc_rows):
            anc[i, : a.numel()] = a
        positions = torch.tensor(pos, device=dev)
        fb = ForwardBatch(torch.tensor(ids, device=dev), positions, torch.stack(out),
                          SlotTable(self.r.req_table, torch.tensor(req, device=dev), torch.tensor(base, device=dev),
                                    anc))
        res = mtp_forward(self.r.model, fb, torch.stack(hs), self.r.mtp_store)
        for i, (st, n) in enumerate(where):
            st.logits[n] = res.logits[i]
            st.streams[n] = res.streams[i]

    def expand_topk(self, states: list[DraftState], k: int, steps: int) -> None:
        """Every frontier node proposes its top-k tokens as children, ``steps`` levels deep, within each budget."""
        frontier = [[0] for _ in states]
        for _ in range(steps):
            new = []
            for st, fr in zip(states, frontier):
                room = len(st.slots) - len(st.tokens)
                nodes = [(p, t) for p in fr for t in st.logits[p].topk(k).indices.tolist()][:max(room, 0)]
                new.append(nodes)
            base = [len(st.tokens) for st in states]
            self.draft_step(states, new)
            frontier = [list(range(b, len(st.tokens))) for b, st in zip(base, states)]

    @staticmethod
    def as_tensors(states: list[DraftState]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (tokens [B, D], parents [B, D], num_nodes [B]) padded, for ``TreeVerifier.verify``."""
        D = max(len(st.tokens) for st in states)
        toks = torch.zeros(len(states), D, dtype=torch.long)
        par = torch.full((len(states), D), -1, dtype=torch.long)
        for b, st in enumerate(states):
            toks[b, : len(st.tokens)] = torch.tensor(st.tokens)
            par[b, : len(st.parents)] = torch.tensor(st.parents)
        return toks, par, torch.tensor([len(st.tokens) for st in states])
