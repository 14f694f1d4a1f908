"""Tree verification for DeepSeek-V4 compressed attention: the three mechanisms as three operations.

Trees are plain tensors, padded per batch like the tree core's ``DraftTree``: ``tokens [B, D]``, ``parents [B, D]``
(-1 for the root and for padding, ``parents[b, i] < i``), ``num_nodes [B]``. Node 0 is the root: the bonus token
(last sampled, not yet run by the target) at position ``L_b``; a node at depth d sits at position ``L_b + d``.

1. **Branch-aware verification** (``verify``): one target forward over every node of every request. Each node
   writes only its own scratch slot and reads through a slot table whose committed part is the request's table
   (positions ``< L_b``) and whose tree part is the node's own path (root .. itself). With the model's one
   attention formulation this means, per layer type: window = committed ``[p-W+1, L-1]`` plus ancestors;
   compressed entries = committed entries plus those closed by ancestors (or itself), where an entry closed in the
   tree is pooled from committed rows and ancestor rows only; the CSA indexer scores exactly that list.
2. **Temporary state isolation**: a consequence of (1) -- the forward writes nothing but the nodes' scratch
   slots; committed rows (window keys, compressor rows, entries, index keys, MTP keys) are read-only.
   ``committed_checksum`` fingerprints them so tests (and debug builds) can assert it.
3. **Accepted-path refresh** (``commit``): copy the accepted nodes' whole rows (every layer, every piece) into the
   canonical slots of positions ``L .. L+k`` and point the request table there. Because all
   compressor state is "rows at positions", this is the entire refresh: the open-window rows, the entries the
   path closed and the raw keys land exactly where sequential decoding would have written them. Scratch slots of
   rejected nodes are simply released (nothing committed needs clearing). The MTP layer's window keys for the
   accepted positions are recomputed from the target's verify streams (the MTP catch-up), as SGLang's draft extend
   does, since draft-time MTP rows came from the MTP's own streams.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import DSV4Model
from .storage import ForwardBatch, SlotStore, SlotTable, StepCaps


def tree_paths(parents: torch.Tensor, num_nodes: torch.Tensor,
               check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [B, D] -> (depth [B, D], path [B, D, D]) with ``path[b, n, j]`` = the ancestor of node n at depth j
    (``path[b, n, depth[b, n]] == n``), -1 beyond the node's depth and for padding nodes. ``check=False`` skips
    the validation, the one host synchronisation here (inside a fixed-shape step)."""
    B, D = parents.shape
    dev = parents.device
    valid = torch.arange(D, device=dev)[None, :] < num_nodes[:, None]
    if check:
        bad_child = valid[:, 1:] & ((parents[:, 1:] < 0) | (parents[:, 1:] >= torch.arange(1, D, device=dev)))
        if (parents[:, 0] != -1).any() or bad_child.any():
            raise ValueError("parents must be -1 for the root and satisfy 0 <= parents[i] < i for every other node")
    # climb: chain[k] = k-th ancestor (k = 0 is the node itself)
    chain = [torch.where(valid, torch.arange(D, device=dev).expand(B, D), -1)]
    for _ in range(D - 1):
        prev = chain[-1]
        up = torch.where(prev >= 0, parents.gather(1, prev.clamp(min=0)), -1)
        chain.append(up)
    chain = torch.stack(chain, -1)  # [B, D, D]: k-th ancestor
    depth = (chain >= 0).sum(-1) - 1
    depth = torch.where(valid, depth, 0)
    # path[j] = ancestor at depth j = (depth - j)-th ancestor
    j = torch.arange(D, device=dev)
    k = depth[..., None] - j
    path = torch.where((k >= 0) & valid[..., None], chain.gather(2, k.clamp(min=0)), -1)
    return depth, path


def parents_from_ancestor_mask(mask: torch.Tensor) -> torch.Tensor:
    """Ancestors-or-self masks ``[B, D, D]`` (SGLang's tree ``custom_mask`` restricted to the draft columns; nodes
    in topological order) -> parents ``[B, D]``. Along a root-to-node chain indices increase, so a node's parent
    is its largest-index strict ancestor; -1 for roots and all-false (padding) rows."""
    D = mask.shape[-1]
    strict = mask.bool() & ~torch.eye(D, dtype=torch.bool, device=mask.device)
    idx = torch.arange(D, device=mask.device)
    return torch.where(strict.any(-1), torch.where(strict, idx, -1).amax(-1), -1)


