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

Other SGLang paths differ and are not followed: its FlashInfer sampler, when min-p is active, renormalises after
top-k before applying top-p, and its EAGLE verifier applies top-k then top-p sequentially and ignores min-p.

Sorting a whole 129k vocabulary row is slow on a CPU, so the cutoff is found among the ``topk(cap)`` candidates of
growing caps; rows no cap decides (top-p mass not reached inside the candidates, or a tie across the candidate
boundary) and without top-k go, for large vocabularies, through probability buckets (only the bucket where the mass
crosses top_p is
ranked), and only what remains is fully sorted. Every way keeps the same tokens, up to float rounding of the
running mass right at the cutoff.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_TEMPERATURE = 1e-6
"""Temperatures at or below this are greedy (SGLang uses the same epsilon)."""

BUCKETS_FROM_VOCAB = 16384
"""Vocabularies at least this large use probability buckets for top-p; smaller rows are cheaper to sort."""


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
    logits: torch.Tensor, params: SamplingParams, candidate_caps: tuple[int, ...] = (64, 1024),
    fixed_shapes: bool = False,
) -> torch.Tensor:
    """Processed target distribution of each row: ``logits [N, V]`` -> float32 ``[N, V]`` summing to 1.

    ``params`` has one entry per row. ``candidate_caps`` only tunes speed (how many top candidates are tried, in
    turn, before the slower paths); the kept tokens do not depend on it. ``fixed_shapes``: every row through one
    full sort and masks, no host synchronisation (a captured step); the same tokens are kept.
    """
    n, vocab = logits.shape
    greedy = params.is_greedy()
    temperatures = torch.where(greedy, 1.0, params.temperatures.float())
    probs = torch.softmax(logits.float() / temperatures[:, None], dim=-1)
    top_ks = torch.where((params.top_ks <= 0) | (params.top_ks > vocab), vocab, params.top_ks)
    cut = ~greedy & ((top_ks < vocab) | (params.top_ps < 1.0))
    if fixed_shapes:
        return _target_probs_fixed(logits, probs, greedy, cut, top_ks, params)
    if bool(cut.any()):
        rows = cut.nonzero().squeeze(1)
        if rows.numel() == n:
            probs = _top_k_top_p(probs, top_ks, params.top_ps.float(), candidate_caps)
        else:
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


