"""Lossless stochastic verification of draft trees (multi-branch speculative sampling with deterministic drafts).

Walk from the root. At the current node, with processed target distribution ``p`` (see target_distribution.py) and
children ``c_1 .. c_m`` in node order, try the children one after another: accept ``c_i`` with probability
``r_i(c_i)``, where ``r_1 = p`` and ``r_{i+1}`` is ``r_i`` with ``c_i``'s token zeroed and renormalised. Because the
draft proposes each token deterministically, this is SpecInfer's rejection step with ``q = one-hot``: the token
leaving the node is distributed exactly as ``p`` (accepted child ``c_i`` with probability ``p(c_i)``; otherwise a
bonus sampled from ``p`` without the children's tokens). On acceptance the walk descends into the child, whose
target distribution is, by construction of the verify pass, the target's next-token distribution after that token.
So the emitted sequence has the target's sequential sampling distribution.

Closed form used for the batch: with distinct tokens, ``r_i(c_i) = p(c_i) / (1 - sum_{j < i} p(c_j))``; a sibling
repeating an earlier sibling's token has ``r_i(c_i) = 0``. Greedy requests have one-hot ``p`` and therefore follow
greedy verification in the same batch.

Randomness: one uniform coin per node (used when the node is tried as a child: accepted iff ``coin < r_i(c_i)``) and
one per request for the bonus (inverse CDF over token ids in increasing order). Coins come from ``generator`` unless
given explicitly, which makes a step reproducible and lets tests enumerate outcomes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .draft_tree import DraftTree
from .target_distribution import SamplingParams, target_probs
from .verify_result import VerifyResult


@dataclass
class VerifyCoins:
    """Uniform [0, 1) random numbers of one verify step.

    Attributes:
        accept: ``[B, D]`` float, ``accept[b, j]`` decides node j when its parent is visited.
        bonus: ``[B]`` float, samples the bonus token from the residual distribution.
    """

    accept: torch.Tensor
    bonus: torch.Tensor

    @classmethod
    def draw(cls, batch: int, width: int, generator: torch.Generator | None = None, device=None) -> "VerifyCoins":
        """Fresh coins from ``generator`` (its device decides where they are drawn)."""
        gen_device = generator.device if generator is not None else device
        accept = torch.rand(batch, width, generator=generator, device=gen_device, dtype=torch.float64)
        bonus = torch.rand(batch, generator=generator, device=gen_device, dtype=torch.float64)
        return cls(accept.to(device), bonus.to(device))


def verify_sampling(
    tree: DraftTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    coins: VerifyCoins | None = None,
) -> VerifyResult:
    """Stochastic verify of a batch with per-request sampling parameters.

    Args:
        tree: the draft trees (siblings are tried in node order).
        target_logits: ``[B, D, V]`` target logits at every node.
        params: per-request temperature / top-k / top-p / min-p (greedy rows allowed).
        generator: source of the coins when ``coins`` is None.
        coins: explicit coins (for reproduction and tests).

    Loops over depth only; each iteration processes the target distribution of the still-descending requests.
    """
    batch, width, _ = target_logits.shape
    device = target_logits.device
    if coins is None:
        coins = VerifyCoins.draw(batch, width, generator, device)
    valid = tree.valid_mask()
    tokens = tree.tokens
    idx = torch.arange(width, device=device)
    # repeats[b, j]: an earlier sibling of j carries the same token (its mass is already gone from the residual).
    same = (tokens[:, :, None] == tokens[:, None, :]) & (tree.parents[:, :, None] == tree.parents[:, None, :])
    repeats = (same & (idx[None, :] < idx[:, None])).any(-1)

    current = torch.zeros(batch, dtype=torch.long, device=device)
    bonus = torch.zeros(batch, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)  # requests still descending
    while rows.numel() > 0:
        node = current[rows]
        probs = target_probs(target_logits[rows, node], params.select(rows))
        children = (tree.parents[rows] == node[:, None]) & valid[rows]
        row_tokens = tokens[rows]
        mass = torch.where(children & ~repeats[rows], probs.gather(1, row_tokens).double(), 0.0)
        mass_before = mass.cumsum(-1) - mass
        accept_prob = (mass / (1.0 - mass_before).clamp(min=1e-30)).clamp(0.0, 1.0)
        accepted = children & (coins.accept[rows] < accept_prob)
        has_child = accepted.any(-1)
        first = accepted.int().argmax(-1)
        current[rows] = torch.where(has_child, first, node)
        done = ~has_child
        if bool(done.any()):
            done_rows = done.nonzero().squeeze(1)
            bonus[rows[done_rows]] = _sample_residual(
                probs[done_rows], row_tokens[done_rows], children[done_rows], coins.bonus[rows[done_rows]]
            )
        rows = rows[has_child]
    return VerifyResult.from_last_node(tree, current, bonus)


def _sample_residual(
    probs: torch.Tensor, tokens: torch.Tensor, rejected: torch.Tensor, coins: torch.Tensor
) -> torch.Tensor:
    """Inverse-CDF sample of ``probs`` with the rejected children's tokens removed, one coin per row."""
    removed = torch.zeros_like(probs).scatter_add_(1, tokens, rejected.to(probs.dtype)) > 0
    residual = torch.where(removed, 0.0, probs).double()
    total = residual.sum(-1, keepdim=True)
    # Only rounding can empty the residual (the children held all the mass yet none was accepted): use p then.
    residual = torch.where(total > 0, residual, probs.double())
    cdf = residual.cumsum(-1)
    threshold = coins.double()[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, threshold, right=True).squeeze(1).clamp(max=probs.shape[1] - 1)