@dataclass
class VerifyBatch:
    """The flattened verify forward plus what is needed to unflatten it."""

    fb: ForwardBatch
    node_index: torch.Tensor  # [N] node index inside its tree
    request_index: torch.Tensor  # [N] b
    depth: torch.Tensor  # [B, D]
    counts: list[int] | None  # nodes per request (None with fixed shapes: every request has D rows)


def build_verify_batch(req_table: torch.Tensor, rids: torch.Tensor, lens: torch.Tensor, tokens: torch.Tensor,
                       parents: torch.Tensor, num_nodes: torch.Tensor, scratch: torch.Tensor,
                       isolation: bool = True, caps: StepCaps | None = None) -> VerifyBatch:
    """Flatten B trees into one ForwardBatch.

    req_table [R, T]: committed position -> slot (SGLang's ``req_to_token``); rids [B]: rows of it; lens [B]:
    committed lengths L; scratch [B, D]: each node's own output slot (SGLang: the request's verify slots).
    ``isolation=False`` exists only for the ablation test: nodes at the same depth then share one slot (a
    position-indexed table, what a chain verifier would do), so siblings overwrite each other's state.

    ``caps`` (fixed shapes, no host sync): every node column of every request is a query, padding included, so
    ``scratch`` must hold a slot for each of the B x D nodes (SGLang reserves D verify slots per request); a
    padding node writes only its own slot and nothing reads it.
    """
    B, D = tokens.shape
    dev = tokens.device
    depth, path = tree_paths(parents, num_nodes, check=caps is None)
    if caps is not None:
        if not isolation:
            raise ValueError("the isolation ablation has no fixed-shape form")
        b_idx = torch.arange(B, device=dev).repeat_interleave(D)
        n_idx = torch.arange(D, device=dev).repeat(B)
        counts = None
    else:
        valid = torch.arange(D, device=dev)[None, :] < num_nodes[:, None]
        b_idx, n_idx = valid.nonzero(as_tuple=True)
        counts = num_nodes.tolist()
    if isolation:
        out_slots = scratch[b_idx, n_idx]
        anc_nodes = path[b_idx, n_idx]  # [N, D]
        anc = torch.where(anc_nodes >= 0, scratch[b_idx[:, None], anc_nodes.clamp(min=0)], -1)
    else:  # ablation: slot of (request, depth) instead of (request, node)
        out_slots = scratch[b_idx, depth[b_idx, n_idx]]
        dd = torch.arange(D, device=dev)[None, :]
        anc = torch.where(dd <= depth[b_idx, n_idx][:, None], scratch[b_idx[:, None], dd.expand(len(b_idx), D)], -1)
    positions = lens[b_idx] + depth[b_idx, n_idx]
    table = SlotTable(req_table, rids[b_idx], lens[b_idx], anc)
    fb = ForwardBatch(tokens[b_idx, n_idx], positions, out_slots, table, caps)
    return VerifyBatch(fb, n_idx, b_idx, depth, counts)


@dataclass
class VerifyResult:
    logits: list[torch.Tensor]  # per request [num_nodes_b, V], node order
    streams: list[torch.Tensor]  # per request [num_nodes_b, hc, D]: the MTP's hidden input per node
    depth: torch.Tensor  # [B, D]


@torch.no_grad()
def verify(model: DSV4Model, store: SlotStore, req_table: torch.Tensor, rids: torch.Tensor, lens: torch.Tensor,
           tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor, scratch: torch.Tensor,
           isolation: bool = True) -> VerifyResult:
    """Mechanism 1 (+2): per-node logits equal to sequentially decoding prefix + path(node); writes only
    ``scratch`` slots of ``store``."""
    vb = build_verify_batch(req_table, rids, lens, tokens, parents, num_nodes, scratch, isolation)
    out = model(vb.fb, store)
    return VerifyResult(list(out.logits.split(vb.counts)), list(out.streams.split(vb.counts)), vb.depth)