def _target_probs_fixed(logits: torch.Tensor, probs: torch.Tensor, greedy: torch.Tensor, cut: torch.Tensor,
                        top_ks: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``target_probs`` with every row processed alike: one stable descending sort (ties by token id), the joint
    cutoff, min-p and the greedy one-hot chosen per row by masks."""
    values, tokens = probs.sort(dim=-1, descending=True, stable=True)
    cutoff = torch.zeros_like(probs)
    _scatter_cutoff(cutoff, torch.arange(probs.shape[0], device=probs.device), values, tokens, top_ks,
                    params.top_ps.float())
    probs = torch.where(cut[:, None], cutoff, probs)
    min_p = params.min_ps.float()[:, None]
    floor = torch.where(probs >= min_p * probs.amax(-1, keepdim=True), probs, 0.0)
    probs = torch.where((~greedy & (params.min_ps > 0))[:, None], floor / floor.sum(-1, keepdim=True), probs)
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def _top_k_top_p(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, candidate_caps: tuple[int, ...]
) -> torch.Tensor:
    """Rows of ``probs`` restricted to their joint top-k / top-p cutoff and renormalised (a new tensor)."""
    n, vocab = probs.shape
    out = torch.zeros_like(probs)
    pending = torch.arange(n, device=probs.device)
    for cap in candidate_caps:
        if cap >= vocab or pending.numel() == 0:
            break
        sub = probs if pending.numel() == n else probs[pending]
        values, tokens = sub.topk(cap + 1, dim=-1)
        # The top ``cap`` decide a row when the next token does not tie with the last of them, and either top-k
        # stops inside them or their mass already exceeds top_p (then every later token has more mass before it).
        no_tie = values[:, cap - 1] > values[:, cap]
        decided = no_tie & ((top_ks[pending] <= cap) | (values[:, :cap].sum(-1) > top_ps[pending]))
        done = decided.nonzero().squeeze(1)
        if done.numel() > 0:
            rows = pending[done]
            # topk leaves the order of equal values open: put ties in token-id order first.
            by_id = tokens[done, :cap].sort(dim=-1).values
            values = probs[rows[:, None], by_id]
            order = values.argsort(dim=-1, descending=True, stable=True)
            _scatter_cutoff(out, rows, values.gather(1, order), by_id.gather(1, order), top_ks[rows], top_ps[rows])
        pending = pending[~decided]
    top_p_only = top_ks[pending] >= vocab
    if vocab >= BUCKETS_FROM_VOCAB and bool(top_p_only.any()):
        rows = pending[top_p_only]
        solved = _top_p_by_buckets(out, probs, rows, top_ps[rows])
        pending = torch.cat([pending[~top_p_only], rows[~solved]])
    if pending.numel() > 0:
        sub = probs if pending.numel() == n else probs[pending]
        values, tokens = sub.sort(dim=-1, descending=True, stable=True)  # stable: ties stay in token-id order
        _scatter_cutoff(out, pending, values, tokens, top_ks[pending], top_ps[pending])
    return out


def _top_p_by_buckets(
    out: torch.Tensor,
    probs: torch.Tensor,
    rows: torch.Tensor,
    top_ps: torch.Tensor,
    shift: int = 16,
    num_buckets: int = 4096,
    max_boundary: int = 4096,
) -> torch.Tensor:
    """Top-p without sorting the vocabulary; writes the solved rows into ``out`` and returns which rows it solved.

    Tokens are bucketed by the float32 bits of their probability (order-preserving for non-negative floats; with
    ``shift = 16`` a bucket spans 1/128 of an octave, the last bucket holds everything 2^-32 below the maximum).
    Whole buckets are kept while the running mass stays within top_p; only the bucket where it crosses top_p is
    ranked exactly. Rows whose crossing bucket holds more than ``max_boundary`` tokens are left to the caller.
    """
    sub = probs[rows]
    bits = sub.view(torch.int32)
    bucket = ((bits.amax(-1, keepdim=True) - bits) >> shift).clamp_(max=num_buckets - 1).long()
    mass = torch.zeros(len(rows), num_buckets, device=probs.device).scatter_add_(1, bucket, sub)
    count = torch.zeros_like(mass).scatter_add_(1, bucket, torch.ones_like(sub))
    running = mass.double().cumsum(-1)
    crossing = torch.searchsorted(running, top_ps.double()[:, None], right=True).clamp_(max=num_buckets - 1)
    mass_before_bucket = torch.where(crossing > 0, running.gather(1, (crossing - 1).clamp(min=0)), 0.0)
    size = count.gather(1, crossing).squeeze(1).long()
    solved = size <= max_boundary
    k = int(size[solved].max()) if bool(solved.any()) else 0
    if k == 0:
        return solved
    done = solved.nonzero().squeeze(1)
    sub, bucket, crossing = sub[done], bucket[done], crossing[done]
    # Rank the crossing bucket exactly (descending, ties by token id; padding entries point at a spare column).
    vocab = probs.shape[1]
    values, tokens = torch.where(bucket == crossing, sub, -1.0).topk(k, dim=-1)
    by_id = torch.where(values >= 0, tokens, vocab).sort(dim=-1).values
    real = by_id < vocab
    values = torch.where(real, sub.gather(1, by_id.clamp(max=vocab - 1)), -1.0)
    order = values.argsort(dim=-1, descending=True, stable=True)
    values, by_id, real = values.gather(1, order), by_id.gather(1, order), real.gather(1, order)
    mass = values.clamp(min=0).double()
    before = mass_before_bucket[done] + mass.cumsum(-1) - mass
    keep_crossing = real & (before <= top_ps[done].double()[:, None])
    kept = torch.cat([torch.where(bucket < crossing, sub, 0.0), sub.new_zeros(len(done), 1)], dim=1)
    kept.scatter_(1, by_id, torch.where(keep_crossing, values, 0.0))
    kept = kept[:, :vocab]
    out[rows[done]] = kept / kept.sum(-1, keepdim=True)
    return solved


def _scatter_cutoff(
    out: torch.Tensor,
    rows: torch.Tensor,
    values: torch.Tensor,
    tokens: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
) -> None:
    """Writes into ``out[rows]`` the renormalised probabilities of the tokens inside the joint top-k / top-p cutoff.

    ``values``/``tokens`` are each row's most probable tokens in final rank order (descending, ties by token id).
    """
    mass_before = values.cumsum(-1) - values
    rank = torch.arange(tokens.shape[1], device=values.device)[None, :]
    keep = (rank < top_ks[:, None]) & ((mass_before <= top_ps[:, None]) | (top_ps[:, None] >= 1.0))
    kept = torch.where(keep, values, 0.0)
    out[rows[:, None], tokens] = kept / kept.sum(-1, keepdim=True)
