"""What a verify step decides, in the form the worker commits: accepted nodes, emitted tokens, accept lengths."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .draft_tree import DraftTree


@dataclass
class VerifyResult:
    """Outcome of verifying a :class:`DraftTree` batch (all ``[B, D]`` padded with -1).

    Attributes:
        accepted_nodes: the accepted root-to-node path, root first: ``accepted_nodes[b, :accept_lens[b]]``.
            Their target KV is what gets committed.
        tokens: the emitted tokens, ``tokens[b, i]`` = the token chosen from the target's distribution at
            ``accepted_nodes[b, i]``: the accepted draft tokens, then the bonus token.
        accept_lens: ``[B]`` tokens emitted this step = accepted draft tokens + 1 (SGLang's accept length).
    """

    accepted_nodes: torch.Tensor
    tokens: torch.Tensor
    accept_lens: torch.Tensor

    @property
    def last_nodes(self) -> torch.Tensor:
        """``[B]`` the deepest accepted node (the bonus token's parent; its hidden state seeds the next draft)."""
        return self.accepted_nodes.gather(1, (self.accept_lens - 1)[:, None]).squeeze(1)

    @property
    def bonus_tokens(self) -> torch.Tensor:
        """``[B]`` the token sampled at the last accepted node: the next tree's root."""
        return self.tokens.gather(1, (self.accept_lens - 1)[:, None]).squeeze(1)

    @classmethod
    def from_last_node(cls, tree: DraftTree, last_nodes: torch.Tensor, bonus_tokens: torch.Tensor) -> "VerifyResult":
        """Assembles the result from the deepest accepted node and the bonus token of each request."""
        batch, width = tree.tokens.shape
        # Walk up from the last node (chain[:, k] = its k-th ancestor), then reverse so that the root comes first.
        levels = width  # the deepest possible path: fixed shapes, no host sync
        chain = torch.empty(batch, levels, dtype=torch.long, device=tree.device)
        cur = last_nodes.long()
        for k in range(levels):
            chain[:, k] = cur
            cur = torch.where(cur >= 0, tree.parents.gather(1, cur.clamp(min=0)[:, None]).squeeze(1), -1)
        accept_lens = (chain >= 0).sum(-1)
        d = torch.arange(levels, device=tree.device)
        path = chain.gather(1, (accept_lens[:, None] - 1 - d).clamp(min=0))
        accepted = torch.full((batch, width), -1, dtype=torch.long, device=tree.device)
        accepted[:, :levels] = torch.where(d < accept_lens[:, None], path, -1)
        tokens = torch.full_like(accepted, -1)
        # Entry i is the token of accepted node i + 1; the slot after the last accepted node takes the bonus.
        next_nodes = accepted[:, 1:]
        tokens[:, :-1] = torch.where(next_nodes >= 0, tree.tokens.gather(1, next_nodes.clamp(min=0)), -1)
        tokens.scatter_(1, (accept_lens - 1)[:, None], bonus_tokens.long()[:, None])
        return cls(accepted, tokens, accept_lens)
