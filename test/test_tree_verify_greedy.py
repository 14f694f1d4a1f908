"""Greedy verification against step-by-step greedy decoding of the target along the tree."""

import pytest
import torch

from sglang_tree_v4.tree import DraftTree, verify_greedy
from sglang_tree_v4.tree.synthetic import distinct_tokens, random_parents
from support.oracles import target_logits_favouring_tree

VOCAB = 97


def greedy_walk(tree: DraftTree, logits: torch.Tensor, b: int) -> tuple[list[int], list[int]]:
    """Reference: decode greedily from the root, moving to the child whose token is the target's choice."""
    n = int(tree.num_nodes[b])
    node, nodes, tokens = 0, [0], []
    while True:
        choice = int(logits[b, node].argmax())
        tokens.append(choice)
        kids = [j for j in range(n) if tree.parents[b, j] == node and tree.tokens[b, j] == choice]
        if not kids:
            return nodes, tokens
        node = kids[0]
        nodes.append(node)


@pytest.mark.parametrize("shape,arity", [("chain", 2), ("star", 2), ("kary", 2), ("kary", 4), ("random", 2)])
@pytest.mark.parametrize("width", [1, 2, 5, 8, 16, 64])
def test_greedy_matches_sequential_greedy_decoding(shape, arity, width):
    batch = 6
    gen = torch.Generator().manual_seed(1000 * width + arity + len(shape))
    parents = random_parents(batch, width, shape, gen, arity)
    tokens = distinct_tokens(batch, width, VOCAB, gen)
    num_nodes = torch.randint(1, width + 1, (batch,), generator=gen)
    num_nodes[0] = width
    tree = DraftTree.from_parents(tokens, parents, num_nodes)
    logits = target_logits_favouring_tree(tree, gen, hit_rate=0.85)
    result = verify_greedy(tree, logits)
    longest = 0
    for b in range(batch):
        nodes, emitted = greedy_walk(tree, logits, b)
        length = len(emitted)
        longest = max(longest, length)
        assert result.accept_lens[b] == length
        assert result.tokens[b, :length].tolist() == emitted
        assert result.accepted_nodes[b, :length].tolist() == nodes
        assert (result.tokens[b, length:] == -1).all() and (result.accepted_nodes[b, length:] == -1).all()
        assert result.last_nodes[b] == nodes[-1] and result.bonus_tokens[b] == emitted[-1]
    if tree.max_depth() >= 1:
        assert longest >= 2, "the trees were meant to be accepted"
    if shape == "chain" and width >= 8:
        assert longest >= 4, "chains were meant to be accepted deeply"


def test_greedy_never_accepts_padding():
    tokens = torch.tensor([[5, 6, 7, 8]])
    tree = DraftTree.from_parents(tokens, torch.tensor([[-1, 0, 1, 2]]), num_nodes=torch.tensor([2]))
    logits = torch.zeros(1, 4, VOCAB)
    logits[0, 0, 6] = logits[0, 1, 0] = 1.0  # node 2 (padding, token 0) would match if it were real
    result = verify_greedy(tree, logits)
    assert result.accept_lens.tolist() == [2]
    assert result.tokens[0, :2].tolist() == [6, 0]
    assert result.accepted_nodes[0, :2].tolist() == [0, 1]


def test_one_node_trees_take_the_short_path_to_the_same_result():
    """A step without speculation verifies root-only trees: ``DraftTree.roots_only`` and the greedy fast path give
    what ``from_parents`` and the general rule give (the root accepted, its argmax emitted; the root sees itself)."""
    from sglang_tree_v4.tree.verify_result import VerifyResult

    gen = torch.Generator().manual_seed(3)
    roots = torch.randint(0, 50, (5,), generator=gen)
    fast = DraftTree.roots_only(roots)
    slow = DraftTree.from_parents(roots[:, None], torch.full((5, 1), -1), logprobs=torch.zeros(5, 1))
    for name in ("tokens", "parents", "depths", "logprobs", "scores", "num_nodes"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    logits = torch.randn(5, 1, 50, generator=gen)
    got = verify_greedy(fast, logits)
    want = VerifyResult.from_last_node(slow, torch.zeros(5, dtype=torch.long), logits[:, 0].argmax(-1))
    for name in ("accepted_nodes", "tokens", "accept_lens"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.equal(got.tokens[:, 0], logits[:, 0].argmax(-1))
    # The attention mask's short path: what the path walk gives (a node sees the nodes on its root path).
    path = slow.path_nodes(max_depth=0)
    walked = torch.zeros(5, 1, 2, dtype=torch.bool).scatter_(2, torch.where(path >= 0, path, 1), True)[..., :1]
    assert fast.ancestor_mask().dtype == torch.bool and torch.equal(fast.ancestor_mask(), walked)
