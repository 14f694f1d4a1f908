"""Acceptance per shape, learned online: every verified tree also answers for each smaller shape it contains.

Keeping only a tree's nodes of depth <= S and, among them, the D - 1 with the best draft scores (EAGLE-2's rerank;
a parent scores at least as high as its children, so the kept set is a subtree), the accepted path's surviving
nodes are exactly what greedy acceptance of that smaller tree would have accepted. One step thus updates every
shape at or below the one it ran.
"""

from __future__ import annotations

import torch

from ...tree import DraftTree

# The shape (D, S) of a step without speculation: the root alone is verified, so it emits exactly one token.
NO_SPECULATION = (1, 0)


def counterfactual_accepts(tree: DraftTree, accepted_nodes: torch.Tensor, accept_lens: torch.Tensor,
                           max_steps: int) -> torch.Tensor:
    """``[B, max_steps + 1, D + 1]``: for every request, the tokens it would have emitted had its tree been cut to
    depth <= s and the d - 1 best-scored such nodes (entry ``[b, s, d]``; d = 1 or s = 0: 1 token)."""
    B, D = tree.tokens.shape
    dev = tree.tokens.device
    idx = torch.arange(D, device=dev)
    steps = torch.arange(1, max_steps + 1, device=dev)[None, :, None]  # [1, S, 1]
    on_path = (idx >= 1) & (idx < accept_lens[:, None])  # [B, D]: accepted draft nodes, by depth
    # Per depth cut s: nodes of depth <= s ranked by score (stable: a parent before its equally scored child).
    keep = ((idx < tree.num_nodes[:, None]) & (tree.depths >= 1))[:, None, :] & (tree.depths[:, None, :] <= steps)
    key = torch.where(keep, tree.scores.float()[:, None, :], float("-inf"))
    order = torch.argsort(-key, dim=2, stable=True)
    rank = torch.empty_like(order).scatter_(2, order, idx.expand_as(order).contiguous())
    rank = torch.where(keep, rank, D)
    path_rank = rank.gather(2, accepted_nodes.clamp(min=0)[:, None, :].expand_as(rank))  # [B, S, D]: by depth i
    path_rank = torch.where(on_path[:, None, :] & (idx[None, None, :] <= steps), path_rank, D)
    d = torch.arange(D + 1, device=dev)
    out = torch.ones(B, max_steps + 1, D + 1, dtype=torch.float32, device=dev)
    out[:, 1:, :] = 1 + (path_rank[:, :, None, :] < (d - 1)[None, None, :, None]).sum(-1).float()
    out[:, :, 0] = 1
    return out


class AcceptanceStats:
    """Decayed means of ``counterfactual_accepts`` per shape (only shapes at or below a run shape are updated), and
    of their squares: the spread of a request's tokens per round decides how far apart requests drift
    (``lockstep``).

    Shapes above the one usually run are updated only by the rare explorations, so their plain means rest on a few
    rounds from other stretches of the traffic: noisy, and the policy picks whichever of them happens to be high.
    What those rounds measure precisely is the *gain* of each extra node over the next smaller shape (small for
    the late nodes, and measured on the same requests), so a shape updated less often than the small ones is
    estimated from the largest shape every update covered plus the mean gains above it (``table``). Where every
    update covers a shape, this is its plain mean."""

    def __init__(self, max_tokens: int, max_steps: int):
        self.sum = torch.zeros(max_steps + 1, max_tokens + 1)
        self.squares = torch.zeros(max_steps + 1, max_tokens + 1)
        self.weight = torch.zeros(max_steps + 1, max_tokens + 1)
        # [s, d]: decayed sum of (tokens at d) - (tokens at d - 1) over the same requests (its weight: ``weight``'s)
        self.gain = torch.zeros(max_steps + 1, max_tokens + 1)

    def update(self, accepts: torch.Tensor, ran: tuple[int, int], decay: float) -> None:
        """``decay``: the weight left to what was known before (the policy's per-step decay, to the power of the
        steps since the last update)."""
        d, s = ran
        self.sum *= decay
        self.squares *= decay
        self.weight *= decay
        self.gain *= decay
        kept = accepts[:, : s + 1, : d + 1]
        self.sum[: s + 1, : d + 1] += kept.sum(0).cpu()
        self.squares[: s + 1, : d + 1] += kept.square().sum(0).cpu()
        self.weight[: s + 1, : d + 1] += accepts.shape[0]
        self.gain[: s + 1, 1: d + 1] += (kept[:, :, 1:] - kept[:, :, :-1]).sum(0).cpu()

    def expected(self, shape: tuple[int, int]) -> float | None:
        d, s = shape
        return 1.0 if shape == NO_SPECULATION else self.table()[s][d]

    def table(self) -> list[list[float | None]]:
        """``expected`` of every shape at once, indexed ``[s][d]``: the plain mean of a shape every update of its
        row covered; for one updated less often, ``mean[a] + gain[a + 1] + ... + gain[d]`` with ``a`` the largest
        such fully covered d' < d and each gain the mean over the rounds that covered it (class doc)."""
        weight = self.weight.clamp(min=1e-30)
        seen = self.weight > 0
        lighter = torch.zeros_like(seen)
        # every update covers d <= 1 (a weight never grows with d): d is anchored below where it has less
        lighter[:, 2:] = seen[:, 2:] & (self.weight[:, 2:] < self.weight[:, 1:2] * (1 - 1e-6))
        cols = torch.arange(seen.shape[1]).expand_as(seen)
        anchor = torch.where(lighter, 0, cols).cummax(1).values
        gains = (self.gain / weight).cumsum(1)
        est = (self.sum / weight).gather(1, anchor) + gains - gains.gather(1, anchor)
        table = [[m if w else None for m, w in zip(row, wrow, strict=True)]
                 for row, wrow in zip(est.tolist(), seen.tolist(), strict=True)]
        table[NO_SPECULATION[1]][NO_SPECULATION[0]] = 1.0
        return table

    def spread_table(self) -> list[list[float]]:
        """The standard deviation of a request's tokens per round, per shape, indexed ``[s][d]`` (0 where unseen;
        over requests and steps alike: a request that accepts more than the others drifts ahead too)."""
        w = self.weight.clamp(min=1e-30)
        return (self.squares / w - (self.sum / w).square()).clamp(min=0).sqrt().tolist()
