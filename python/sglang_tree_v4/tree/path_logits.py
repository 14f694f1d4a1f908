"""Each tree node's logits processed exactly as plain decoding processes them after that node's own path.

Plain decoding (SGLang 0.5.23's sampler with the forward copy of ``SamplingBatchInfo``) turns a request's raw logits
into the logits it samples from in this order:

1. additive penalties, summed into one tensor and added: ``-(F + P) + M``, with ``F[t]`` the frequency penalty
   added once per earlier output occurrence of ``t`` (a float32 running sum of equal addends), ``P[t]`` the presence
   penalty where ``t`` occurred, ``M`` = -inf on the stop tokens while the output is shorter than ``min_new_tokens``;
2. the repetition penalty where ``t`` occurred: ``x * r`` for negative logits, ``x / r`` otherwise;
3. the grammar's vocabulary mask (-inf where the grammar forbids the token);
4. ``logit_bias`` added.

"Output" is the request's whole output: its committed tokens and, for a tree node, the tokens on its path below the
root (the root is the last committed token). Every quantity is the one sequential decoding of that path would see,
so a node's processed logits equal plain decoding's bit for bit; a relaxed form (committed tokens only, as
upstream EAGLE does) is not exact.

Shapes stay fixed (no host reads): committed state is per request (``[B, V]``), a node's path adds at most ``P``
tokens, so the base penalties are broadcast to every node and only the ``P`` path columns of each node are
recomputed with their exact counts and scattered back. Grammar masks are built by the caller (on the host, from
the grammar objects) and handed in as a function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

ScalingFn = Callable[[torch.Tensor, torch.Tensor], None]
"""``scale(logits [N, V], factors [N, V])`` in place: ``x * f`` where ``x < 0``, else ``x / f``."""


def scale_in_place(logits: torch.Tensor, factors: torch.Tensor) -> None:
    """The repetition penalty's scaling (the torch reference; the server passes SGLang's own compiled one)."""
    logits.copy_(torch.where(logits < 0, logits * factors, logits / factors))


@dataclass
class PenaltyState:
    """What plain decoding's penalizers hold for each request of a batch after its committed output.

    Attributes:
        frequency, presence, repetition: ``[B]`` float32 the request's penalties (0, 0, 1 when unused).
        frequency_sums: ``[B, V]`` float32 ``frequency`` summed once per committed occurrence of each token.
        present: ``[B, V]`` bool, the token occurs in the committed output.
        output_lens: ``[B]`` int64 committed output tokens (the root included).
        min_new_tokens: ``[B]`` int64.
        stop_tokens: ``[B, V]`` bool, the tokens ``min_new_tokens`` holds back (stop ids, EOS ids).
        logit_bias: ``[B, V]`` float32 or None.
        uses: which of the stages any request of the batch uses (``"additive"``, ``"scaling"``, ``"min_new"``,
            ``"bias"``): a stage no request uses is skipped, as SGLang skips a penalizer nobody needs.
    """

    frequency: torch.Tensor
    presence: torch.Tensor
    repetition: torch.Tensor
    frequency_sums: torch.Tensor
    present: torch.Tensor
    output_lens: torch.Tensor
    min_new_tokens: torch.Tensor
    stop_tokens: torch.Tensor
    logit_bias: torch.Tensor | None
    uses: frozenset[str]

    @classmethod
    def from_outputs(cls, outputs: list[list[int]], vocab: int, *, frequency: list[float], presence: list[float],
                     repetition: list[float], min_new_tokens: list[int], stop_tokens: list[set[int]],
                     logit_bias: torch.Tensor | None = None, output_lens: list[int] | None = None,
                     device: torch.device | str = "cpu") -> "PenaltyState":
        """The state after each request's committed ``outputs`` (token lists, the root last). ``output_lens``:
        the outputs' lengths where ``outputs`` leaves out the tokens of requests without count-based penalties."""
        batch = len(outputs)
        f = torch.tensor(frequency, dtype=torch.float32, device=device)
        lens = torch.tensor([len(o) for o in outputs], dtype=torch.long, device=device)
        rows = torch.repeat_interleave(torch.arange(batch, device=device), lens)
        cols = torch.tensor([t for o in outputs for t in o], dtype=torch.long, device=device)
        sums = torch.zeros(batch, vocab, dtype=torch.float32, device=device)
        # Equal addends: the running sum is the same whatever order the occurrences are added in.
        sums.index_put_((rows, cols), f[rows], accumulate=True)
        present = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
        present[rows, cols] = True
        stops = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device)
        for b, ids in enumerate(stop_tokens):
            ids = [t if 0 <= t < vocab else vocab for t in ids]
            stops[b, ids] = True
        uses = set()
        if any(v != 0 for v in frequency) or any(v != 0 for v in presence):
            uses.add("additive")
        if any(v != 1 for v in repetition):
            uses.add("scaling")
        if any(v > 0 for v in min_new_tokens):
            uses.add("min_new")
        if logit_bias is not None:
            uses.add("bias")
        if output_lens is not None:
            lens = torch.tensor(output_lens, dtype=torch.long, device=device)
        return cls(f, torch.tensor(presence, dtype=torch.float32, device=device),
                   torch.tensor(repetition, dtype=torch.float32, device=device), sums, present, lens,
                   torch.tensor(min_new_tokens, dtype=torch.long, device=device), stops[:, :vocab],
                   None if logit_bias is None else logit_bias.float().to(device), frozenset(uses))


