"""Grammar vocabulary masks for tree nodes: the mask plain decoding would apply after each node's own path.

A request's grammar object (SGLang's, any backend) is in the state after the request's tokens the scheduler has
processed. A round may start before the previous round's tokens reach it (overlap scheduling: the ``pending``
tokens), so every walk first accepts those, then each node's path below the root; it fills the node's mask row and
rolls everything back. Paths are walked as a trie (each prefix's state visited once), and a token the previous
state forbids is never fed to the grammar (some backends cannot recover from a rejected token): such a node can
never be accepted, so its row, and its subtree's rows, stay unconstrained.

Masks are written in the backend's own format (``allocate_vocab_mask`` / ``fill_vocab_mask``) and applied with its
own ``apply_vocab_mask``, as SGLang's sampler applies them.
"""

from __future__ import annotations

from typing import Callable

import torch
from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject


class _Cursor:
    """Accept and undo tokens on one grammar object: ``rollback`` where the backend has it, else a saved ``state``
    (outlines' guide state is a plain integer and its object has no rollback)."""

    def __init__(self, grammar):
        self.grammar = grammar
        self.has_rollback = type(grammar).rollback is not BaseGrammarObject.rollback
        if not self.has_rollback and not hasattr(grammar, "state"):
            raise NotImplementedError(f"grammar backend {type(grammar).__name__} cannot roll back")
        self.saved: list = []

    def accept(self, token: int) -> None:
        if not self.has_rollback:
            self.saved.append(self.grammar.state)
        self.grammar.accept_token(token)

    def undo(self, k: int) -> None:
        if k <= 0:
            return
        if self.has_rollback:
            self.grammar.rollback(k)
        else:
            self.grammar.state = self.saved[-k]
            del self.saved[-k:]


def allowed_tokens(grammar, mask_rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[N, vocab]`` bool of mask rows in the backend's format: applied to zeros, what stays finite is allowed."""
    probe = torch.zeros(mask_rows.shape[0], vocab, dtype=torch.float32)
    grammar.apply_vocab_mask(logits=probe, vocab_mask=mask_rows)
    return torch.isfinite(probe)


class GrammarPaths:
    """The grammar rows of one round's batch: request index, grammar object, tokens the grammar has not seen."""

    def __init__(self, rows: list[tuple[int, object, list[int]]], vocab: int):
        self.rows = rows
        self.vocab = vocab
        self.handle = rows[0][1]  # any of the batch's grammars: allocation and application are per backend

    def mask_fn(self, paths: torch.Tensor, valid: torch.Tensor) -> Callable[[torch.Tensor], None]:
        """The in-place masking of ``logits [B * n, V]`` for nodes whose paths below the root are the valid
        columns of ``paths [B, n, P]`` (in path order). Also sets ``terminal [B, n]``: the node's own token
        terminates the grammar (plain decoding ends the request there)."""
        batch, n, _ = paths.shape
        mask = self.handle.allocate_vocab_mask(vocab_size=self.vocab, batch_size=batch * n, device="cpu")
        self.terminal = torch.zeros(batch * n, dtype=torch.bool)
        paths_host, valid_host = paths.tolist(), valid.tolist()
        for b, grammar, pending in self.rows:
            rows = zip(paths_host[b], valid_host[b], strict=True)
            node_paths = [[t for t, ok in zip(p, v, strict=True) if ok] for p, v in rows]
            self._fill(grammar, pending, node_paths, mask, b * n)
        self.terminal = self.terminal.view(batch, n).to(paths.device)

        def apply(logits: torch.Tensor) -> None:
            self.handle.apply_vocab_mask(logits=logits, vocab_mask=self.handle.move_vocab_mask(mask, logits.device))

        return apply

    def _fill(self, grammar, pending: list[int], node_paths: list[list[int]], mask: torch.Tensor, first: int) -> None:
        """Writes rows ``first + i`` for the nodes whose path is ``node_paths[i]``: the state after ``pending`` and
        the path, where the grammar allows every token of it and has not terminated before its end."""
        cursor = _Cursor(grammar)
        accepted = 0
        try:
            for t in pending:
                if grammar.is_terminated():
                    return
                cursor.accept(t)
                accepted += 1
        except ValueError:
            return  # the scheduler will find the same and end the request
        try:
            trie: dict = {}
            for i, path in enumerate(node_paths):
                node = trie
                for t in path:
                    node = node.setdefault(t, {})
                node.setdefault(None, []).append(first + i)
            self._walk(cursor, trie, mask)
        finally:
            cursor.undo(accepted)

    def _walk(self, cursor: _Cursor, node: dict, mask: torch.Tensor) -> None:
        """Fills the rows ending at this trie node, then visits the children the state allows."""
        grammar = cursor.grammar
        if grammar.is_terminated():
            self.terminal[node.get(None, [])] = True
            return  # plain decoding stops here: nothing after this node is ever committed
        scratch = grammar.allocate_vocab_mask(vocab_size=self.vocab, batch_size=1, device="cpu")
        grammar.fill_vocab_mask(scratch, 0)
        for row in node.get(None, []):
            mask[row] = scratch[0]
        children = [t for t in node if t is not None]
        if not children:
            return
        allowed = allowed_tokens(grammar, scratch, self.vocab)[0]
        for t in children:
            if not (0 <= t < self.vocab and bool(allowed[t])):
                continue  # unreachable under the grammar: rows left unconstrained
            cursor.accept(t)
            try:
                self._walk(cursor, node[t], mask)
            finally:
                cursor.undo(1)


def grammar_paths(reqs, pending: list[list[int]], vocab: int) -> GrammarPaths | None:
    """The batch's grammar rows, or None where no running request has a grammar."""
    rows = [(b, req.grammar, list(p)) for b, (req, p) in enumerate(zip(reqs, pending, strict=False))
            if getattr(req, "grammar", None) is not None and not req.finished()]
    return GrammarPaths(rows, vocab) if rows else None
