"""Plain reference implementations the tree tests compare against."""

from __future__ import annotations

import torch

from sglang_tree_v4.tree import DraftTree


def target_logits_favouring_tree(tree: DraftTree, gen: torch.Generator, hit_rate: float,
                                 vocab: int = 97) -> torch.Tensor:
    """Random logits, except that at each node (with probability ``hit_rate``) a random child's token is the argmax."""
    batch, width = tree.tokens.shape
    logits = torch.randn(batch, width, vocab, generator=gen)
    for b in range(batch):
        n = int(tree.num_nodes[b])
        for i in range(n):
            kids = [j for j in range(n) if tree.parents[b, j] == i]
            if kids and torch.rand(1, generator=gen).item() < hit_rate:
                pick = kids[int(torch.randint(len(kids), (1,), generator=gen))]
                logits[b, i, tree.tokens[b, pick]] = 10.0
    return logits


def reference_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The target's sampling distribution for one row, written plainly (sort, cut by top-k / top-p / min-p)."""
    vocab = logits.shape[0]
    out = torch.zeros(vocab, dtype=torch.float64)
    if temperature <= 1e-6 or top_k == 1:
        out[int(logits.argmax())] = 1.0
        return out
    probs = torch.softmax(logits.float() / temperature, dim=-1).tolist()
    order = sorted(range(vocab), key=lambda v: (-probs[v], v))
    limit = vocab if top_k <= 0 else top_k
    mass_before, kept = 0.0, []
    for rank, v in enumerate(order):
        if rank < limit and (top_p >= 1.0 or mass_before <= top_p):
            kept.append(v)
        mass_before += probs[v]
    biggest = max(probs)
    kept = [v for v in kept if probs[v] >= min_p * biggest]
    for v in kept:
        out[v] = probs[v]
    return out / out.sum()
