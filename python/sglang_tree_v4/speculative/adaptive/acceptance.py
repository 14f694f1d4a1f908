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
    (``lockstep``)."""

    def __init__(self, max_tokens: int, max_steps: int):
        self.sum = torch.zeros(max_steps + 1, max_tokens + 1)
        self.squares = torch.zeros(max_steps + 1, max_tokens + 1)
        self.weight = torch.zeros(max_steps + 1, max_tokens + 1)

    def update(self, accepts: torch.Tensor, ran: tuple[int, int], decay: float) -> None:
        """``decay``: the weight left to what was known before (the policy's per-step decay, to the power of the
        steps since the last update)."""
        d, s = ran
        self.sum *= decay
        self.squares *= decay
        self.weight *= decay
        kept = accepts[:, : s + 1, : d + 1]
        self.sum[: s + 1, : d + 1] += kept.sum(0).cpu()
        self.squares[: s + 1, : d + 1] += kept.square().sum(0).cpu()
        self.weight[: s + 1, : d + 1] += accepts.shape[0]

    def expected(self, shape: tuple[int, int]) -> float | None:
        d, s = shape
        if shape == NO_SPECULATION:
            return 1.0
        w = float(self.weight[s, d])
        return float(self.sum[s, d]) / w if w > 0 else None

    def table(self) -> list[list[float | None]]:
        """``expected`` of every shape at once, indexed ``[s][d]`` (one tensor read instead of one per shape)."""
        means = (self.sum / self.weight.clamp(min=1e-30)).tolist()
        weights = self.weight.tolist()
        table = [[m if w > 0 else None for m, w in zip(row, wrow, strict=True)]
                 for row, wrow in zip(means, weights, strict=True)]
        table[NO_SPECULATION[1]][NO_SPECULATION[0]] = 1.0
        return table

    def spread_table(self) -> list[list[float]]:
        """The standard deviation of a request's tokens per round, per shape, indexed ``[s][d]`` (0 where unseen;
        over requests and steps alike: a request that accepts more than the others drifts ahead too)."""
        w = self.weight.clamp(min=1e-30)
        return (self.squares / w - (self.sum / w).square()).clamp(min=0).sqrt().tolist()
