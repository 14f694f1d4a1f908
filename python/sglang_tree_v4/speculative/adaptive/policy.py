"""The adaptive speculation budget: per decode step, the tree shape -- or no speculation -- with the most expected
tokens per second for this batch.

A shape is (D, S): D tokens verified per request (root included), drafted S steps deep with the server's K children
per node; ``NO_SPECULATION`` = (1, 0) is ordinary decoding (the MTP skips the step and catches up later). For a
batch of B requests the policy picks

    argmax over shapes   sum over requests of min(A(D, S), tokens left) / (T_draft(B, S) + T_verify(B, D) + T_rest(B))

less what the shape's spread of tokens per round costs the batch outside its rounds (``lockstep``), with ``A``
from the acceptance statistics (``acceptance``) and ``T`` from the step-time model (``timing``). Around that:

* hysteresis per batch size: a tree must clear ``SPECULATION_MARGIN`` over no speculation to be chosen, and an
  observed tree is dropped only once under ``stay_margin`` -- noisy step times would otherwise flip the choice;
* exploration: now and then the smallest shape covering every contender runs, the only source of statistics for
  the shapes above the chosen one;
* the baseline is observed, not only modelled, before "speculate or not" is trusted at a batch size;
* neighbour probes keep the shapes next to the choice served, so that their fitted times stay current;
* from no speculation, probes and explorations run only where some tree may pay, and not while the batch decodes
  in step (``lockstep.together``), where one speculative round would break its step.

The choice never changes what is emitted: every tree is verified losslessly. On tensor-parallel servers rank 0
chooses and broadcasts (timings differ per rank). The measurements behind each rule: ``docs/adaptive_budget.md``.
"""

from __future__ import annotations

import math

import torch

from ...tree import DraftTree
from . import lockstep
from .acceptance import NO_SPECULATION, AcceptanceStats, counterfactual_accepts
from .config import DEFAULT, PolicyConfig
from .timing import StepTimes

__all__ = ["NO_SPECULATION", "AdaptivePolicy", "batch_tokens", "shape_menu", "stay_margin"]


def stay_margin(batch: int, config: PolicyConfig = DEFAULT) -> float:
    """The lower edge of the hysteresis band at this batch size: 1 at batch 1 (one request has nothing to drift
    apart from), rising with log2 of the batch to ``STAY_MARGIN`` at ``STAY_MARGIN_BATCH`` and above."""
    return 1 + (config.STAY_MARGIN - 1) * min(1.0, math.log2(max(batch, 1)) / math.log2(config.STAY_MARGIN_BATCH))


def batch_tokens(batch: int, remaining: list[int] | None, most: int):
    """``accepted -> tokens the batch emits per step`` when each request emits ``accepted`` on average but at most
    its ``remaining`` tokens (``most``: the largest D, beyond which nothing caps): a request one token from its
    ``max_new_tokens`` gains nothing from a tree, so a batch of requests near their ends speculates less."""
    near = [r for r in remaining if r < most] if remaining else []
    if not near:
        return lambda accepted: batch * accepted
    far = batch - len(near)
    return lambda accepted: far * accepted + sum(min(accepted, max(r, 1)) for r in near)


def shape_menu(max_tokens: int, topk: int, max_steps: int) -> list[tuple[int, int]]:
    """Every (D, S) the server's reservation allows, smallest first, "no speculation" included."""
    from ..server_args import max_tree_nodes  # (lazy: the server arguments' module imports SGLang)
    shapes = [NO_SPECULATION]
    for s in range(1, max_steps + 1):
        for d in range(2, min(max_tokens, 1 + max_tree_nodes(topk, s)) + 1):
            if d - 1 >= s:  # a shape of depth S needs at least S draft nodes
                shapes.append((d, s))
    return shapes


