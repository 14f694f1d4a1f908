"""The adaptive budget's pieces, against their ground truth.

* ``counterfactual_accepts``: for every smaller shape (depth <= S, the D - 1 best-scored nodes) the tokens a
  request would have emitted must equal greedy verification of that smaller tree, built explicitly.
* ``Curve`` / ``StepTimes``: interpolation and the cache round trip.
* ``AdaptivePolicy``: with a step-time model where verification is cheap relative to drafting, it turns
  speculation off; with drafting nearly free and good acceptance, it picks the largest shape.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_tree_verify_greedy import target_logits_favouring_tree

from sglang_tree_v4.speculative.adaptive.acceptance import NO_SPECULATION, counterfactual_accepts
from sglang_tree_v4.speculative.adaptive.config import DEFAULT, PolicyConfig
from sglang_tree_v4.speculative.adaptive.policy import AdaptivePolicy, batch_tokens, shape_menu, stay_margin
from sglang_tree_v4.speculative.adaptive.timing import Curve, StepTimes
from sglang_tree_v4.tree import DraftTree, build_draft_tree, verify_greedy
from sglang_tree_v4.tree.synthetic import PathHashDrafter

VOCAB = 97


def _subtree(tree: DraftTree, b: int, s: int, d: int) -> tuple[DraftTree, list[int]]:
    """Request ``b``'s tree cut to depth <= s and the d - 1 best-scored such nodes (plus the root), re-indexed."""
    n = int(tree.num_nodes[b])
    cand = [i for i in range(1, n) if int(tree.depths[b, i]) <= s]
    cand.sort(key=lambda i: (-float(tree.scores[b, i]), i))
    keep = [0] + sorted(cand[: d - 1])
    new = {old: k for k, old in enumerate(keep)}
    parents = torch.tensor([[-1] + [new[int(tree.parents[b, i])] for i in keep[1:]]])
    sub = DraftTree.from_parents(tree.tokens[b:b + 1, keep], parents, logprobs=tree.logprobs[b:b + 1, keep])
    return sub, keep


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_counterfactual_accepts_equal_greedy_verification_of_each_smaller_tree(seed):
    gen = torch.Generator().manual_seed(seed)
    B, D, K, S = 6, 10, 3, 4
    drafter = PathHashDrafter(VOCAB, seed=seed)
    roots = torch.randint(0, VOCAB, (B,), generator=gen)
    tree = build_draft_tree(roots, torch.full((B,), 5), drafter, S, K, D, root_parent_hidden=drafter.root_hidden(roots))
    logits = target_logits_favouring_tree(tree, gen, hit_rate=0.8)
    verdict = verify_greedy(tree, logits)
    cf = counterfactual_accepts(tree, verdict.accepted_nodes, verdict.accept_lens, S)
    assert torch.equal(cf[:, S, D], verdict.accept_lens.float())  # the tree itself
    assert float(verdict.accept_lens.float().mean()) > 1.5  # acceptance happens, so the cut matters
    checked = 0
    for b in range(B):
        for s in range(1, S + 1):
            for d in range(2, D + 1):
                sub, keep = _subtree(tree, b, s, d)
                got = verify_greedy(sub, logits[b:b + 1, keep])
                assert float(cf[b, s, d]) == float(got.accept_lens[0]), (b, s, d)
                checked += 1
        assert torch.all(cf[b, :, 1] == 1) and torch.all(cf[b, 0, :] == 1)
    assert checked == B * S * (D - 1)


def test_statistics_come_from_every_fourth_step_and_every_exploring_run():
    """``learn`` samples the steps (STATS_EVERY) but never skips the largest shape or an exploring run (of a smaller
    shape where that is what exploration covers), the only source of the shapes above the chosen one; the table it
    feeds equals ``expected`` shape by shape."""
    STATS_EVERY = DEFAULT.STATS_EVERY
    gen = torch.Generator().manual_seed(0)
    B, D, K, S = 4, 8, 3, 4
    drafter = PathHashDrafter(VOCAB, seed=0)
    roots = torch.randint(0, VOCAB, (B,), generator=gen)
    tree = build_draft_tree(roots, torch.full((B,), 5), drafter, S, K, D, root_parent_hidden=drafter.root_hidden(roots))
    verdict = verify_greedy(tree, target_logits_favouring_tree(tree, gen, hit_rate=0.8))
    policy = AdaptivePolicy(D, K, S, StepTimes())
    updates = []
    for _step in range(3 * STATS_EVERY):
        before = float(policy.stats.weight[1, 2])
        policy.learn(tree, verdict.accepted_nodes, verdict.accept_lens, (2, 1))
        updates.append(float(policy.stats.weight[1, 2]) != before)
    assert sum(updates) == 3 and updates[STATS_EVERY - 1]
    assert policy.stats.expected((8, 4)) is None  # no step ran the largest shape yet
    policy.learn(tree, verdict.accepted_nodes, verdict.accept_lens, (8, 4))
    cf = counterfactual_accepts(tree, verdict.accepted_nodes, verdict.accept_lens, S)
    assert policy.stats.expected((8, 4)) == pytest.approx(float(cf[:, 4, 8].mean()))
    table = policy.stats.table()
    assert all(table[s][d] == pytest.approx(policy.stats.expected((d, s))) for d, s in policy.menu)
    for exploring in (False, True):  # right after an update, a (4, 2) step counts only if it explored
        policy.exploring = exploring
        before = float(policy.stats.weight[2, 4])
        policy.learn(tree, verdict.accepted_nodes, verdict.accept_lens, (4, 2))
        assert (float(policy.stats.weight[2, 4]) != before) == exploring


