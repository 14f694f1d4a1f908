"""The target's sampling distribution per request, processed the way SGLang's sampler processes it.

Lossless verification must reproduce the distribution that non-speculative decoding samples from, so the processing
follows SGLang 0.5.23's sampler (``Sampler`` with the torch backend, equal to FlashInfer's ``joint`` top-k/top-p):

1. ``probs = softmax(logits / temperature)`` in float32;
2. top-k and top-p are applied *jointly* on those probs: sort descending, keep rank r iff ``r < top_k`` and the
   probability mass strictly before rank r is ``<= top_p`` (so rank 0 is always kept; ``top_p = 1`` keeps every
   token, where SGLang's float32 cumulative sum can drop a far tail once it rounds past 1);
3. min-p: drop every token with ``prob < min_p * max_prob``;
4. renormalise.

Greedy requests (``temperature <= 1e-6`` or ``top_k == 1``, which SGLang maps to each other) get a one-hot at the
first argmax of the raw logits. Ties at a top-k / top-p cutoff are broken by lower token id (SGLang's sort leaves
them unspecified; for continuous logits they do not occur).

Sorting a whole 129k vocabulary row is slow on a CPU, so the cutoff is found on ``topk(cap)`` candidates and a row
falls back to a full sort only when the candidates cannot decide it (top-p mass not reached inside the candidates,
or a tie across the candidate boundary), so both ways keep the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_TEMPERATURE = 1e-6
"""Temperatures at or below this are greedy (SGLang uses the same epsilon)."""


@dataclass
class SamplingParams:
    """Per-request sampling parameters, one entry per request.

    Attributes:
        temperatures: ``[B]`` float; ``<= 1e-6`` means greedy.
        top_ks: ``[B]`` int64; ``<= 0`` or ``>= vocab`` means no top-k (SGLang's -1 / ``1 << 30``); 1 means greedy.
        top_ps: ``[B]`` float in (0, 1]; 1 disables top-p.
        min_ps: ``[B]`` float in [0, 1]; 0 disables min-p.
    """

    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor

    @classmethod
    def uniform(
        cls,
        batch: int,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        min_p: float = 0.0,
        device: torch.device | str = "cpu",
    ) -> "SamplingParams":
        """The same parameters for every request of a batch."""
        return cls(
            torch.full((batch,), float(temperature), device=device),
            torch.full((batch,), int(top_k), dtype=torch.long, device=device),
            torch.full((batch,), float(top_p), device=device),
            torch.full((batch,), float(min_p), device=device),
        )

    def select(self, rows: torch.Tensor) -> "SamplingParams":
        """The parameters of the given request rows."""
        return SamplingParams(self.temperatures[rows], self.top_ks[rows], self.top_ps[rows], self.min_ps[rows])

    def is_greedy(self) -> torch.Tensor:
        """``[B]`` bool: requests decoded greedily."""
        return (self.temperatures <= GREEDY_TEMPERATURE) | (self.top_ks == 1)


def target_probs(logits: torch.Tensor, params: SamplingParams, candidate_cap: int = 1024) -> torch.Tensor:
    """Processed target distribution of each row: ``logits [N, V]`` -> float32 ``[N, V]`` summing to 1.

    ``params`` has one entry per row. ``candidate_cap`` only tunes speed (how many top candidates are tried before
    a row falls back to a full sort); the output does not depend on it.
    """
    n, vocab = logits.shape
    probs = torch.empty(n, vocab, dtype=torch.float32, device=logits.device)
    greedy = params.is_greedy()
    greedy_rows = greedy.nonzero().squeeze(1)
    sample_rows = (~greedy).nonzero().squeeze(1)
    if greedy_rows.numel() > 0:
        probs[greedy_rows] = 0.0
        probs[greedy_rows] = probs[greedy_rows].scatter(1, logits[greedy_rows].argmax(-1, keepdim=True), 1.0)
    if sample_rows.numel() > 0:
        probs[sample_rows] = _sampled_probs(logits[sample_rows], params.select(sample_rows), candidate_cap)
    return probs


def _sampled_probs(logits: torch.Tensor, params: SamplingParams, candidate_cap: int) -> torch.Tensor:
    vocab = logits.shape[1]
    probs = torch.softmax(logits.float() / params.temperatures.float()[:, None], dim=-1)
    top_ks = torch.where((params.top_ks <= 0) | (params.top_ks > vocab), vocab, params.top_ks)
    keep = torch.ones_like(probs, dtype=torch.bool)
    cut_rows = ((top_ks < vocab) | (params.top_ps < 1.0)).nonzero().squeeze(1)
    if cut_rows.numel() > 0:
        keep[cut_rows] = _top_k_top_p_keep(probs[cut_rows], top_ks[cut_rows], params.top_ps[cut_rows], candidate_cap)
    max_prob = probs.amax(-1, keepdim=True)
    keep &= probs >= params.min_ps.float()[:, None] * max_prob
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def _top_k_top_p_keep(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, candidate_cap: int
) -> torch.Tensor:
    """``[N, V]`` bool: tokens inside the joint top-k / top-p cutoff of each row."""
    n, vocab = probs.shape
    keep = torch.zeros_like(probs, dtype=torch.bool)
    cap = min(vocab, max(candidate_cap, int(top_ks[top_ps >= 1.0].max()) if bool((top_ps >= 1.0).any()) else 0))
    if cap < vocab:
        values, _ = probs.topk(cap, dim=-1)
        boundary = values[:, -1:]
        # The candidates decide a row when no token outside them ties with the last one, and either top-k stops
        # inside them or their whole mass already exceeds top_p (then nothing later is kept).
        no_tie = (probs >= boundary).sum(-1) == cap
        decided = no_tie & ((top_ks <= cap) | (values.sum(-1) > top_ps))
        fast = decided.nonzero().squeeze(1)
        slow = (~decided).nonzero().squeeze(1)
    else:
        fast = torch.empty(0, dtype=torch.long, device=probs.device)
        slow = torch.arange(n, device=probs.device)
    if fast.numel() > 0:
        sub = probs[fast]
        tokens, flags = _cutoff(sub, sub.topk(cap, dim=-1).indices, top_ks[fast], top_ps[fast])
        keep[fast] = keep[fast].scatter(1, tokens, flags)
    if slow.numel() > 0:
        sub = probs[slow]
        everything = torch.arange(vocab, device=probs.device).expand_as(sub)
        tokens, flags = _cutoff(sub, everything, top_ks[slow], top_ps[slow])
        keep[slow] = keep[slow].scatter(1, tokens, flags)
    return keep


def _cutoff(
    probs: torch.Tensor, candidates: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint top-k / top-p over ``candidates`` (a set holding each row's most probable tokens, any order).

    Returns ``(tokens, keep)``: the candidates in descending-probability order with ties by lower token id, and
    whether each is inside the cutoff.
    """
    by_id = candidates.sort(dim=-1).values
    order = probs.gather(1, by_id).argsort(dim=-1, descending=True, stable=True)
    tokens = by_id.gather(1, order)
    sorted_probs = probs.gather(1, tokens)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    rank = torch.arange(tokens.shape[1], device=probs.device)[None, :]
    keep = (rank < top_ks[:, None]) & ((mass_before <= top_ps.float()[:, None]) | (top_ps[:, None] >= 1.0))
    return tokens, keep