class AdaptivePolicy:
    """``choose`` a shape before each step, ``learn`` from each speculative step's acceptance; the worker feeds
    served step times to ``times`` (which carries its own config for the time model's tunables)."""

    def __init__(self, max_tokens: int, topk: int, max_steps: int, times: StepTimes,
                 config: PolicyConfig = DEFAULT):
        self.config = config
        self.menu = shape_menu(max_tokens, topk, max_steps)
        self.largest = (max_tokens, max_steps)
        self.stats = AcceptanceStats(max_tokens, max_steps)
        self.times = times
        self.steps = 0
        self.since_explore = 0
        self.since_probe = 0
        self.since_stats = 0
        self.exploring = False  # whether the last choice was the exploration shape
        self._rates: dict[tuple[int, int], tuple[float, float]] = {}  # per shape of the last decision: (rate, s)
        self.speculating: dict[int, bool] = {}  # per batch size: whether the policy's last own choice speculated
        self.baseline_tried: dict[int, int] = {}  # per batch size: the step of the last choice of no speculation
        self._chance_at: tuple[int, int, float] = (-10 ** 9, 0, 1.0)  # (step, batch size, ``_chance_to_pay``)
        # (step, batch size, {tree: seconds}): the lockstep charges of the last evaluation (``_charge_lockstep``).
        self._lockstep_at: tuple[int, int, dict[tuple[int, int], float]] = (-10 ** 9, 0, {})

    def choose(self, batch: int, remaining: list[int] | None = None) -> tuple[int, int]:
        """The shape for this step (on the deciding rank); ``remaining``: each request's tokens still to emit (its
        ``max_new_tokens`` less its output), if known."""
        c = self.config
        self.steps += 1
        self.times.clock = self.steps
        if self.steps <= c.WARMUP_STEPS:
            return self.largest
        best, best_s = self._decide(batch, remaining)
        explore = self._explore_shape()
        explore_s = self._rates[explore][1] if explore in self._rates else self.times.predict(batch, explore)
        self.since_explore += 1
        self.since_probe += 1
        self.exploring = False
        share = explore_s / best_s if explore_s and best_s else None
        # A batch decoding in step without speculation defers its exploration and probe until it drifts apart.
        free = best != NO_SPECULATION or not lockstep.together(remaining)
        if best != explore and share and self.since_explore >= c.EXPLORE_SHARE * share and free and \
                self._may_explore(batch, best, self.since_explore >= c.EXPLORE_SHARE * c.EXPLORE_IDLE * share):
            best, self.exploring = explore, True
        elif best != NO_SPECULATION and self._baseline_due(batch):
            best = NO_SPECULATION
        elif self.since_probe >= c.PROBE_EVERY and free:
            if best != NO_SPECULATION or self._chance_to_pay(batch) >= c.PROBE_CHANCE:
                best = self._stalest_neighbour(batch, best) or best
            self.since_probe = 0
        if best == explore:
            self.since_explore = 0
        if best == NO_SPECULATION:
            self.baseline_tried[batch] = self.steps
        return best

    def learn(self, tree: DraftTree, accepted_nodes: torch.Tensor, accept_lens: torch.Tensor,
              ran: tuple[int, int]) -> None:
        """This speculative step's acceptance, for the statistics of every shape at or below ``ran``: from every
        ``STATS_EVERY``-th step and every exploring run (the only source for the shapes above the chosen one),
        decayed by the steps since the last update."""
        self.since_stats += 1
        if not self.exploring and ran != self.largest and self.since_stats < self.config.STATS_EVERY:
            return
        accepts = counterfactual_accepts(tree, accepted_nodes, accept_lens, self.largest[1])
        self.stats.update(accepts, ran, decay=self.config.STATS_DECAY ** self.since_stats)
        self.since_stats = 0

    def describe(self, trees: int = 4) -> str:
        """The last decision's rates, for the server's debug log: no speculation and the best ``trees`` trees, in
        output tokens per ms (lockstep charge included), with each tree's charge in ms where it has one."""
        rates, charges = self._rates, self._lockstep_at[2]
        means, spreads = self.stats.table(), self.stats.spread_table()
        best = sorted((s for s in rates if s != NO_SPECULATION), key=lambda s: -rates[s][0])[:trees]
        parts = [f"none {rates[NO_SPECULATION][0] / 1e3:.3f}"] if NO_SPECULATION in rates else []
        parts += [f"D{d}S{s} {rates[(d, s)][0] / 1e3:.3f} (tokens {means[s][d]:.2f} +- {spreads[s][d]:.2f}"
                  + (f", charge {1e3 * charges[(d, s)]:.0f} ms)" if charges.get((d, s)) else ")") for d, s in best]
        return ", ".join(parts)

    def _may_explore(self, batch: int, best: tuple[int, int], overdue: bool) -> bool:
        """Whether an exploration that is due runs: always while speculating; from "no speculation" only while some
        tree has ``PROBE_CHANCE`` of paying (``_chance_to_pay``, re-evaluated every ``CHANCE_EVERY`` steps), since
        each speculative step there lets the batch's requests drift apart; or once it is ``EXPLORE_IDLE`` times
        overdue, so the statistics of a server that only serves large batches do not go stale."""
        c = self.config
        if best != NO_SPECULATION or overdue:
            return True
        if self.steps - self._chance_at[0] >= c.CHANCE_EVERY or self._chance_at[1] != batch:
            self._chance_at = (self.steps, batch, self._chance_to_pay(batch))
        return self._chance_at[2] >= c.PROBE_CHANCE

    def _chance_to_pay(self, batch: int) -> float:
        """By the fit's uncertainty, the chance that the likeliest tree beats no speculation by the margin: under
        ``PROBE_CHANCE`` (trees far behind, or a little behind with a time the fit knows well) a probe would cost
        a slower step and tell nothing new."""
        fit, rates = self.times.fits.get(batch), self._rates
        if fit is None or NO_SPECULATION not in rates:
            return 1.0
        bar = rates[NO_SPECULATION][0] * self.config.SPECULATION_MARGIN
        z = max((math.log(rate / bar) / max(fit.difference_sd(shape, NO_SPECULATION), 1e-6)
                 for shape, (rate, _) in rates.items() if shape != NO_SPECULATION), default=-math.inf)
        return 0.5 * math.erfc(-z / math.sqrt(2))

    def _explore_shape(self) -> tuple[int, int]:
        """The smallest shape whose runs refresh the acceptance statistics of every contender: the trees whose
        rate at the last decision is within ``EXPLORE_REACH`` of the best rate (baseline included). At small
        batches that is the largest shape; where every tree is far behind no speculation it is the best tree, so
        exploring does not pay a large shape's step for statistics that cannot matter."""
        rates = self._rates
        trees = {s: r for s, (r, _) in rates.items() if s != NO_SPECULATION}
        if not trees:
            return self.largest
        top = max(r for r, _ in rates.values())
        reach = self.config.EXPLORE_REACH
        contenders = [s for s, r in trees.items() if r * reach >= top] or [max(trees, key=trees.get)]
        shape = (max(d for d, _ in contenders), max(s for _, s in contenders))
        return shape if shape in self.menu else self.largest

    def _stalest_neighbour(self, batch: int, shape: tuple[int, int]) -> tuple[int, int] | None:
        """Of the shapes next to ``shape`` in the menu (D +- 1 or S +- 1; next to "no speculation": the smallest
        tree), the one observed at this batch size longest ago (never: first), unless all were observed within
        the last ``PROBE_EVERY`` steps. Neighbours, not the likeliest challenger: one noisy step of a distant shape
        would move the policy more than a neighbour's does."""
        every = self.config.PROBE_EVERY
        d, s = shape
        near = [(2, 1)] if shape == NO_SPECULATION else [(d - 1, s), (d + 1, s), (d, s - 1), (d, s + 1)]
        near = [n for n in near if n in self.menu and n != NO_SPECULATION]
        seen = self.times.observed_at
        age = {n: self.steps - seen.get((batch, *n), -10 ** 9) for n in near}
        stalest = max(near, key=lambda n: age[n], default=None)
        return stalest if stalest is not None and age[stalest] >= every else None

    def _decide(self, batch: int, remaining: list[int] | None = None) -> tuple[tuple[int, int], float | None]:
        """The policy's own choice (before exploration and baseline probes) and its predicted step time: the best
        tree against the baseline, with the hysteresis of the module doc. Only observed trees get the band: a tree
        whose time here is still the model's must clear the full margin."""
        self._rates = rates = {}
        expected = self.stats.table()
        emitted = batch_tokens(batch, remaining, self.largest[0])
        for shape in self.menu:
            accepted, seconds = expected[shape[1]][shape[0]], self.times.predict(batch, shape)
            if accepted is not None and seconds is not None and seconds > 0:
                rates[shape] = (emitted(accepted) / seconds, seconds)
        if remaining and batch > 1:
            self._charge_lockstep(batch, remaining, rates, expected)
        trees = [s for s in rates if s != NO_SPECULATION]
        if not trees:
            return (NO_SPECULATION, rates[NO_SPECULATION][1]) if NO_SPECULATION in rates else (self.largest, None)
        tree = max(trees, key=lambda s: rates[s][0])
        if NO_SPECULATION in rates:
            speculating = self.speculating.get(batch, False)
            seen = [s for s in trees if (batch, *s) in self.times.observed]
            stay, enter = stay_margin(batch, self.config), self.config.SPECULATION_MARGIN

            def pays(shape) -> bool:  # ties go to the baseline
                bar = stay if speculating and shape in seen else enter
                return rates[shape][0] > bar * rates[NO_SPECULATION][0]

            if not pays(tree):
                alt = max(seen, key=lambda s: rates[s][0]) if speculating and seen else None
                tree = alt if alt is not None and pays(alt) else NO_SPECULATION
        self.speculating[batch] = tree != NO_SPECULATION
        return tree, rates[tree][1]

    def _charge_lockstep(self, batch: int, remaining: list[int], rates: dict, expected: list) -> None:
        """Each tree's rate over the batch's remaining tokens, with the rounds by which its spread of tokens per
        round makes the batch's last request outlast the others (``lockstep``): ``tokens / (tokens / rate +
        overrun x (T(1, tree) + T(1, none)))``. Each such round is a part-full round (about a batch of one's time)
        and, where requests wait, a prefill round of its own for the successor of a request that finished early
        (about a plain batch-of-one round). Evaluated every ``LOCKSTEP_EVERY`` steps at one batch size (it costs
        up to a ms at large batches), the tokens left every step."""
        trees = [shape for shape in rates if shape != NO_SPECULATION]
        at, at_batch, charges = self._lockstep_at
        if self.steps - at >= self.config.LOCKSTEP_EVERY or at_batch != batch or not all(t in charges for t in trees):
            spread = self.stats.spread_table()
            rounds = lockstep.overrun_rounds(remaining, [expected[s][d] for d, s in trees],
                                             [spread[s][d] for d, s in trees], self.config)
            plain = self.times.predict(1, NO_SPECULATION) or 0.0
            charges = {t: n * ((self.times.predict(1, t) or 0.0) + plain) for t, n in zip(trees, rounds, strict=False)}
            self._lockstep_at = (self.steps, batch, charges)
        tokens = float(sum(max(r, 1) for r in remaining))
        for t in trees:
            rate, seconds = rates[t]
            if charges[t] > 0:
                rates[t] = (tokens / (tokens / rate + charges[t]), seconds)

    def _baseline_due(self, batch: int) -> bool:
        """Whether this step should run without speculation to measure the baseline at this batch size: a
        speculative shape has an observed time here and the baseline's observation here is missing (then every
        ``BASELINE_RETRY`` steps) or ``EXPLORE_SHARE`` steps old (then again ``EXPLORE_SHARE`` steps after a try
        that was not observed).

        The age is that of the baseline's last observation *at this batch size*: a serving run's shrinking tail
        decides "no speculation" at batch sizes that are never observed, and must not reset it. A try that was not
        observed (after a prefill, at a new batch size) counts as a try, or small batches, whose requests come and
        go every few steps, would spend many steps retrying."""
        c = self.config
        times = self.times
        observed = times.observed_at.get((batch, *NO_SPECULATION))
        tried = self.baseline_tried.get(batch, -10 ** 9)
        if observed is None:
            if self.steps - tried < c.BASELINE_RETRY:
                return False
        elif self.steps - max(observed, tried) < c.EXPLORE_SHARE:
            return False  # the usual case, without scanning the observations
        return any(key[0] == batch and key[1:] != NO_SPECULATION for key in times.observed)