def test_rarely_run_shapes_follow_the_current_traffic_through_their_gains():
    """Explorations of D8 ran in an easy stretch (D4 3.5 tokens, D8 4.5); since then only D4 ran, on harder
    traffic (2.0 tokens). D8's plain mean is stale at 4.5 -- the policy would pick it -- but its estimate is D4's
    current 2.0 plus the 1.0 the four extra nodes gained in the explorations. With every update covering both, the
    estimate is the plain mean."""
    from sglang_tree_v4.speculative.adaptive.acceptance import AcceptanceStats

    def rounds(d4: float, d8: float, batch: int = 4) -> torch.Tensor:
        """Every request: 1 token at d <= 1, rising to ``d4`` at D4 and on to ``d8`` at D8."""
        accepts = torch.ones(batch, 2, 9)
        accepts[:, 1, 1:5] = torch.linspace(1.0, d4, 4)
        accepts[:, 1, 4:] = torch.linspace(d4, d8, 5)
        return accepts

    stats = AcceptanceStats(8, 1)
    for _ in range(3):
        stats.update(rounds(3.5, 4.5), (8, 1), decay=0.98)
    for _ in range(60):
        stats.update(rounds(2.0, 3.0), (4, 1), decay=0.98)
    plain = float(stats.sum[1, 8] / stats.weight[1, 8])
    assert plain == pytest.approx(4.5)  # the control: the stale mean
    d4 = float(stats.sum[1, 4] / stats.weight[1, 4])
    assert d4 < 2.1 and stats.expected((4, 1)) == pytest.approx(d4)
    assert stats.expected((8, 1)) == pytest.approx(d4 + 1.0)
    assert stats.expected((6, 1)) == pytest.approx(d4 + 0.5)
    even = AcceptanceStats(8, 1)
    for a4, a8 in ((3.5, 4.5), (2.0, 3.0), (2.5, 2.5)):
        even.update(rounds(a4, a8), (8, 1), decay=0.9)
    assert even.expected((8, 1)) == pytest.approx(float(even.sum[1, 8] / even.weight[1, 8]))


def test_curve_interpolates_and_extrapolates_proportionally():
    c = Curve()
    c.add(4, 0.04)
    c.add(16, 0.10)
    assert c(4) == pytest.approx(0.04) and c(10) == pytest.approx(0.07)
    assert c(1) == pytest.approx(0.01) and c(32) == pytest.approx(0.20)
    c.add(4, 0.14)  # a new timing moves the point by the EMA weight
    assert 0.04 < c(4) < 0.14


def test_step_times_round_trip_through_json():
    t = StepTimes({1: Curve({1: 0.01, 8: 0.02})}, {1: Curve({1: 0.005, 64: 0.05}), 4: Curve({1: 0.01})},
                  Curve({1: 0.001}))
    back = StepTimes.from_json(__import__("json").loads(__import__("json").dumps(t.to_json())))
    assert back.predict(4, (8, 1)) == pytest.approx(t.predict(4, (8, 1)))


