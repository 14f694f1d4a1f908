"""Best-first draft trees over a drafter's exact conditionals: the top paths by draft probability.

A block drafter such as DSpark (``dsv4.dspark``) gives, after one backbone pass, the exact conditional of the token
at depth ``d + 1`` given any parent token at depth ``d`` (``conditional(d, tokens, rows) -> logits``). Then the
``N`` most probable paths (rooted at the request's bonus token, depth <= S, at most K children per node) can be
found exactly: a path's score, the sum of its tokens' log-probabilities, never exceeds its parent's, so a
best-first search that pops the highest-scoring candidate and only then offers its first child and its next
sibling pops nodes in score order, every popped node's parent already in the tree (prefix-closed). Each node's
children are the top-K of its *own* conditional (given its own token), computed once when it is popped.

One heap per request; each round pops one node per request and computes the new nodes' conditionals in one
batched call. It reads scores back to the host, so it is an eager step (not captured in a graph).
"""
from __future__ import annotations

import heapq
from typing import Callable

import torch

from .draft_tree import DraftTree


def best_first_tree(roots: torch.Tensor, conditional: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
                    num_steps: int, topk: int, num_nodes: int, score_temperature: float | torch.Tensor = 1.0,
                    logits_hook: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> DraftTree:
    """``roots [B]``; ``conditional(d, tokens [n], rows [n]) -> logits [n, V]``: the distribution of the token at
    depth ``d + 1`` below a node at depth ``d`` holding ``tokens``, for requests ``rows``; ``num_nodes`` = D with
    the root. ``logits_hook(logits [n, 1, V], paths [n, 1, d])`` as ``build_draft_tree``'s. Returns the tree with
    nodes in pop order (parents first), as wide as the most nodes any request got (at most D)."""
    B = roots.shape[0]
    device = roots.device
    if num_steps < 1 or topk < 1 or num_nodes < 1:
        raise ValueError("num_steps, topk and num_nodes must be >= 1")
    temps = (torch.as_tensor(score_temperature, dtype=torch.float32, device=device).flatten().expand(B)
             if not isinstance(score_temperature, float) or score_temperature != 1.0 else None)
    tokens = [[int(t)] for t in roots.tolist()]
    parents = [[-1] for _ in range(B)]
    logprobs = [[0.0] for _ in range(B)]
    paths: list[list[list[int]]] = [[[]] for _ in range(B)]  # tokens below the root, per node
    scores = [[0.0] for _ in range(B)]
    children: list[dict[int, tuple[list[float], list[int]]]] = [{} for _ in range(B)]  # node -> top-K (lp, tokens)
    heaps: list[list] = [[] for _ in range(B)]  # (-score, parent node, rank among its children)

    def expand(rows: list[int], nodes: list[int]) -> None:
        """Children lists of node ``nodes[i]`` of request ``rows[i]`` (at depth < S), and their first children
        offered."""
        by_depth: dict[int, list[int]] = {}
        for i, (b, n) in enumerate(zip(rows, nodes, strict=True)):
            by_depth.setdefault(len(paths[b][n]), []).append(i)
        for d, members in by_depth.items():
            rs = [rows[i] for i in members]
            ns = [nodes[i] for i in members]
            toks = torch.tensor([tokens[b][n] for b, n in zip(rs, ns, strict=True)], device=device)
            logits = conditional(d, toks, torch.tensor(rs, device=device)).float()
            if logits_hook is not None:
                path = torch.tensor([paths[b][n] for b, n in zip(rs, ns, strict=True)], dtype=torch.long,
                                    device=device).view(len(rs), 1, d)
                logits = logits_hook(logits[:, None], path)[:, 0].float()
            if temps is not None:
                logits = logits / temps[torch.tensor(rs, device=device)][:, None]
            lp, top = logits.log_softmax(-1).topk(topk, -1)
            for b, n, lps, ts in zip(rs, ns, lp.tolist(), top.tolist(), strict=True):
                children[b][n] = (lps, ts)
                heapq.heappush(heaps[b], (-(scores[b][n] + lps[0]), n, 0))

    if num_nodes > 1:
        expand(list(range(B)), [0] * B)
    for _ in range(num_nodes - 1):
        rows, nodes = [], []
        for b in range(B):
            if not heaps[b]:
                continue
            neg, parent, rank = heapq.heappop(heaps[b])
            lps, ts = children[b][parent]
            node = len(tokens[b])
            tokens[b].append(ts[rank])
            parents[b].append(parent)
            logprobs[b].append(lps[rank])
            scores[b].append(-neg)
            paths[b].append(paths[b][parent] + [ts[rank]])
            if rank + 1 < topk:
                heapq.heappush(heaps[b], (-(scores[b][parent] + lps[rank + 1]), parent, rank + 1))
            if len(paths[b][node]) < num_steps:
                rows.append(b)
                nodes.append(node)
        if rows:
            expand(rows, nodes)
    width = max(len(t) for t in tokens)

    def padded(rows: list[list], fill) -> torch.Tensor:
        return torch.tensor([r + [fill] * (width - len(r)) for r in rows], device=device)

    return DraftTree.from_parents(padded(tokens, 0), padded(parents, -1),
                                  torch.tensor([len(t) for t in tokens], device=device), padded(logprobs, 0.0))