def commit(stores: list[SlotStore], req_table: torch.Tensor, rids: torch.Tensor, lens: torch.Tensor,
           accepted: torch.Tensor, scratch: torch.Tensor, canonical: torch.Tensor) -> None:
    """Mechanism 3 for a batch, with fixed shapes (no host sync): ``accepted [B, D]`` node indices (root first,
    a path, -1 padded) of requests ``rids [B]`` -> rows copied from their scratch slots into ``canonical [B, D]``
    (column j = the slot of position ``lens[b] + j``), the request table pointed there.

    ``canonical`` may overlap ``scratch`` (SGLang moves accepted rows to the front of the verify slots): a node's
    index is never smaller than its depth, and the copy gathers every source row before it writes. Padding
    columns copy a canonical row onto itself and rewrite the root's table entry with the same value."""
    valid = accepted >= 0
    root = canonical[:, :1].expand_as(canonical)
    src = torch.where(valid, scratch.gather(1, accepted.clamp(min=0)), canonical)
    for s in stores:
        s.copy_rows(src.flatten(), canonical.flatten())
    cols = lens.long()[:, None] + torch.where(valid, torch.arange(accepted.shape[1], device=valid.device), 0)
    req_table[rids.long()[:, None].expand_as(cols), cols] = torch.where(valid, canonical, root)


def committed_checksum(stores: list[SlotStore], req_table: torch.Tensor, rids: torch.Tensor,
                       lens: torch.Tensor) -> list[torch.Tensor]:
    """Fingerprint of every committed row of the given requests (mechanism 2's check)."""
    slots = torch.cat([req_table[int(r), :int(n)] for r, n in zip(rids, lens, strict=False)])
    return [c for s in stores for c in s.checksum(slots)]


def greedy_accept(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                  num_nodes: int) -> tuple[list[int], int]:
    """Plain greedy acceptance over one tree (a reference for tests and the CPU runner): from the root, follow the
    child whose token is the argmax of the current node's logits. -> (accepted node indices, bonus token)."""
    best = logits.argmax(-1).tolist()
    toks, par = tokens.tolist(), parents.tolist()
    path, node = [0], 0
    while True:
        nxt = [c for c in range(1, num_nodes) if par[c] == node and toks[c] == best[node]]
        if not nxt:
            return path, best[node]
        node = nxt[0]
        path.append(node)


class TreeVerifier:
    """Tree verification on top of a ``DSV4Runner`` (its allocator, request tables and stores)."""

    def __init__(self, runner):
        self.r = runner
        self.scratch: dict[int, torch.Tensor] = {}

    @property
    def stores(self) -> list[SlotStore]:
        """What commit moves: the target store. The MTP store's rows of accepted positions are recomputed from
        the target's streams by the MTP catch-up (``DSV4Runner.mtp_extend``), because draft-time MTP
        rows were computed from the MTP's own streams, not the target's."""
        return [self.r.store]

    def verify(self, rids: list[int], tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
               isolation: bool = True, scratch: list[torch.Tensor] | None = None) -> VerifyResult:
        """``scratch``: the nodes' slots per request if already allocated (e.g. by the MTP drafter, whose draft
        rows live in the same slots of the MTP store); otherwise allocated here. Released by commit/rollback."""
        B, D = tokens.shape
        dev = self.r.device
        table = torch.full((B, D), -1, dtype=torch.long, device=dev)
        for b, rid in enumerate(rids):
            if rid in self.scratch:
                raise RuntimeError(f"request {rid} has an uncommitted tree")
            n = int(num_nodes[b]) if isolation else D
            s = scratch[b] if scratch is not None else torch.tensor(self.r.alloc.alloc(n), dtype=torch.long,
                                                                    device=dev)
            table[b, :n] = s[:n]
            self.scratch[rid] = s
        scratch = table
        lens = torch.tensor([self.r.lens[rid] for rid in rids], dtype=torch.long, device=dev)
        return verify(self.r.model, self.r.store, self.r.req_table, torch.tensor(rids, device=dev), lens, tokens,
                      parents, num_nodes, scratch, isolation)

    def commit(self, rid: int, accepted: list[int]) -> None:
        """Accepted node indices (root first). Canonical slots = the first k+1 scratch slots; the rest is freed."""
        s = self.scratch.pop(rid)
        k1 = len(accepted)
        L = self.r.lens[rid]
        dev = s.device
        commit(self.stores, self.r.req_table, torch.tensor([rid], device=dev), torch.tensor([L], device=dev),
               torch.tensor([accepted], device=dev), s[None], s[None, :k1])
        self.r.lens[rid] = L + k1
        self.r.alloc.release(s[k1:].tolist())

    def rollback(self, rid: int) -> None:
        """Drop a tree without accepting anything (scratch released; committed state untouched)."""
        self.r.alloc.release(self.scratch.pop(rid).tolist())