def test_verification_is_modelled_per_width_over_the_batch_size():
    """The same verified tokens cost differently over more requests: (64, 2) is read from the D = 2 curve, not from
    a curve over B x D shared with (16, 8). Between measured widths the model is linear in D, beyond the last
    proportional."""
    t = StepTimes({}, {1: Curve({16: 0.020, 64: 0.022}), 2: Curve({16: 0.021, 64: 0.035}),
                       4: Curve({16: 0.025, 64: 0.050}), 8: Curve({16: 0.030, 64: 0.110})}, Curve())
    assert t.verify_time(64, 2) == pytest.approx(0.035) and t.verify_time(16, 8) == pytest.approx(0.030)
    assert t.verify_time(16, 6) == pytest.approx(0.0275) and t.verify_time(32, 6) == pytest.approx(
        (0.025 + (0.050 - 0.025) * 16 / 48 + 0.030 + (0.110 - 0.030) * 16 / 48) / 2)
    assert t.verify_time(16, 10) == pytest.approx(0.030 * 10 / 8) and StepTimes().verify_time(4, 2) is None
    assert t.model(16, (6, 0)) == pytest.approx(0.0275)


def test_a_cache_file_of_the_old_layout_is_measured_again(tmp_path):
    """A step-time file written by an older version (verification as one curve over B x D) is not read as a
    model: ``read_cache`` answers None and the worker measures again."""
    import json

    from sglang_tree_v4.speculative.adaptive.measure import read_cache, write_cache
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"times": {"draft": {"1": {"1": 0.01}}, "verify": {"1": 0.01, "64": 0.03},
                                         "rest": {}}, "measured_s": 2.0}))
    assert read_cache(str(old)) is None
    new = tmp_path / "new.json"
    write_cache(str(new), StepTimes({1: Curve({1: 0.01})}, {1: Curve({1: 0.01})}, Curve()), 2.0)
    assert read_cache(str(new)).verify_time(1, 1) == pytest.approx(0.01)


def test_startup_times_are_made_non_decreasing_by_pooling_the_points_that_fall():
    """``measure.monotone``: a run of points that falls is replaced by its mean (the least-squares
    non-decreasing fit), points already in order are kept. Input: a startup measurement of verification at batch
    1 on the CPU (ms, D = 1..8) whose D = 4-6 were timed in a slow stretch."""
    from sglang_tree_v4.speculative.adaptive.measure import monotone
    measured = [8.1, 8.6, 9.1, 14.2, 12.9, 12.6, 14.0, 15.7]
    fitted = monotone(measured)
    assert fitted != measured and all(a <= b for a, b in zip(fitted, fitted[1:], strict=False))
    assert fitted[:3] == measured[:3] and fitted[4] == pytest.approx((14.2 + 12.9 + 12.6) / 3)
    assert sum(fitted) == pytest.approx(sum(measured))
    assert monotone([1.0, 3.0, 2.0, 4.0]) == pytest.approx([1.0, 2.5, 2.5, 4.0])
    assert monotone([1.0, 2.0, 2.0, 5.0]) == [1.0, 2.0, 2.0, 5.0] and monotone([]) == []


def _policy(draft_s: float, verify_per_token: float, accepted: float,
            config: PolicyConfig = DEFAULT) -> AdaptivePolicy:
    times = StepTimes({s: Curve({1: draft_s * s, 64: draft_s * s * 4}) for s in range(1, 5)},
                      {d: Curve({b: 0.01 + verify_per_token * b * d for b in (1, 8, 64)}) for d in range(1, 9)},
                      Curve())
    policy = AdaptivePolicy(8, 3, 4, times, config)
    for (d, s) in policy.menu:  # deeper and wider shapes emit more, up to ``accepted`` tokens per step
        policy.stats.sum[s, d], policy.stats.weight[s, d] = (1 + (min(d, accepted) - 1) * s / 4) * 10, 10
    policy.steps = config.WARMUP_STEPS
    return policy


