"""Best-first draft trees over exact conditionals (``tree.best_first``), against brute force on a tiny vocabulary.

The conditional of depth d + 1 given a parent token t is ``softmax(U[b, d] + M[t])`` (DSpark's form). Brute force
enumerates every path of depth <= S whose every token is among the top K of its own parent's conditional, scores it
by its log-probability and keeps the best D - 1: the best-first tree must hold exactly those paths. Also: K = 1 is
the greedy chain; the tree is prefix-closed with depth <= S; a negative control (children taken from a conditional
that ignores the parent's token) does not match brute force.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from sglang_tree_v4.tree.best_first import best_first_tree

V, GAMMA = 6, 3


def setup(seed: int, B: int = 3):
    g = torch.Generator().manual_seed(seed)
    U, M = 2 * torch.randn(B, GAMMA, V, generator=g), 2 * torch.randn(V, V, generator=g)
    roots = torch.randint(0, V, (B,), generator=g)

    def conditional(d, tokens, rows):
        return U[rows, d] + M[tokens]

    return U, M, roots, conditional


def brute_force(U, M, root: int, b: int, S: int, K: int, n: int) -> set[tuple[int, ...]]:
    paths = {}

    def walk(path: tuple[int, ...], parent: int, score: float) -> None:
        if len(path) == S:
            return
        lp = (U[b, len(path)] + M[parent]).log_softmax(-1)
        for t in lp.topk(K).indices.tolist():
            p = path + (t,)
            paths[p] = score + float(lp[t])
            walk(p, t, paths[p])

    walk((), root, 0.0)
    return set(sorted(paths, key=paths.get, reverse=True)[:n])


def tree_paths(tree, b: int) -> set[tuple[int, ...]]:
    out = set()
    for i in range(1, int(tree.num_nodes[b])):
        path, j = [], i
        while j > 0:
            path.append(int(tree.tokens[b, j]))
            j = int(tree.parents[b, j])
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("seed,S,K,D", [(0, 3, 2, 8), (1, 3, 3, 12), (2, 2, 4, 9), (3, 3, 6, 16)])
def test_equals_brute_force_top_paths(seed, S, K, D):
    U, M, roots, conditional = setup(seed)
    tree = best_first_tree(roots, conditional, S, K, D)
    for b in range(roots.shape[0]):
        assert tree_paths(tree, b) == brute_force(U, M, int(roots[b]), b, S, K, D - 1)
        for i in range(1, D):  # prefix-closed, parents first, depth <= S, scores never above the parent's
            p = int(tree.parents[b, i])
            assert 0 <= p < i and int(tree.depths[b, i]) == int(tree.depths[b, p]) + 1 <= S
            assert float(tree.scores[b, i]) <= float(tree.scores[b, p]) + 1e-6


def test_k1_is_the_greedy_chain():
    U, M, roots, conditional = setup(5)
    tree = best_first_tree(roots, conditional, GAMMA, 1, GAMMA + 1)
    for b in range(roots.shape[0]):
        prev, chain = int(roots[b]), []
        for d in range(GAMMA):
            prev = int((U[b, d] + M[prev]).argmax())
            chain.append(prev)
        assert tree.tokens[b, 1:].tolist() == chain and tree.parents[b].tolist() == [-1, 0, 1, 2]


def test_negative_control_children_from_the_wrong_conditional_do_not_match():
    U, M, roots, _ = setup(0)

    def parent_blind(d, tokens, rows):  # every node's children as if its own token did not matter
        return U[rows, d] + M[torch.zeros_like(tokens)]

    tree = best_first_tree(roots, parent_blind, 3, 2, 8)
    assert any(tree_paths(tree, b) != brute_force(U, M, int(roots[b]), b, 3, 2, 7) for b in range(3))


def test_logits_hook_and_early_exhaustion():
    """The hook sees each node's path below the root; with K = 1, S = 2 a request has only 2 nodes to give."""
    U, M, roots, conditional = setup(7)
    seen = []

    def hook(logits, paths):
        seen.append(paths.shape[-1])
        banned = logits.clone()
        banned[..., 0] = -float("inf")  # token 0 is never drafted
        return banned

    tree = best_first_tree(roots, conditional, 2, 1, 6, logits_hook=hook)
    assert tree.width == 3 and sorted(set(seen)) == [0, 1]
    assert not bool((tree.tokens[:, 1:] == 0).any())
    for a, b in itertools.combinations(range(3), 2):
        assert tree.num_nodes[a] == tree.num_nodes[b] == 3
