"""A batch of draft trees as padded tensors, plus the derived tensors verification and attention need.

Every request in a batch owns up to ``D`` node slots (``D`` = the padded width, the largest budget in the batch).
Node 0 is the root: the last accepted token, which the target has not yet processed, at depth 0. Nodes are in
topological order (a parent's index is smaller than its children's), and siblings are in the order in which
verification tries them (best draft score first). Slots ``>= num_nodes[b]`` are padding: parent -1, depth 0,
token 0, and they are nobody's ancestor, so they can never be accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """Padded batch of draft trees.

    Attributes:
        tokens: ``[B, D]`` int64 token id of every node (node 0 = root).
        parents: ``[B, D]`` int64 parent node index, -1 for the root and for padding.
        depths: ``[B, D]`` int64 distance from the root (root and padding: 0).
        logprobs: ``[B, D]`` float32 draft log-probability of the node's token given its parent (root: 0).
        scores: ``[B, D]`` float32 cumulative draft log-probability of the path root..node (root: 0).
        num_nodes: ``[B]`` int64 valid nodes per request, root included (1 <= num_nodes[b] <= D).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    logprobs: torch.Tensor
    scores: torch.Tensor
    num_nodes: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        """Padded node count ``D`` per request."""
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @classmethod
    def roots_only(cls, roots: torch.Tensor) -> "DraftTree":
        """One-node trees (a step without speculation), as ``from_parents`` builds them, without its checks and path
        walk: such a step runs at every large batch, where these cost as much as SGLang's sampler."""
        tokens = roots.long()[:, None]
        zeros = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        return cls(tokens, torch.full_like(tokens, -1), torch.zeros_like(tokens), zeros, zeros.clone(),
                   torch.ones(tokens.shape[0], dtype=torch.long, device=tokens.device))

    @classmethod
    def from_parents(
        cls,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        num_nodes: torch.Tensor | None = None,
        logprobs: torch.Tensor | None = None,
    ) -> "DraftTree":
        """Builds a tree from tokens and parent indices, computing depths and (if logprobs are given) scores.

        ``parents[b, 0]`` must be -1 and ``parents[b, i] < i`` for valid ``i > 0``; entries at or past
        ``num_nodes[b]`` are overwritten as padding. Without logprobs, logprobs and scores are zero.
        """
        batch, width = tokens.shape
        device = tokens.device
        if num_nodes is None:
            num_nodes = torch.full((batch,), width, dtype=torch.long, device=device)
        valid = torch.arange(width, device=device)[None, :] < num_nodes[:, None]
        parents = torch.where(valid, parents.long(), -1)
        tokens = torch.where(valid, tokens.long(), 0)
        if logprobs is None:
            logprobs = torch.zeros(batch, width, device=device)
        logprobs = torch.where(valid, logprobs.float(), 0.0)
        logprobs[:, 0] = 0.0
        tree = cls(tokens, parents, torch.zeros_like(tokens), logprobs, torch.zeros_like(logprobs), num_nodes.long())
        tree.check()
        path = tree.path_nodes(max_depth=width - 1)
        on_path = path >= 0
        tree.depths = on_path.sum(-1) - 1
        tree.depths = torch.where(valid, tree.depths, 0)
        lp_on_path = torch.where(on_path, logprobs.gather(1, path.clamp(min=0).flatten(1)).view_as(path), 0.0)
        tree.scores = torch.where(valid, lp_on_path.sum(-1), 0.0)
        return tree

    def check(self) -> None:
        """Raises ValueError unless the tensors describe padded topologically ordered trees (cheap, syncs)."""
        valid = self.valid_mask()
        idx = torch.arange(self.width, device=self.device)[None, :]
        if not bool((self.num_nodes >= 1).all()) or not bool((self.num_nodes <= self.width).all()):
            raise ValueError("num_nodes must be in [1, D]")
        if not bool((self.parents[:, 0] == -1).all()):
            raise ValueError("node 0 must be the root (parent -1)")
        child = valid & (idx > 0)
        ok = (self.parents >= 0) & (self.parents < idx)
        if not bool((ok | ~child).all()):
            raise ValueError("every non-root node needs a parent with a smaller index")
        if not bool((self.parents[~valid] == -1).all()):
            raise ValueError("padding nodes must have parent -1")

    def valid_mask(self) -> torch.Tensor:
        """``[B, D]`` bool: True for real nodes (index < num_nodes)."""
        return torch.arange(self.width, device=self.device)[None, :] < self.num_nodes[:, None]

    def max_depth(self) -> int:
        """Deepest node in the batch (host sync)."""
        return int(self.depths.max())

    def path_nodes(self, max_depth: int | None = None) -> torch.Tensor:
        """``[B, D, max_depth + 1]`` int64: ``path[b, i, d]`` = the ancestor of node i at depth d, -1 past i's depth.

        Row i is the root-to-i path, i.e. for a leaf the root-to-leaf path used for acceptance. Padding rows hold
        only themselves at depth 0. Loops over depth, never over nodes or requests.
        """
        if max_depth is None:
            max_depth = self.max_depth()
        batch, width = self.tokens.shape
        levels = max_depth + 1
        # Walk up: chain[..., k] = k-th ancestor (k = 0 is the node itself), -1 once past the root.
        chain = torch.empty(batch, width, levels, dtype=torch.long, device=self.device)
        cur = torch.arange(width, device=self.device).expand(batch, width)
        for k in range(levels):
            chain[..., k] = cur
            cur = torch.where(cur >= 0, self.parents.gather(1, cur.clamp(min=0)), -1)
        depth = (chain >= 0).sum(-1, keepdim=True) - 1
        d = torch.arange(levels, device=self.device)
        # Reverse each chain so that column d holds the ancestor at depth d.
        path = chain.gather(2, (depth - d).clamp(min=0))
        return torch.where(d <= depth, path, -1)

    def ancestor_mask(self) -> torch.Tensor:
        """``[B, D, D]`` bool tree attention mask: ``mask[b, i, j]`` iff node j is an ancestor of node i or i itself.

        Padding rows see only themselves (so no attention row is empty); padding columns are seen by nobody else.
        """
        batch, width = self.tokens.shape
        if width == 1:  # one-node trees (a step without speculation, every step at large batches): the root alone
            return torch.ones(batch, 1, 1, dtype=torch.bool, device=self.device)
        path = self.path_nodes(max_depth=width - 1)  # the largest depth possible: no host sync
        cols = torch.where(path >= 0, path, width)
        mask = torch.zeros(batch, width, width + 1, dtype=torch.bool, device=self.device)
        mask.scatter_(2, cols, True)
        return mask[..., :width]

    def positions(self, prefix_lens: torch.Tensor) -> torch.Tensor:
        """``[B, D]`` int64 token positions: ``prefix_lens[b] + depth`` (prefix_lens = committed tokens before the
        root)."""
        return prefix_lens.long()[:, None] + self.depths

    def sibling_links(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-child/right-sibling form of the tree (SGLang's retrieve_next_token / retrieve_next_sibling).

        Returns ``(first_child, next_sibling)``, both ``[B, D]`` int64 with -1 for none: the lowest-index child of
        each node, and the next higher-index node with the same parent.
        """
        width = self.width
        idx = torch.arange(width, device=self.device)
        valid = self.valid_mask()
        # is_child[b, i, j]: j is a child of i.
        is_child = (self.parents[:, None, :] == idx[None, :, None]) & valid[:, None, :]
        first_child = torch.where(is_child, idx, width).amin(-1)
        same_parent = (self.parents[:, :, None] == self.parents[:, None, :]) & valid[:, None, :] & valid[:, :, None]
        later = idx[None, :] > idx[:, None]
        next_sibling = torch.where(same_parent & later & (self.parents[:, :, None] >= 0), idx, width).amin(-1)
        first_child = torch.where(first_child < width, first_child, -1)
        next_sibling = torch.where(next_sibling < width, next_sibling, -1)
        return first_child, next_sibling

    def leaf_mask(self) -> torch.Tensor:
        """``[B, D]`` bool: valid nodes without children."""
        first_child, _ = self.sibling_links()
        return self.valid_mask() & (first_child < 0)
