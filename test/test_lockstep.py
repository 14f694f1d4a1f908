"""The lockstep charge (``speculative.adaptive.lockstep``) against its ground truth, and the policy using it.

* ``expected_overrun``: for requests in lockstep it is E[max of B standard normals] x rho x sqrt(r) (the tabulated
  constants); for unequal budgets it matches a Monte Carlo of the same maximum; at batch 1 and for budgets far
  apart it vanishes.
* ``overrun_rounds`` against the process it models: requests that draw their tokens per round from a distribution
  until their budget is reached; the batch's last request needs E[max N] - E[N] rounds more than a typical one.
* ``AdaptivePolicy``: at batch 16 with every request 64 tokens from its end, a tree 15 % ahead per round but with a
  wide spread of tokens per round loses to no speculation; with the requests' budgets spread apart, or at batch 1,
  the same tree is chosen. The control, with the charge switched off, keeps the tree in lockstep.
"""

from __future__ import annotations

import random

import pytest
import torch

from sglang_tree_v4.speculative.adaptive import lockstep
from sglang_tree_v4.speculative.adaptive.config import DEFAULT
from sglang_tree_v4.speculative.adaptive.policy import NO_SPECULATION, AdaptivePolicy
from sglang_tree_v4.speculative.adaptive.timing import StepTimes

# E[max of B independent standard normals].
EXPECTED_MAX = {2: 0.5641896, 4: 1.0293754, 16: 1.7659913}


@pytest.mark.parametrize("batch", sorted(EXPECTED_MAX))
def test_overrun_in_lockstep_is_the_expected_maximum_of_normals(batch):
    rho = torch.tensor([0.3, 0.7, 1.2])
    got = lockstep.expected_overrun([64] * batch, rho)
    assert torch.allclose(got, EXPECTED_MAX[batch] * rho.double() * 8, rtol=0.01), got


def test_overrun_of_unequal_budgets_matches_a_monte_carlo():
    remaining, rho = [64, 60, 50, 10, 64, 63], 0.8
    gen = torch.Generator().manual_seed(0)
    r = torch.tensor(remaining, dtype=torch.float64)
    z = torch.randn(400_000, len(remaining), generator=gen, dtype=torch.float64)
    sampled = float((r + rho * r.sqrt() * z).max(dim=1).values.mean() - r.max())
    got = float(lockstep.expected_overrun(remaining, torch.tensor([rho]))[0])
    assert got == pytest.approx(sampled, rel=0.02), (got, sampled)


def test_overrun_vanishes_for_one_request_and_for_budgets_far_apart():
    assert lockstep.overrun_rounds([64], [2.0], [1.0]) == [0.0]
    far = lockstep.overrun_rounds([400] + [64] * 15, [2.0], [1.0])[0]
    near = lockstep.overrun_rounds([64] * 16, [2.0], [1.0])[0]
    assert far < 0.01 < 1.0 < near, (far, near)


@pytest.mark.parametrize("batch,budget", [(4, 64), (16, 64), (16, 16)])
def test_overrun_rounds_match_requests_drawing_tokens_per_round(batch, budget):
    """Each request emits 1, 2 or 3 tokens per round (0.3, 0.4, 0.3) until it has ``budget``: the batch's last
    request needs E[max N] - E[N] more rounds than an average one, within 10 % of the charge (the normal
    approximation of a discrete count)."""
    rng = random.Random(batch * 1000 + budget)
    values, weights = [1, 2, 3], [0.3, 0.4, 0.3]
    mean = sum(v * w for v, w in zip(values, weights, strict=False))
    sd = (sum(v * v * w for v, w in zip(values, weights, strict=False)) - mean ** 2) ** 0.5
    last = average = 0.0
    batches = 3000
    for _ in range(batches):
        rounds = []
        for _ in range(batch):
            tokens = n = 0
            while tokens < budget:
                tokens += rng.choices(values, weights)[0]
                n += 1
            rounds.append(n)
        last += max(rounds) / batches
        average += sum(rounds) / batch / batches
    got = lockstep.overrun_rounds([budget] * batch, [mean], [sd])[0]
    assert got == pytest.approx(last - average, rel=0.1), (got, last - average)


TREE = (4, 2)


def _policy() -> AdaptivePolicy:
    """No speculation against one tree: per request and round the tree emits 2.0 tokens (sd 0.9) in 1.74 times
    a plain step, 15 % ahead by the rounds (past the 1.1 it takes to start speculating); a batch-of-one round
    costs 0.8 of a batch-16 round. In lockstep at 64 tokens the charge takes 15 % off the tree's rate."""
    step_ms = {NO_SPECULATION: 20.0, TREE: 34.8}
    policy = AdaptivePolicy(4, 3, 2, StepTimes())
    policy.menu = [NO_SPECULATION, TREE]
    policy.largest = TREE
    policy.times.model = lambda batch, shape: step_ms[shape] / 1000 * (0.8 if batch == 1 else 1.0)
    d, s = TREE
    policy.stats.sum[s, d], policy.stats.squares[s, d], policy.stats.weight[s, d] = 20.0, 10 * (4.0 + 0.81), 10
    policy.steps = DEFAULT.WARMUP_STEPS
    return policy


@pytest.mark.parametrize("charged", [True, False])
def test_in_lockstep_a_tree_that_spreads_the_batch_loses_to_no_speculation(charged, monkeypatch):
    if not charged:
        monkeypatch.setattr(lockstep, "overrun_rounds", lambda remaining, means, sds, config: [0.0] * len(means))
    policy = _policy()
    assert policy.stats.spread_table()[2][4] == pytest.approx(0.9)
    in_lockstep = policy._decide(16, [64] * 16)[0]
    assert in_lockstep == (NO_SPECULATION if charged else TREE)
    assert policy._decide(16, [64 * (i + 1) for i in range(16)])[0] == TREE  # budgets far apart: nothing to lose
    assert policy._decide(1, [64])[0] == TREE
    assert policy._decide(16, None)[0] == TREE  # budgets unknown: no charge


@pytest.mark.parametrize("remaining,want", [
    ([40] * 16, True),  # a wave that started together
    ([40] * 13 + [41, 38, 37], True),  # ... with a few of its requests a round or two ahead
    ([3, 4], True),
    (list(range(30, 46)), False),  # requests that finish one per round
    ([40] * 7 + list(range(10, 19)), False),  # under half in step
    ([5], False),  # one request has no batch to keep in step
    ([3, 9], False),
])
def test_a_batch_is_together_where_most_of_it_finishes_within_a_round(remaining, want):
    assert lockstep.together(remaining) is want
