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

import math
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
    fixed_shapes: bool = False,
) -> VerifyResult:
    """Stochastic verify of a batch with per-request sampling parameters.

    Args:
        tree: the draft trees (siblings are tried in node order).
        target_logits: ``[B, D, V]`` target logits at every node.
        params: per-request temperature / top-k / top-p / min-p (greedy rows allowed).
        generator: source of the coins when ``coins`` is None.
        coins: explicit coins (for reproduction and tests).
        fixed_shapes: process the target distributions without host synchronisation (``target_probs``), as a
            captured step must; otherwise the faster data-dependent paths (the same tokens kept).

    Loops over depth only (``D`` times), every request each time.
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
    rows = torch.arange(batch, device=device)
    current = torch.zeros(batch, dtype=torch.long, device=device)
    # One descent per depth, every request each time (fixed shapes, no host sync): a request that stopped stays
    # where it stopped, because the same node, distribution and coins reject the same children again.
    for _ in range(width):
        probs = target_probs(target_logits[rows, current], params, fixed_shapes=fixed_shapes)
        children = (tree.parents == current[:, None]) & valid
        mass = torch.where(children & ~repeats, probs.gather(1, tokens).double(), 0.0)
        mass_before = mass.cumsum(-1) - mass
        accept_prob = (mass / (1.0 - mass_before).clamp(min=1e-30)).clamp(0.0, 1.0)
        accepted = children & (coins.accept < accept_prob)
        current = torch.where(accepted.any(-1), accepted.int().argmax(-1), current)
    # Where the walk stopped every child was tried and rejected: the bonus comes from the residual there.
    bonus = _sample_residual(probs, tokens, children, coins.bonus)
    return VerifyResult.from_last_node(tree, current, bonus)


def _sample_residual(
    probs: torch.Tensor, tokens: torch.Tensor, rejected: torch.Tensor, coins: torch.Tensor
) -> torch.Tensor:
    """Inverse-CDF sample of ``probs`` with the rejected children's tokens removed, one coin per row."""
    n, vocab = probs.shape
    # Zero the rejected tokens; the other entries of ``tokens`` write into a spare column.
    residual = torch.cat([probs, probs.new_zeros(n, 1)], dim=1)
    residual.scatter_(1, torch.where(rejected, tokens, vocab), 0.0)
    residual = residual[:, :vocab]
    # Only rounding can empty the residual (the children held all the mass yet none was accepted): use p then.
    empty = residual.sum(-1) <= 0
    residual = torch.where(empty[:, None], probs, residual)
    return inverse_cdf(residual, coins)


def inverse_cdf(weights: torch.Tensor, coins: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """``[N]`` index ``i`` with ``cdf(i - 1) <= coin * total < cdf(i)`` for non-negative ``weights [N, V]``.

    Two levels (block sums, then inside one block; blocks of about sqrt(V) tokens by default) with float64 running
    sums, so the result is as precise as the float32 weights without a float64 copy of every row.
    """
    n, vocab = weights.shape
    block = block or max(1, math.isqrt(vocab))
    pad = (-vocab) % block
    blocks = torch.nn.functional.pad(weights, (0, pad)).view(n, -1, block)
    block_cdf = blocks.sum(-1).double().cumsum(-1)
    target = coins.double() * block_cdf[:, -1]
    b = torch.searchsorted(block_cdf, target[:, None], right=True).clamp(max=blocks.shape[1] - 1)
    before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp(min=0)), 0.0)
    inner = blocks[torch.arange(n, device=weights.device), b.squeeze(1)].double()
    inner_cdf = inner.cumsum(-1) + before
    j = torch.searchsorted(inner_cdf, target[:, None], right=True)
    # Rounding between the two levels may point just past the block: take its last token with weight.
    idx = torch.arange(block, device=weights.device)
    last = torch.where(inner > 0, idx, -1).amax(-1, keepdim=True)
    j = torch.minimum(j, last)
    return (b * block + j).squeeze(1)
