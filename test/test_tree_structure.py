"""DraftTree's derived tensors against per-node Python walks of the same trees."""

import pytest
import torch

from sglang_tree_v4.tree import DraftTree
from sglang_tree_v4.tree.synthetic import distinct_tokens, random_parents

SHAPES = [("chain", 2), ("star", 2), ("kary", 2), ("kary", 3), ("random", 2)]


def make_tree(shape: str, arity: int, batch: int, width: int, seed: int, mixed: bool) -> DraftTree:
    gen = torch.Generator().manual_seed(seed)
    parents = random_parents(batch, width, shape, gen, arity)
    tokens = distinct_tokens(batch, width, 4 * width, gen)
    num_nodes = torch.randint(1, width + 1, (batch,), generator=gen) if mixed else None
    logprobs = -torch.rand(batch, width, generator=gen) * 3
    return DraftTree.from_parents(tokens, parents, num_nodes, logprobs)


def ancestors_of(tree: DraftTree, b: int, i: int) -> list[int]:
    """Root-to-i path by following parent pointers one at a time."""
    path = [i]
    while tree.parents[b, path[-1]] >= 0:
        path.append(int(tree.parents[b, path[-1]]))
    return path[::-1]


@pytest.mark.parametrize("shape,arity", SHAPES)
@pytest.mark.parametrize("width", [1, 2, 7, 64])
@pytest.mark.parametrize("mixed", [False, True])
def test_derived_tensors_match_walks(shape, arity, width, mixed):
    batch = 3
    tree = make_tree(shape, arity, batch, width, seed=width * 7 + arity, mixed=mixed)
    anc = tree.ancestor_mask()
    path = tree.path_nodes()
    first_child, next_sibling = tree.sibling_links()
    positions = tree.positions(torch.tensor([5, 0, 100]))
    leaves = tree.leaf_mask()
    for b in range(batch):
        n = int(tree.num_nodes[b])
        for i in range(width):
            if i >= n:  # padding sees only itself and is nobody's relative
                assert anc[b, i].nonzero().flatten().tolist() == [i]
                assert not anc[b, :n, i].any()
                assert tree.parents[b, i] == -1 and not leaves[b, i]
                continue
            walk = ancestors_of(tree, b, i)
            assert anc[b, i].nonzero().flatten().tolist() == sorted(walk)
            assert path[b, i, : len(walk)].tolist() == walk
            assert (path[b, i, len(walk):] == -1).all()
            assert tree.depths[b, i] == len(walk) - 1
            assert positions[b, i] == [5, 0, 100][b] + len(walk) - 1
            expected_score = sum(float(tree.logprobs[b, j]) for j in walk)
            assert tree.scores[b, i].item() == pytest.approx(expected_score, abs=1e-5)
            kids = [j for j in range(n) if tree.parents[b, j] == i]
            assert first_child[b, i] == (kids[0] if kids else -1)
            assert bool(leaves[b, i]) == (not kids)
            sibs = [j for j in range(i + 1, n) if i > 0 and tree.parents[b, j] == tree.parents[b, i]]
            assert next_sibling[b, i] == (sibs[0] if sibs else -1)


def test_check_rejects_non_topological_trees():
    tokens = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError):
        DraftTree.from_parents(tokens, torch.tensor([[-1, 2, 0]]))
    with pytest.raises(ValueError):
        DraftTree.from_parents(tokens, torch.tensor([[0, 0, 1]]))
    with pytest.raises(ValueError):
        DraftTree.from_parents(tokens, torch.tensor([[-1, -1, 1]]))
