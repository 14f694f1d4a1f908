"""What speculating costs a batch outside its own rounds: requests that would have finished together no longer do.

Without speculation a request with ``r`` tokens left finishes in exactly ``r`` rounds, so requests that started
together with the same budget finish in the same round, and the next ones are prefilled together. With a tree of
``mu`` tokens per round on average (standard deviation ``sigma`` per round), the rounds a request needs for its
``r`` tokens are about ``(r + rho * sqrt(r) * Z) / mu`` with ``rho = sigma / sqrt(mu)`` and ``Z`` standard normal
(the renewal approximation). The batch is done when its last request is: ``E[max_i]`` of those, which for ``B``
requests in lockstep exceeds ``r / mu`` by ``E[max of B standard normals] * rho * sqrt(r) / mu`` rounds. In those
rounds only the last requests run, each at about a batch-of-one round's time, and where requests wait, the
successors of those that finished early are prefilled in rounds of their own.

The charge is forward-looking and read from the batch as it is: requests whose tokens left are already spread
apart have no lockstep to lose, the largest of them dominates the maximum either way, and the charge vanishes; so
it does at batch 1 and for long budgets (it falls as ``1 / sqrt(r)``). A shape's rate ``tokens per second`` becomes
``tokens / (time + charge)`` over the batch's remaining tokens; without speculation the charge is 0.
"""

from __future__ import annotations

from collections import Counter

import torch

from .config import DEFAULT, PolicyConfig


def expected_overrun(remaining: list[int], rho: torch.Tensor, config: PolicyConfig = DEFAULT) -> torch.Tensor:
    """``[shapes]``: ``E[max_i (r_i + rho * sqrt(r_i) * Z_i)] - max_i r_i`` for each shape's ``rho``, in tokens:
    how far past the batch's largest budget its last request runs, measured in rounds of that shape times its mean
    tokens per round. Computed as ``-L + integral over [-L, L] of (1 - P(max <= u)) du`` with ``L`` wide enough that
    the maximum lies inside (``OVERRUN_GRID_*``); requests with the same tokens left enter once, to the power of
    their count (a batch in lockstep has a few distinct values, which keeps this cheap)."""
    points = config.OVERRUN_GRID_POINTS
    r, count = torch.tensor(remaining, dtype=torch.float64).clamp(min=1.0).unique(return_counts=True)
    gap = r - r.max()  # [distinct budgets], <= 0
    sd = rho.to(torch.float64).clamp(min=1e-9)[:, None] * r.sqrt()[None, :]  # [shapes, distinct budgets]
    half = config.OVERRUN_GRID_SD * sd.max(dim=1).values  # [shapes]
    grid = torch.linspace(-1.0, 1.0, points, dtype=torch.float64)
    u = half[:, None] * grid[None, :]  # [shapes, grid]
    # [shapes, distinct budgets, grid]: P(a request with this budget ends at most u past the largest budget)
    below = torch.special.ndtr((u[:, None, :] - gap[None, :, None]) / sd[:, :, None])
    tail = 1.0 - below.pow(count.to(torch.float64)[None, :, None]).prod(dim=1)  # [shapes, grid]: P(max > u)
    step = half * (2.0 / (points - 1))
    return torch.trapezoid(tail, dx=1.0, dim=1) * step - half


def together(remaining: list[int] | None) -> bool:
    """Whether most of a batch decoding a token per round finishes in the same round or the next: at least half of
    its requests (and two) have tokens left within one of each other. One speculative round in such a batch (a
    probe, an exploration) lets the requests that accept more finish early while the batch still runs until its
    last is done, and the next wave starts out of step. Half, not all: a wave's requests reach the scheduler over a
    few of its rounds, so one or two of them start a round or two ahead of the rest."""
    if remaining is None or len(remaining) < 2:
        return False
    counts = Counter(remaining)
    most = max(n + counts.get(r + 1, 0) for r, n in counts.items())
    return most >= 2 and 2 * most >= len(remaining)


def overrun_rounds(remaining: list[int], means: list[float], sds: list[float],
                   config: PolicyConfig = DEFAULT) -> list[float]:
    """Per shape (``means``/``sds``: tokens a request emits per round with it, and their spread), the rounds by which
    the batch's last request outlasts the batch's largest budget at that shape's mean rate."""
    if len(remaining) < 2 or not means:
        return [0.0] * len(means)
    mean = torch.tensor(means, dtype=torch.float64).clamp(min=1.0)
    rho = torch.tensor(sds, dtype=torch.float64).clamp(min=0.0) / mean.sqrt()
    return (expected_overrun(remaining, rho, config).clamp(min=0.0) / mean).tolist()
