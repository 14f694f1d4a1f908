"""Grammar masks per tree node (``speculative.grammar_paths``) with toy grammars of SGLang's grammar-object API.

Each node's mask must be the grammar's mask in the state after the tokens the scheduler has not processed
(``pending``) and the node's own path, for backends with ``rollback`` and for backends with only a saved state (as
outlines); nodes the grammar cannot reach stay unconstrained; the grammar ends in the state it started in.
Negative control: the root's mask for every node (masks from the committed state only) differs. Drafting under the
grammar (``build_draft_tree`` with the rules' hook) proposes only allowed tokens.
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject

from sglang_tree_v4.speculative.grammar_paths import GrammarPaths
from sglang_tree_v4.tree import DraftTree, build_draft_tree
from sglang_tree_v4.tree.path_logits import tree_paths
from sglang_tree_v4.tree.synthetic import PathHashDrafter

VOCAB = 10
END = 9


def allowed_after(history: tuple[int, ...]) -> list[bool]:
    """The toy language: after a history, token t is allowed iff (t + sum(history)) % 3 != 0; END only after 5
    tokens; terminated after END."""
    s = sum(history)
    return [((t + s) % 3 != 0) and (t != END or len(history) >= 5) for t in range(VOCAB)]


class ToyGrammar(BaseGrammarObject):
    """Accept / rollback like xgrammar's matcher; masks as outlines' (bool, True = forbidden)."""

    def __init__(self, history=()):
        super().__init__()
        self.history = list(history)

    def accept_token(self, token: int) -> None:
        if self.is_terminated() or not allowed_after(tuple(self.history))[token]:
            raise ValueError(f"Tokens not accepted: {token}")
        self.history.append(token)

    def rollback(self, k: int) -> None:
        del self.history[len(self.history) - k:]

    def is_terminated(self) -> bool:
        return bool(self.history) and self.history[-1] == END

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device) -> torch.Tensor:
        return torch.zeros(batch_size, vocab_size, dtype=torch.bool, device=device)

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        vocab_mask[idx] = ~torch.tensor(allowed_after(tuple(self.history)))

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device) -> torch.Tensor:
        return vocab_mask.to(device)

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        logits.masked_fill_(vocab_mask, float("-inf"))


class StateOnlyGrammar(ToyGrammar):
    """No rollback, a ``state`` attribute instead (outlines' object)."""

    rollback = BaseGrammarObject.rollback

    @property
    def state(self):
        return tuple(self.history)

    @state.setter
    def state(self, value):
        self.history = list(value)


def _tree(seed: int) -> DraftTree:
    gen = torch.Generator().manual_seed(seed)
    width = 9
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, width)]
    tokens = torch.randint(0, VOCAB, (2, width), generator=gen)
    return DraftTree.from_parents(tokens, torch.tensor([parents, parents]))


def _want(history: list[int], path: list[int]) -> torch.Tensor:
    """The oracle row: the grammar's allowed set after history + path, or unconstrained if it cannot get there."""
    h = tuple(history)
    for t in path:
        if h and h[-1] == END or not allowed_after(h)[t]:
            return torch.ones(VOCAB, dtype=torch.bool)
        h = h + (t,)
    if h and h[-1] == END:
        return torch.ones(VOCAB, dtype=torch.bool)
    return torch.tensor(allowed_after(h))


@pytest.mark.parametrize("kind", [ToyGrammar, StateOnlyGrammar])
@pytest.mark.parametrize("seed", range(5))
def test_each_node_masked_after_its_path(kind, seed):
    _check_tree(kind, seed)


def _check_tree(kind, seed: int) -> int:
    """Checks every node's mask and terminal mark; returns how many nodes terminate the grammar."""
    tree = _tree(seed)
    committed = [[1, 3, 4, 1, 1], [2]]
    pending = [[], [5, 3]]
    grammars = [kind(committed[0]), kind(committed[1])]
    rows = [(b, grammars[b], pending[b]) for b in range(2)]
    paths, valid = tree_paths(tree.tokens, tree.ancestor_mask(), tree.depths)
    logits = torch.zeros(2 * tree.width, VOCAB)
    walk = GrammarPaths(rows, VOCAB)
    walk.mask_fn(paths, valid)(logits)
    got = torch.isfinite(logits).view(2, tree.width, VOCAB)
    node_path = tree.path_nodes(tree.width - 1)
    reached = terminal = 0
    for b in range(2):
        assert grammars[b].history == committed[b]  # everything rolled back
        for i in range(tree.width):
            path = [int(tree.tokens[b, j]) for j in node_path[b, i, 1:].tolist() if j >= 0]
            want = _want(committed[b] + pending[b], path)
            assert torch.equal(got[b, i], want), (b, i, path)
            reached += not bool(want.all())
            before = _want(committed[b] + pending[b], path[:-1])  # all True: unreachable
            ends = bool(path) and path[-1] == END and bool(before[END]) and not bool(before.all())
            assert bool(walk.terminal[b, i]) == ends, (b, i, path)
            terminal += ends
    assert reached > 4
    return terminal


def test_root_mask_everywhere_differs():
    """Negative control: the committed state's mask applied to every node."""
    differing = 0
    for seed in range(5):
        tree = _tree(seed)
        paths, valid = tree_paths(tree.tokens, tree.ancestor_mask(), tree.depths)
        logits = torch.zeros(2 * tree.width, VOCAB)
        GrammarPaths([(b, ToyGrammar([1, 3, 4]), []) for b in range(2)], VOCAB).mask_fn(
            paths, torch.zeros_like(valid))(logits)
        got = torch.isfinite(logits).view(2, tree.width, VOCAB)
        node_path = tree.path_nodes(tree.width - 1)
        for i in range(tree.width):
            path = [int(tree.tokens[0, j]) for j in node_path[0, i, 1:].tolist() if j >= 0]
            differing += not torch.equal(got[0, i], _want([1, 3, 4], path))
    assert differing > 5


def test_drafts_only_allowed_tokens():
    """A tree drafted with the grammar's hook holds only tokens the grammar allows after their parent's path."""
    from sglang_tree_v4.speculative.sampling_rules import SamplingRules

    grammar = ToyGrammar([2, 2])
    rules = SamplingRules(None, GrammarPaths([(0, grammar, [])], VOCAB))
    drafter = PathHashDrafter(VOCAB, seed=3)
    roots = torch.tensor([2])
    for hook in (rules.draft_hook, None):
        tree = build_draft_tree(roots, torch.tensor([5]), drafter, 3, 3, 10,
                                root_parent_hidden=drafter.root_hidden(roots), logits_hook=hook)
        node_path = tree.path_nodes(tree.width - 1)
        bad = 0
        for i in range(1, int(tree.num_nodes[0])):
            path = [int(tree.tokens[0, j]) for j in node_path[0, i, 1:].tolist() if j >= 0]
            bad += not bool(_want([2, 2], path[:-1])[path[-1]])
        assert (bad == 0) if hook is not None else (bad > 0)  # without the hook (control) it drafts forbidden ones
    assert grammar.history == [2, 2]


def test_some_nodes_terminate():
    """The trees above do reach the grammar's end somewhere (so the terminal marks are exercised)."""
    assert sum(_check_tree(ToyGrammar, seed) for seed in range(12)) > 0
