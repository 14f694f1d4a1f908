"""EAGLE-2 construction against a one-node-at-a-time reference expansion and a brute-force best subtree."""

import itertools
import math

import pytest
import torch

from sglang_tree_v4.tree import DraftStep, DraftTree, build_draft_tree
from sglang_tree_v4.tree.synthetic import FixedLogitsDrafter, PathHashDrafter

VOCAB = 61


def call_one(drafter, token: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter on a single node (batch 1, n 1); PathHashDrafter only looks at tokens and parent_hidden."""
    one = torch.zeros(1, 1, dtype=torch.long)
    step = DraftStep(0, torch.tensor([[token]]), one, one, one - 1, torch.ones(1, 1, 1, dtype=torch.bool),
                     hidden[None, None])
    logits, out = drafter(step)
    return logits[0, 0], out[0, 0]


def reference_pool(drafter, root: int, steps: int, topk: int, temperature: float = 1.0) -> list[dict]:
    """Candidate pool of EAGLE-2 expansion, expanding one node at a time: each entry has path, parent, score
    (log-probs of the draft distribution at ``temperature``)."""
    root_hidden = drafter.root_hidden(torch.tensor([root]))[0]
    pool = [dict(path=(root,), parent=-1, logprob=0.0, score=0.0)]
    frontier = [(0, root_hidden)]  # (pool index, parent_hidden to feed)
    for _step in range(steps):
        layer = []
        for pool_idx, parent_hidden in frontier:
            logits, hidden = call_one(drafter, pool[pool_idx]["path"][-1], parent_hidden)
            logprobs = torch.log_softmax(logits.double() / temperature, -1)
            for token in logprobs.topk(topk).indices.tolist():
                entry = dict(path=pool[pool_idx]["path"] + (token,), parent=pool_idx,
                             logprob=float(logprobs[token]), score=pool[pool_idx]["score"] + float(logprobs[token]))
                pool.append(entry)
                layer.append((len(pool) - 1, hidden))
        layer.sort(key=lambda e: -pool[e[0]]["score"])
        frontier = layer[:topk]
    return pool


def best_subtree_value(pool: list[dict], size: int) -> float:
    """Brute force: the largest sum of path probabilities over parent-closed subsets of ``size`` nodes (root incl.)."""
    best = -math.inf
    for subset in itertools.combinations(range(1, len(pool)), size - 1):
        chosen = {0, *subset}
        if all(pool[i]["parent"] in chosen for i in subset):
            best = max(best, sum(math.exp(pool[i]["score"]) for i in chosen))
    return best


def tree_paths(tree: DraftTree, b: int) -> list[tuple]:
    paths = []
    for i in range(int(tree.num_nodes[b])):
        p = tree.parents[b, i].item()
        paths.append((paths[p] if p >= 0 else ()) + (int(tree.tokens[b, i]),))
    return paths


@pytest.mark.parametrize("steps,topk,budget,temperature", [
    (1, 3, 3, 1.0), (2, 2, 4, 1.0), (3, 2, 6, 1.0), (2, 3, 8, 1.0), (4, 2, 8, 1.0), (3, 3, 5, 1.0),
    (3, 2, 6, 0.4), (4, 3, 8, 0.4), (2, 3, 8, 2.5),
])
def test_tree_is_the_best_subtree_of_the_candidates(steps, topk, budget, temperature):
    drafter = PathHashDrafter(VOCAB, seed=steps * 10 + topk, sharpness=3.0)
    roots = torch.tensor([5, 17, 42, 8])
    prefix = torch.tensor([0, 3, 9, 100])
    tree = build_draft_tree(roots, prefix, drafter, steps, topk, budget, drafter.root_hidden(roots),
                            score_temperature=temperature)
    tree.check()
    for b, root in enumerate(roots.tolist()):
        pool = reference_pool(drafter, root, steps, topk, temperature)
        by_path = {e["path"]: e for e in pool}
        size = min(budget, len(pool))
        assert tree.num_nodes[b] == size
        paths = tree_paths(tree, b)
        assert len(set(paths)) == size and all(p in by_path for p in paths), "nodes must come from the candidate pool"
        for i, path in enumerate(paths):
            assert tree.scores[b, i].item() == pytest.approx(by_path[path]["score"], abs=1e-4)
            assert tree.logprobs[b, i].item() == pytest.approx(by_path[path]["logprob"], abs=1e-4)
            assert tree.depths[b, i] == len(path) - 1
        value = sum(math.exp(by_path[p]["score"]) for p in paths)
        assert value == pytest.approx(best_subtree_value(pool, size), rel=1e-6)
        # Siblings are tried best first: node order among siblings follows the draft log-prob.
        for i in range(size):
            kids = [j for j in range(size) if tree.parents[b, j] == i]
            lps = [tree.logprobs[b, j].item() for j in kids]
            assert lps == sorted(lps, reverse=True)


def test_topk_one_is_the_greedy_chain():
    drafter = PathHashDrafter(VOCAB, seed=1)
    roots = torch.tensor([3, 30])
    tree = build_draft_tree(roots, torch.tensor([4, 7]), drafter, 6, 1, 7, drafter.root_hidden(roots))
    for b, root in enumerate(roots.tolist()):
        token, hidden, chain = root, drafter.root_hidden(torch.tensor([root]))[0], [root]
        for _ in range(6):
            logits, hidden = call_one(drafter, token, hidden)
            token = int(logits.argmax())
            chain.append(token)
        assert tree.tokens[b].tolist() == chain
        assert tree.parents[b].tolist() == list(range(-1, 6))
        assert tree.positions(torch.tensor([4, 7]))[b].tolist() == [[4, 7][b] + d for d in range(7)]


def test_score_temperature_moves_the_tree_between_width_and_depth():
    """The same candidates, scored at two temperatures. Every node's draft puts 33%, 20% and 12% on its top three
    children: at T = 1 the six-node tree is wide and shallow (a third child, 12%, outscores a grandchild, 11%); at
    T = 0.1 the top-1 child is near certain and the tree is the greedy chain, as deep as the steps allow."""
    roots = torch.tensor([7, 9])
    steps, topk, budget = 5, 3, 6
    logits = torch.zeros(11)
    logits[1], logits[2], logits[3] = 2.0, 1.5, 1.0
    drafter = FixedLogitsDrafter(logits.expand(2, topk, 11))

    def build(temperature):
        return build_draft_tree(roots, torch.zeros(2), drafter, steps, topk, budget, torch.zeros(2, 1),
                                score_temperature=temperature)

    wide, sharp = build(1.0), build(0.1)
    for b, root in enumerate(roots.tolist()):
        assert wide.depths[b].tolist() == [0, 1, 1, 1, 2, 2]
        assert tree_paths(sharp, b)[-1] == (root, 1, 1, 1, 1, 1)
        assert sharp.depths[b].tolist() == [0, 1, 2, 3, 4, 5]
        assert tree_paths(wide, b)[:5] == [(root,), (root, 1), (root, 2), (root, 3), (root, 1, 1)]
    with pytest.raises(ValueError, match="score_temperature"):
        build(0.0)


def test_per_request_temperatures_equal_separate_builds():
    drafter = PathHashDrafter(VOCAB, seed=9, sharpness=3.0)
    roots = torch.tensor([4, 19, 33])
    temps = torch.tensor([0.3, 1.0, 2.0])
    together = build_draft_tree(roots, torch.zeros(3), drafter, 4, 3, 8, drafter.root_hidden(roots),
                                score_temperature=temps)
    for b in range(3):
        alone = build_draft_tree(roots[b : b + 1], torch.zeros(1), drafter, 4, 3, 8,
                                 drafter.root_hidden(roots[b : b + 1]), score_temperature=float(temps[b]))
        assert together.tokens[b].tolist() == alone.tokens[0].tolist()
        assert together.parents[b].tolist() == alone.parents[0].tolist()
        torch.testing.assert_close(together.scores[b], alone.scores[0])


def test_mixed_budgets_equal_separate_builds():
    drafter = PathHashDrafter(VOCAB, seed=2)
    roots = torch.tensor([1, 2, 3])
    budgets = torch.tensor([3, 8, 5])
    together = build_draft_tree(roots, torch.zeros(3), drafter, 3, 3, budgets, drafter.root_hidden(roots))
    assert together.width == 8 and together.num_nodes.tolist() == [3, 8, 5]
    for b in range(3):
        alone = build_draft_tree(roots[b : b + 1], torch.zeros(1), drafter, 3, 3, int(budgets[b]),
                                 drafter.root_hidden(roots[b : b + 1]))
        n = int(budgets[b])
        for name in ("tokens", "parents", "depths"):
            assert getattr(together, name)[b, :n].tolist() == getattr(alone, name)[0].tolist()
        assert (together.parents[b, n:] == -1).all()


def test_budget_larger_than_the_pool_keeps_everything():
    drafter = PathHashDrafter(VOCAB, seed=3)
    roots = torch.tensor([9])
    tree = build_draft_tree(roots, torch.zeros(1), drafter, 2, 2, 16, drafter.root_hidden(roots))
    assert tree.width == 16 and tree.num_nodes.tolist() == [1 + 2 + 4]
    assert len(reference_pool(drafter, 9, 2, 2)) == 7


class FlatDrafter:
    """All logits equal (every candidate ties), or one token with all the mass (children tie their parent)."""

    def __init__(self, peaked: bool):
        self.peaked = peaked

    def __call__(self, step: DraftStep):
        logits = torch.zeros(*step.tokens.shape, 11)
        if self.peaked:
            logits[..., 4] = 1e4  # log-prob 0 exactly: child score == parent score
        return logits, step.parent_hidden


@pytest.mark.parametrize("peaked", [False, True])
def test_ties_still_give_a_tree(peaked):
    roots = torch.tensor([0, 1])
    tree = build_draft_tree(roots, torch.zeros(2), FlatDrafter(peaked), 3, 3, 7, torch.zeros(2, 1))
    tree.check()
    again = DraftTree.from_parents(tree.tokens, tree.parents, tree.num_nodes, tree.logprobs)
    assert torch.equal(again.depths, tree.depths)
    torch.testing.assert_close(again.scores, tree.scores)


class RecordingDrafter:
    """Wraps a drafter and checks every DraftStep against the slots it has already seen."""

    def __init__(self, inner):
        self.inner, self.hidden, self.ancestors, self.depth, self.steps = inner, {}, {}, {}, 0

    def __call__(self, step: DraftStep):
        assert step.step == self.steps
        self.steps += 1
        logits, hidden = self.inner(step)
        batch, n = step.tokens.shape
        assert step.ancestors.shape == (batch, n, int(step.slots.max()) + 1)
        for b in range(batch):
            for i in range(n):
                slot, parent = int(step.slots[b, i]), int(step.parent_slots[b, i])
                assert (b, slot) not in self.hidden, "each slot is fed once"
                if parent < 0:
                    want_anc, depth = {slot}, 0
                else:
                    torch.testing.assert_close(step.parent_hidden[b, i], self.hidden[(b, parent)])
                    want_anc, depth = self.ancestors[(b, parent)] | {slot}, self.depth[(b, parent)] + 1
                assert set(step.ancestors[b, i].nonzero().flatten().tolist()) == want_anc
                assert step.positions[b, i] == 10 * b + depth
                self.hidden[(b, slot)], self.ancestors[(b, slot)], self.depth[(b, slot)] = hidden[b, i], want_anc, depth
        return logits, hidden


def test_drafter_sees_consistent_slots_ancestors_positions_and_hidden():
    inner = PathHashDrafter(VOCAB, seed=4)
    roots = torch.tensor([7, 8, 9])
    recorder = RecordingDrafter(inner)
    tree = build_draft_tree(roots, torch.tensor([0, 10, 20]), recorder, 4, 3, 10, inner.root_hidden(roots))
    assert recorder.steps == 4 and len(recorder.hidden) == 3 * (1 + 3 * 3)
    # Handing over the root's draft output skips step 0 and changes nothing else.
    root_step = DraftStep(0, roots[:, None], torch.tensor([[0], [10], [20]]), torch.zeros(3, 1, dtype=torch.long),
                          torch.full((3, 1), -1), torch.ones(3, 1, 1, dtype=torch.bool),
                          inner.root_hidden(roots)[:, None])
    root_logits, root_hidden = inner(root_step)
    again = build_draft_tree(roots, torch.tensor([0, 10, 20]), inner, 4, 3, 10, root_draft=(root_logits, root_hidden))
    assert torch.equal(again.tokens, tree.tokens) and torch.equal(again.parents, tree.parents)