def process_path_logits(
    logits: torch.Tensor,
    paths: torch.Tensor,
    path_valid: torch.Tensor,
    state: PenaltyState | None,
    grammar_mask: Callable[[torch.Tensor], None] | None = None,
    scale: ScalingFn = scale_in_place,
) -> torch.Tensor:
    """Processes ``logits [B, n, V]`` in place (and returns them): node ``(b, i)`` continues request ``b`` after its
    committed output plus ``paths[b, i, j]`` for the ``j`` with ``path_valid[b, i, j]`` (``[B, n, P]``, the node's
    tokens below the root, any order). ``grammar_mask(logits [B * n, V])`` applies each node's grammar mask in
    place (stage 3); None: no grammar in the batch."""
    batch, n, vocab = logits.shape
    if state is not None and state.uses - {"bias"}:
        _penalties(logits, paths, path_valid, state, scale)
    if grammar_mask is not None:
        grammar_mask(logits.view(batch * n, vocab))
    if state is not None and state.logit_bias is not None:
        logits.add_(state.logit_bias[:, None, :])
    return logits


def _penalties(logits: torch.Tensor, paths: torch.Tensor, path_valid: torch.Tensor, state: PenaltyState,
               scale: ScalingFn) -> None:
    """Stages 1 and 2 for every node: the committed state broadcast over all columns, then each node's path columns
    recomputed from its exact counts (every column holding the same token gets the same value, so the scatter is
    deterministic)."""
    batch, n, vocab = logits.shape
    P = paths.shape[-1]
    paths = paths.long()
    depth = path_valid.sum(-1)  # [B, n]: the node's output tokens past the committed ones
    raw = logits.gather(-1, paths) if P else None
    held = None
    if "min_new" in state.uses:
        held = (state.output_lens[:, None] + depth) < state.min_new_tokens[:, None]  # [B, n]
    # Committed state, all columns.
    if "additive" in state.uses:
        committed = -state.frequency_sums - torch.where(state.present, state.presence[:, None], 0.0)
        logits.add_(committed[:, None, :])
    if held is not None:
        logits.masked_fill_(held[:, :, None] & state.stop_tokens[:, None, :], float("-inf"))
    if "scaling" in state.uses:
        factors = torch.where(state.present, state.repetition[:, None], 1.0)
        flat = logits.view(batch * n, vocab)
        scale(flat, factors.repeat_interleave(n, dim=0))
    if P == 0:
        return
    # The path columns: counts along the path added to the committed ones.
    same = (paths[..., :, None] == paths[..., None, :]) & path_valid[..., None, :]
    extra = same.sum(-1)  # [B, n, P]: valid path occurrences of each column's token
    rows = torch.arange(batch, device=logits.device)[:, None, None]
    present = state.present[rows, paths] | (extra > 0)
    vals = raw
    if "additive" in state.uses:
        f = state.frequency[:, None, None].expand(batch, n, P)
        sums = state.frequency_sums[rows, paths]
        for k in range(P):  # the same running sum of equal addends as one addition per occurrence
            sums = torch.where(extra > k, sums + f, sums)
        vals = vals + (-sums - torch.where(present, state.presence[:, None, None], 0.0))
    if held is not None:
        vals = vals.masked_fill(held[:, :, None] & state.stop_tokens[rows, paths], float("-inf"))
    if "scaling" in state.uses:
        factors = torch.where(present, state.repetition[:, None, None], 1.0)
        vals = vals.contiguous()
        scale(vals.view(batch * n, P), factors.reshape(batch * n, P))
    logits.scatter_(-1, paths, vals)


def tree_paths(tokens: torch.Tensor, ancestors: torch.Tensor,
               depths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(paths, valid)`` of every node of a tree batch for :func:`process_path_logits`: column ``j`` of node ``i``
    is node ``j``'s token, valid where ``j`` is an ancestor-or-self of ``i`` below the root (``[B, D, D]``)."""
    batch, width = tokens.shape
    paths = tokens[:, None, :].expand(batch, width, width)
    valid = ancestors & (depths > 0)[:, None, :]
    return paths, valid