def test_one_frozen_config_reaches_the_policy_and_the_time_fit():
    """A changed field of ``PolicyConfig`` is read where it applies: the warm-up's length by the policy, the fit's
    noise by the ``TimeFit`` of the ``StepTimes`` given that config. The control: the default's values."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.WARMUP_STEPS = 0
    quick = dataclasses.replace(DEFAULT, WARMUP_STEPS=1, FIT_NOISE_SD=1.0)
    predicted = []
    for config in (DEFAULT, quick):
        policy = _policy(draft_s=0.01, verify_per_token=0.001, accepted=1.5, config=config)
        policy.steps = 0
        warm = config.WARMUP_STEPS
        assert [policy.choose(64) for _ in range(warm + 1)] == [(8, 4)] * warm + [NO_SPECULATION]
        times = StepTimes({}, {1: Curve({1: 0.01})}, Curve(), config=config)
        times.observe(1, NO_SPECULATION, 0.02)
        predicted.append(times.predict(1, NO_SPECULATION))
    assert 0.01 < predicted[1] < predicted[0] < 0.02, predicted  # noisier steps: the fit moves less

def test_policy_turns_speculation_off_when_verification_is_the_bottleneck():
    policy = _policy(draft_s=0.01, verify_per_token=0.001, accepted=1.5)
    assert policy.choose(64) == NO_SPECULATION


def test_policy_speculates_fully_when_drafting_is_cheap_and_drafts_are_accepted():
    policy = _policy(draft_s=1e-5, verify_per_token=1e-6, accepted=8)
    assert policy.choose(1) == (8, 4)


@pytest.mark.parametrize("left,want", [(1, NO_SPECULATION), (3, "a smaller tree"), (100, (8, 4))])
def test_a_request_near_its_end_gets_no_deeper_tree_than_it_can_use(left, want):
    """Where drafting is cheap and 8 tokens would be accepted, a request with one token left to emit gains nothing
    from a tree (no speculation: a step that costs least), one with 3 left gains nothing from a tree beyond one
    that emits 3; with 100 left (the control) the largest tree runs."""
    policy = _policy(draft_s=1e-5, verify_per_token=1e-6, accepted=8)
    chosen = policy.choose(1, remaining=[left])
    if isinstance(want, str):
        assert chosen not in (NO_SPECULATION, (8, 4)) and policy.stats.expected(chosen) >= 3, chosen
    else:
        assert chosen == want
    assert batch_tokens(3, [left, 100, 100], 8)(2.5) == 2 * 2.5 + min(2.5, left)


def _explored_share(policy: AdaptivePolicy, batch: int, chosen: list[tuple[int, int]], shape) -> float:
    times = {c: policy.times.predict(batch, c) for c in set(chosen)}
    return chosen.count(shape) * times[shape] / sum(times[c] for c in chosen)


def test_policy_explores_the_largest_shape_for_about_one_fiftieth_of_the_time_where_it_may_pay():
    """Exploring costs the explored shape's step time; it runs once per EXPLORE_SHARE x (its time / the chosen
    shape's) steps, so its share of the time stays near 1 / EXPLORE_SHARE. Where the largest shape's rate is
    within EXPLORE_REACH of the best (cheap drafting, good acceptance), the largest shape is the one explored."""
    for batch in (1, 8):
        policy = _policy(draft_s=0.002, verify_per_token=0.0003, accepted=3)
        chosen = [policy.choose(batch) for _ in range(2000)]
        assert policy._explore_shape() == (8, 4) and chosen.count((8, 4)) >= 1
        share = _explored_share(policy, batch, chosen, (8, 4))
        assert 0.5 / DEFAULT.EXPLORE_SHARE < share < 1.5 / DEFAULT.EXPLORE_SHARE, (batch, share)


@pytest.mark.parametrize("reach", [DEFAULT.EXPLORE_REACH, 1e9])
def test_where_every_tree_is_far_behind_exploration_runs_the_best_tree_not_the_largest(reach):
    """Where no tree pays, a run of the largest shape costs several plain steps for statistics that cannot matter.
    Exploration only has to refresh the statistics of the trees that could matter, so there it runs the best tree,
    for the same share of the time. The control, with every tree within reach, explores the largest shape."""
    # (no probes: the smallest tree is also the probes' shape)
    config = dataclasses.replace(DEFAULT, EXPLORE_REACH=reach, PROBE_EVERY=10 ** 9)
    for batch in (1, 8, 64):
        policy = _policy(draft_s=0.01, verify_per_token=0.001, accepted=1.5, config=config)
        chosen = [policy.choose(batch) for _ in range(2000)]
        assert chosen.count(NO_SPECULATION) > 1900
        explored = (2, 1) if reach == DEFAULT.EXPLORE_REACH else (8, 4)
        assert policy._explore_shape() == explored
        assert ((8, 4) in chosen) == (reach != DEFAULT.EXPLORE_REACH), batch
        share = _explored_share(policy, batch, chosen, explored)
        assert 0.5 / DEFAULT.EXPLORE_SHARE < share < 1.5 / DEFAULT.EXPLORE_SHARE, (batch, share)


@pytest.mark.parametrize("gate", ["both", "no probe gate", "no exploration gate"])
def test_no_probes_or_explorations_from_no_speculation_where_no_tree_can_pay(gate, monkeypatch):
    """Probing the smallest tree, or exploring, from "no speculation" tells the policy something only while some
    tree might clear the margin; each such step also lets a batch's requests drift apart, which costs the batch
    more than the step itself. Served at the model's times (so the fit knows them well) with every tree at half the
    baseline's rate or less, the policy stops both: in the second 1000 steps a tree runs only as an overdue
    exploration (``EXPLORE_IDLE`` times its share). The controls:
    with every probe allowed a tree runs at least once per PROBE_EVERY steps; with every exploration allowed, once
    per EXPLORE_SHARE x (its step time / the baseline's) steps."""
    config = dataclasses.replace(DEFAULT, PROBE_CHANCE=0.0) if gate == "no probe gate" else DEFAULT
    if gate == "no exploration gate":
        monkeypatch.setattr(AdaptivePolicy, "_may_explore", lambda self, batch, best, overdue: True)
    policy = _policy(draft_s=0.01, verify_per_token=0.001, accepted=1.5, config=config)
    chosen = _served(policy, 64, 2000, lambda shape: policy.times.model(64, shape))[1000:]
    trees = len(chosen) - chosen.count(NO_SPECULATION)
    slower = policy.times.model(64, (2, 1)) / policy.times.model(64, NO_SPECULATION)
    if gate == "both":
        assert policy._chance_to_pay(64) < DEFAULT.PROBE_CHANCE, policy._chance_to_pay(64)
        assert trees <= 1000 / (DEFAULT.EXPLORE_SHARE * DEFAULT.EXPLORE_IDLE), trees
    elif gate == "no probe gate":
        assert trees >= 1000 / DEFAULT.PROBE_EVERY - 1, trees
    else:
        assert trees >= 0.7 * 1000 / (DEFAULT.EXPLORE_SHARE * slower), (trees, slower)


@pytest.mark.parametrize("in_step", [True, False])
def test_a_batch_decoding_in_step_defers_probes_and_explorations_until_it_drifts_apart(in_step):
    """A batch of 16 requests with the same tokens left, decoding without speculation, finishes in one round; one
    tree round (a probe, an exploration) would let some finish early while the batch still waits for its last,
    and its next wave would start out of step. With the fit still ignorant (every tree may pay, so both would run),
    1000 steps in
    step run no tree at all; the first step after the requests drift apart runs the deferred one. The control, a
    batch whose tokens left are spread, runs a tree at least once per ``PROBE_EVERY`` steps."""
    policy = _policy(draft_s=0.01, verify_per_token=0.001, accepted=1.5)
    remaining = [40] * 16 if in_step else list(range(30, 46))
    chosen = [policy.choose(16, remaining) for _ in range(1000)]
    trees = len(chosen) - chosen.count(NO_SPECULATION)
    if in_step:
        assert trees == 0 and policy._chance_to_pay(16) >= DEFAULT.PROBE_CHANCE
        assert policy.choose(16, list(range(30, 46))) != NO_SPECULATION
    else:
        assert trees >= 1000 / DEFAULT.PROBE_EVERY - 1, trees


def test_observed_step_times_override_the_model():
    policy = _policy(draft_s=1e-5, verify_per_token=1e-6, accepted=8)
    assert policy.choose(4) == (8, 4)
    policy.times.observe(4, (8, 4), 10.0)  # the server measured that shape to be slow at this batch size
    assert policy.choose(4) != (8, 4)


def _served(policy: AdaptivePolicy, batch: int, steps: int, seconds) -> list[tuple[int, int]]:
    """Runs the policy as the worker does: every chosen shape is observed at its served step time."""
    chosen = []
    for _ in range(steps):
        shape = policy.choose(batch)
        policy.times.observe(batch, shape, seconds(shape))
        chosen.append(shape)
    return chosen


@pytest.mark.parametrize("probe", [True, False])
def test_baseline_is_observed_before_speculation_is_trusted(probe, monkeypatch):
    """Why the baseline is measured and not only modelled: a startup model that overstates a per-step overhead
    (here: a large one) makes a step without speculation look slower than it is served, and the observed
    speculative shapes only scale that error up. With the baseline probe the policy observes one step without
    speculation and keeps to it; without the probe (the control) it speculates on, although every tree is slower as
    served."""
    if not probe:
        monkeypatch.setattr(AdaptivePolicy, "_baseline_due", lambda self, batch: False)
    policy = _policy(draft_s=1e-5, verify_per_token=1e-6, accepted=8)
    policy.times.rest = Curve({1: 0.05, 64: 0.05})
    chosen = _served(policy, 64, 300, lambda shape: 0.03 + 0.04 * (shape[0] - 1))
    share = chosen[150:].count(NO_SPECULATION) / 150
    assert (share >= 0.9) if probe else (share < 0.1), share


def test_baseline_is_remeasured_about_once_per_explore_share_steps_while_speculating():
    policy = _policy(draft_s=1e-5, verify_per_token=1e-6, accepted=8)
    chosen = _served(policy, 1, 20 * DEFAULT.EXPLORE_SHARE, lambda shape: 0.015 + 0.001 * shape[0])  # trees pay
    assert 10 <= chosen.count(NO_SPECULATION) <= 30, chosen.count(NO_SPECULATION)


@pytest.mark.parametrize("tail", [False, True])
def test_baseline_remeasurement_is_not_postponed_by_unobserved_steps_at_other_batch_sizes(tail, monkeypatch):
    """A serving run's tail (the batch shrinking request by request) decides "no speculation" at batch sizes seen
    for a step or two and never observed. Those steps must not count as the baseline's measurement at batch 32:
    with a tail step after every 10 steps at batch 32, the baseline there is observed as often as without a tail
    (the control). A counter shared by all batch sizes would be reset by the tail's steps and keep the baseline
    at batch 32 from being measured again."""
    decide = AdaptivePolicy._decide

    def tail_decides_none(self, batch, remaining=None):
        return decide(self, batch, remaining) if batch == 32 else (NO_SPECULATION, 0.02)

    monkeypatch.setattr(AdaptivePolicy, "_decide", tail_decides_none)
    policy = _policy(draft_s=1e-5, verify_per_token=1e-6, accepted=8)
    observed_none, tail_steps = 0, []
    for i in range(20 * DEFAULT.EXPLORE_SHARE):
        shape = policy.choose(32)
        policy.times.observe(32, shape, 0.015 + 0.001 * shape[0])  # speculation pays at batch 32
        observed_none += shape == NO_SPECULATION
        if tail and i % 10 == 9:
            tail_steps.append(policy.choose(25 + i % 7))  # a tail step: decided, never observed
    assert not tail or tail_steps.count(NO_SPECULATION) >= 0.8 * len(tail_steps)  # (the others: probes)
    assert 10 <= observed_none <= 30, observed_none


@pytest.mark.parametrize("retry", [1, None])
def test_an_unobserved_baseline_try_waits_before_the_next(retry):
    """Where the baseline's steps are not observed (each comes right after a prefill or a change of batch size),
    trying again at once runs most steps without speculation although speculation pays: with the retry spacing a
    try is made every ``BASELINE_RETRY`` steps; the control (retry at once) spends most steps on tries."""
    config = DEFAULT if retry is None else dataclasses.replace(DEFAULT, BASELINE_RETRY=retry)
    policy = _policy(draft_s=1e-5, verify_per_token=1e-6, accepted=8, config=config)
    chosen = []
    for _ in range(400):
        shape = policy.choose(4)
        if shape != NO_SPECULATION:  # the baseline's tries are never observed
            policy.times.observe(4, shape, 0.015 + 0.001 * shape[0])
        chosen.append(shape)
    share = chosen.count(NO_SPECULATION) / len(chosen)
    assert share <= 1.2 / DEFAULT.BASELINE_RETRY if retry is None else share > 0.5, share


def test_shape_menu_covers_no_speculation_and_every_reachable_tree():
    menu = shape_menu(8, 3, 4)
    assert menu[0] == NO_SPECULATION and (8, 4) in menu and (2, 1) in menu
    assert all(d - 1 >= s for d, s in menu[1:]) and (5, 1) not in menu  # depth 1 holds at most K = 3 nodes


class _Forgetful(dict):
    """The policy's per-batch-size memory of whether it speculated, never written: the rule without hysteresis."""

    def __setitem__(self, key, value):
        pass


def _noisy_served(advantage: float, hysteresis: bool, seed: int = 0) -> tuple[list[tuple[int, int]], float]:
    """At batch 1, when the D8 S4 tree truly emits ``advantage`` times the baseline's tokens per second and every
    other tree breaks even, served as on the CPU: the startup model off by up to +-30 % per shape, each step off by
    up to +-25 %, and the machine drifting in stretches of tens of steps (log-speed AR(1), 0.95, innovations 0.08).
    -> the shapes chosen over 2000 steps after 1000 to settle, and their throughput against the baseline's
    (noise-free step times)."""
    import math
    import random
    rng = random.Random(seed)
    policy = _policy(draft_s=1e-5, verify_per_token=1e-6, accepted=8)
    if not hysteresis:
        policy.speculating = _Forgetful()

    def true_seconds(shape):
        return 0.01 * policy.stats.expected(shape) / (advantage if shape == (8, 4) else 1.0)

    model_error = {shape: rng.uniform(0.7, 1.3) for shape in policy.menu}
    policy.times.model = lambda batch, shape: true_seconds(shape) * model_error[shape]
    machine = [0.0]

    def served(shape):
        machine[0] = 0.95 * machine[0] + rng.gauss(0, 0.08)
        return true_seconds(shape) * math.exp(machine[0]) * rng.uniform(0.75, 1.25)

    chosen = _served(policy, 1, 3000, served)[1000:]
    tokens = sum(policy.stats.expected(c) for c in chosen)
    seconds = sum(true_seconds(c) for c in chosen)
    return chosen, tokens / seconds / 100.0


def test_hysteresis_keeps_a_tree_that_pays_through_noisy_step_times():
    """A tree 15 % ahead, estimated from step times as noisy as this CPU's: entering speculation needs the margin,
    leaving it needs the baseline ahead, so the policy keeps most of the tree's gain (>= 1.12x the baseline's
    throughput, mean of 4 noise sequences); without hysteresis (the control) the estimate's dips under the margin
    drop it, at least 1 % more of the throughput lost."""
    kept = [_noisy_served(1.15, True, seed)[1] for seed in range(4)]
    forgetful = [_noisy_served(1.15, False, seed)[1] for seed in range(4)]
    assert sum(kept) / 4 >= 1.12, kept
    assert sum(forgetful) / 4 <= sum(kept) / 4 - 0.01, (kept, forgetful)


def test_hysteresis_does_not_keep_a_tree_that_loses():
    """The D8 S4 tree loses 10 %; the other trees break even, so running them is no loss: the throughput must stay
    within 1 % of the baseline's and the losing tree run only as the exploration (about 1 / EXPLORE_SHARE)."""
    chosen, rate = _noisy_served(0.9, True)
    assert rate >= 0.99, rate
    assert chosen.count((8, 4)) / len(chosen) <= 2 / DEFAULT.EXPLORE_SHARE, chosen.count((8, 4))


def test_a_shape_the_model_makes_slow_is_probed_and_comes_back():
    """A shape timed in a slow stretch of the machine must not stay out of the choice: at batch 32 the model holds
    D2 S1 at 1.6x its true time while D3 S1 is timed right. D2 S1 truly emits 5 % more tokens per second, so the
    policy must come back to it:
    its neighbour probe serves it, and the served steps correct its time. The control, without probes, never
    serves D2 S1 and keeps to D3 S1."""
    for probes in (True, False):
        policy = _policy(draft_s=1e-5, verify_per_token=1e-6, accepted=8)
        policy.menu = [NO_SPECULATION, (2, 1), (3, 1)]
        policy.largest = (3, 1)
        policy.stats.sum[1, 2], policy.stats.sum[1, 3] = 16.9, 18.4  # 1.69 and 1.84 tokens per step
        batch, rate = 32, {NO_SPECULATION: 0.76, (2, 1): 1.30, (3, 1): 1.234}  # tokens per ms per request
        true_ms = {shape: batch * policy.stats.expected(shape) / rate[shape] for shape in rate}
        policy.times.model = lambda b, shape, true_ms=true_ms: true_ms[shape] * (1.6 if shape == (2, 1) else 1.0)
        if not probes:
            policy._stalest_neighbour = lambda b, shape: None
        chosen = _served(policy, batch, 300, lambda shape, true_ms=true_ms: true_ms[shape])[100:]
        share = chosen.count((2, 1)) / len(chosen)
        assert (share >= 0.85) if probes else (share <= 0.05), (probes, share)


def _fit_errors(seed: int) -> tuple[list[float], list[float]]:
    """Served = modelled x a shape's own error x the machine's passing speed (log-speed AR(1), 0.95, innovations
    0.08: stretches 20-30 % slow or fast) x per-step noise, for 600 steps in runs of 10 per shape. -> relative
    errors of each tree's time against the baseline's: as the fit predicts them, and as the averages of each
    shape's latest run of served ratios give them (what a table of each shape's own steps holds)."""
    import math
    import random

    from sglang_tree_v4.speculative.adaptive.timing import TimeFit
    rng = random.Random(seed)
    error = {NO_SPECULATION: 0.8, (2, 1): 1.0, (4, 2): 1.25, (8, 4): 1.1}
    shapes = list(error)
    fit, served, machine = TimeFit(), {shape: [] for shape in shapes}, 0.0
    for step in range(600):
        machine = 0.95 * machine + rng.gauss(0, 0.08)
        shape = shapes[(step // 10) % len(shapes)]
        ratio = error[shape] * math.exp(machine) * rng.uniform(0.8, 1.25)
        fit.add(shape, math.log(ratio))
        served[shape].append(ratio)
    truth = {shape: error[shape] / error[NO_SPECULATION] for shape in shapes[1:]}
    base = fit.log_ratio(NO_SPECULATION)
    fitted = [math.exp(fit.log_ratio(shape) - base) / truth[shape] - 1 for shape in truth]
    latest = {shape: sum(v[-10:]) / 10 for shape, v in served.items()}
    averaged = [latest[shape] / latest[NO_SPECULATION] / truth[shape] - 1 for shape in truth]
    return fitted, averaged


def test_time_fit_learns_each_shapes_error_through_a_drifting_machine():
    """The fit against its ground truth: over 5 noise sequences its relative error of each tree's time against
    the baseline's is at most 6 % on average (measured 4 %); the per-shape averages (the control) are off by at
    least 15 % on average (measured 25 %): they carry the stretch each shape happened to run in."""
    fitted, averaged = [], []
    for seed in range(5):
        f, a = _fit_errors(seed)
        fitted += [abs(x) for x in f]
        averaged += [abs(x) for x in a]
    assert sum(fitted) / len(fitted) <= 0.06, fitted
    assert sum(averaged) / len(averaged) >= 0.15, averaged


@pytest.mark.parametrize("observed_ahead,want", [(stay_margin(16) - 0.01, NO_SPECULATION),
                                                  (stay_margin(16) + 0.01, (2, 1))])
def test_only_observed_trees_get_the_hysteresis_band(observed_ahead, want):
    """While speculating at a batch size: a tree the policy has only modelled there (here ahead of every other,
    inside the band) must still clear the margin, so the policy stays with the best tree it has observed if that
    one is ``stay_margin`` ahead of the baseline, and otherwise stops speculating."""
    policy = _policy(draft_s=1e-5, verify_per_token=1e-6, accepted=8)
    batch, t_none = 16, 0.02
    ahead = {(2, 1): observed_ahead, (8, 4): (stay_margin(16) + 0.01 + DEFAULT.SPECULATION_MARGIN) / 2}
    seconds = {shape: t_none * policy.stats.expected(shape) / a for shape, a in ahead.items()}
    seconds[NO_SPECULATION] = t_none
    policy.times.observed = {(batch, *NO_SPECULATION): t_none, (batch, 2, 1): seconds[(2, 1)]}
    policy.times.predict = lambda b, shape: seconds.get(shape)
    policy.speculating[batch] = True
    assert policy._decide(batch)[0] == want


@pytest.mark.parametrize("batch,want", [(1, (2, 1)), (16, NO_SPECULATION), (32, NO_SPECULATION)])
def test_a_tree_inside_the_lockstep_gap_is_dropped_from_batch_16(batch, want):
    """While speculating, an observed tree 6 % ahead of the baseline by the rounds stays at batch 1 and is dropped
    at batch 16 and 32: there the rounds flatter speculation by more than that against the wall clock
    (``docs/adaptive_budget.md``). An edge of 1.04 from batch 32 would keep the tree at both."""
    policy = _policy(draft_s=1e-5, verify_per_token=1e-6, accepted=8)
    t_none = 0.02
    seconds = {NO_SPECULATION: t_none, (2, 1): t_none * policy.stats.expected((2, 1)) / 1.06}
    policy.times.observed = {(batch, *NO_SPECULATION): t_none, (batch, 2, 1): seconds[(2, 1)]}
    policy.times.predict = lambda b, shape: seconds.get(shape)
    policy.speculating[batch] = True
    assert policy._decide(batch)[0] == want


def test_the_band_narrows_with_the_batch_size():
    """A batch of one has no requests to drift apart, so there a tree stays while it is ahead at all; from
    STAY_MARGIN_BATCH on it must stay STAY_MARGIN ahead; in between the edge rises with log2 of the batch size."""
    below = [b for b in (1, 2, 4, 8, 16, 32) if b <= DEFAULT.STAY_MARGIN_BATCH]
    rising = [stay_margin(b) for b in below]
    assert rising[0] == 1.0 and rising[-1] == pytest.approx(DEFAULT.STAY_MARGIN) and len(rising) >= 3
    assert all(a < b for a, b in zip(rising, rising[1:], strict=False)), rising
    far = (stay_margin(2 * DEFAULT.STAY_MARGIN_BATCH), stay_margin(8 * DEFAULT.STAY_MARGIN_BATCH))
    assert far[0] == far[1] == pytest.approx(DEFAULT.STAY_MARGIN)
    assert all(1.0 <= stay_margin(b) < DEFAULT.SPECULATION_MARGIN for b in range(1, 257))
