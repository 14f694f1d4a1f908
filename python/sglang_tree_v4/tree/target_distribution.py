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

Sorting a whole 129k vocabulary row is slow on a CPU, so the cutoff is found among the ``topk(cap)`` candidates of
growing caps, and a row falls back to a full sort only when no cap decides it (top-p mass not reached inside the
candidates, or a tie across the candidate boundary); every way keeps the same tokens.
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


def target_probs(
    logits: torch.Tensor, params: SamplingParams, candidate_caps: tuple[int, ...] = (64, 1024)
) -> torch.Tensor:
    """Processed target distribution of each row: ``logits [N, V]`` -> float32 ``[N, V]`` summing to 1.

    ``params`` has one entry per row. ``candidate_caps`` only tunes speed (how many top candidates are tried, in
    turn, before a row falls back to a full sort); the kept tokens do not depend on it.
    """
    vocab = logits.shape[1]
    greedy = params.is_greedy()
    temperatures = torch.where(greedy, 1.0, params.temperatures.float())
    probs = torch.softmax(logits.float() / temperatures[:, None], dim=-1)
    top_ks = torch.where((params.top_ks <= 0) | (params.top_ks > vocab), vocab, params.top_ks)
    cut = ~greedy & ((top_ks < vocab) | (params.top_ps < 1.0))
    if bool(cut.any()):
        rows = cut.nonzero().squeeze(1)
        probs[rows] = _top_k_top_p(probs[rows], top_ks[rows], params.top_ps[rows].float(), candidate_caps)
    min_p = ~greedy & (params.min_ps > 0)
    if bool(min_p.any()):
        rows = min_p.nonzero().squeeze(1)
        sub = probs[rows]
        sub = torch.where(sub >= params.min_ps[rows].float()[:, None] * sub.amax(-1, keepdim=True), sub, 0.0)
        probs[rows] = sub / sub.sum(-1, keepdim=True)
    if bool(greedy.any()):
        rows = greedy.nonzero().squeeze(1)
        probs[rows] = torch.zeros_like(probs[rows]).scatter_(1, logits[rows].argmax(-1, keepdim=True), 1.0)
    return probs


def _top_k_top_p(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, candidate_caps: tuple[int, ...]
) -> torch.Tensor:
    """Rows of ``probs`` restricted to their joint top-k / top-p cutoff and renormalised."""
    n, vocab = probs.shape
    out = torch.zeros_like(probs)
    pending = torch.arange(n, device=probs.device)
    for cap in candidate_caps:
        if cap >= vocab or pending.numel() == 0:
            break
        sub = probs[pending]
        values, tokens = sub.topk(cap + 1, dim=-1)
        # The top ``cap`` decide a row when the next token does not tie with the last of them, and either top-k
        # stops inside them or their mass already exceeds top_p (then every later token has more mass before it).
        no_tie = values[:, cap - 1] > values[:, cap]
        decided = no_tie & ((top_ks[pending] <= cap) | (values[:, :cap].sum(-1) > top_ps[pending]))
        done = decided.nonzero().squeeze(1)
        if done.numel() > 0:
            rows = pending[done]
            out[rows] = _keep_renormalised(sub[done], tokens[done, :cap], top_ks[rows], top_ps[rows])
        pending = pending[~decided]
    if pending.numel() > 0:
        sub = probs[pending]
        everything = torch.arange(vocab, device=probs.device).expand_as(sub)
        out[pending] = _keep_renormalised(sub, everything, top_ks[pending], top_ps[pending])
    return out


def _keep_renormalised(
    probs: torch.Tensor, candidates: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """Dense rows holding only the candidates inside the joint top-k / top-p cutoff, renormalised.

    ``candidates`` must contain each row's most probable tokens (any order); they are ranked by probability with
    ties by lower token id.
    """
    by_id = candidates.sort(dim=-1).values
    order = probs.gather(1, by_id).argsort(dim=-1, descending=True, stable=True)
    tokens = by_id.gather(1, order)
    sorted_probs = probs.gather(1, tokens)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    rank = torch.arange(tokens.shape[1], device=probs.device)[None, :]
    keep = (rank < top_ks[:, None]) & ((mass_before <= top_ps[:, None]) | (top_ps[:, None] >= 1.0))
    kept = torch.where(keep, sorted_probs, 0.0)
    return torch.zeros_like(probs).scatter_(1, tokens, kept / kept.sum(-1, keepdim=True))
