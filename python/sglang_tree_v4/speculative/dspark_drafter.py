"""DSpark (``dsv4.dspark``) as the tree core's drafter, inside one SGLang round.

For a round over committed length ``L`` with root (bonus) token ``b`` at position ``L``:

* one backbone pass over the block ``[b, noise × (γ - 1)]`` at positions ``L .. L + γ - 1`` gives ``U [γ, V]``; its
  rows write their stage keys to the drafter store's window scratch (``γ`` rows per request, code ``-2 - row``),
  which nothing reads after the round;
* the tree is the best-first search over the exact conditionals (``tree.best_first``): a node at depth ``d`` with
  token ``t`` gets its children from row d's ``U_d + W2 · W1[t]``, no further forward, and the tree holds the
  ``D - 1`` most probable paths. K = 1, S = γ is DSpark's greedy chain;
* the verify forward returns the target's taps at every node, and after acceptance the root and the accepted nodes
  (positions ``L .. L + k``) get their stage keys at their canonical slots (``commit_context``), as a prefill
  writes every position of its chunk (``prefill_context``). Nothing else is kept: no rollback, no catch-up.
"""
from __future__ import annotations

import torch

from ..dsv4 import dspark as ds
from ..dsv4.storage import SlotStore, SlotTable
from ..tree.best_first import best_first_tree
from ..tree.draft_tree import DraftTree


def block_pass(model, store: SlotStore, req_table: torch.Tensor, lens: torch.Tensor,
               roots: torch.Tensor) -> ds.BlockOutput:
    """The backbone over each request's block (``req_table``: one row per request, ``lens`` committed lengths)."""
    B, gamma = roots.shape[0], model.dspark.dcfg.block_size
    dev = roots.device
    if B * gamma > store.window_scratch_rows:
        raise ValueError(f"the DSpark store has {store.window_scratch_rows} block scratch rows; {B} requests "
                         f"drafting blocks of {gamma} need {B * gamma}")
    block = -2 - (torch.arange(B, device=dev)[:, None] * gamma + torch.arange(gamma, device=dev))
    lens = lens.long()
    table = SlotTable.for_requests(req_table, torch.arange(B, device=dev), lens - 1)
    keys = ds.block_key_slots(table, lens, block, model.cfg.window)
    return ds.block_logits(model, roots, lens, keys, block, store)


def draft_tree(model, store: SlotStore, req_table: torch.Tensor, lens: torch.Tensor, roots: torch.Tensor,
               steps: int, topk: int, draft_tokens: int, score_temperature=1.0, logits_hook=None) -> DraftTree:
    """The round's tree (``steps`` ≤ γ): one block pass, then the best-first search over its exact conditionals
    (``tree.best_first``: the ``draft_tokens - 1`` most probable paths, ≤ ``topk`` children per node)."""
    gamma = model.dspark.dcfg.block_size
    if steps > gamma:
        raise ValueError(f"a DSpark drafter of block size {gamma} drafts at most {gamma} steps, asked for {steps}")
    out = block_pass(model, store, req_table, lens, roots)
    return search(model, out, roots, steps, topk, draft_tokens, score_temperature, logits_hook)


def search(model, out: ds.BlockOutput, roots: torch.Tensor, steps: int, topk: int, draft_tokens: int,
           score_temperature=1.0, logits_hook=None) -> DraftTree:
    """The best-first tree over a block pass's exact conditionals: no forward, one small product per node. Its
    cost grows with ``draft_tokens``, hardly with ``steps`` (the adaptive budget's startup timing counts it so)."""

    def conditional(depth: int, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return ds.conditional_logits(model, out.logits[rows, depth], tokens)

    return best_first_tree(roots.long(), conditional, steps, topk, draft_tokens, score_temperature, logits_hook)


def prefill_context(model, store: SlotStore, features: torch.Tensor, positions: torch.Tensor,
                    slots: torch.Tensor) -> None:
    """Stage keys of a prefill's positions from its forward's taps."""
    ds.write_context(model, features, positions, slots, store)


def commit_context(model, store: SlotStore, features: torch.Tensor, accept_index: torch.Tensor,
                   slots: torch.Tensor, lens: torch.Tensor) -> None:
    """Stage keys of the root and the accepted nodes, from the verify forward's taps ``features [B D, k H]``:
    the j-th accepted node (``accept_index [B, A]``, flat node index or -1) is position ``lens + j`` at its
    canonical slot ``slots[b, j]`` (``slots [B, A]``: the request's slots of positions ``lens .. lens + A - 1``,
    the verify block's columns, not its whole row). Unaccepted columns write SGLang's padding slot 0 (fixed
    shapes)."""
    A = accept_index.shape[1]
    positions = lens.long()[:, None] + torch.arange(A, device=lens.device)
    valid = accept_index >= 0
    slots = torch.where(valid, slots.long(), 0).flatten()
    feats = features[accept_index.clamp(min=0).flatten()]
    ds.write_context(model, feats, torch.where(valid, positions, 0).flatten(), slots, store)
