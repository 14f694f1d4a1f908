"""The adaptive speculation budget: per decode step, the tree shape -- or no speculation -- with the most expected
tokens per second for this batch.

A shape is (D, S): D tokens verified per request (root included), drafted S steps deep with the server's K children
per node; (1, 0) is "no speculation" (the target decodes the root alone and the MTP is not run; its next draft
catches up over what it missed, at most one window). For a batch of B requests the policy picks

    argmax over shapes   sum over requests of min(A(D, S), tokens left) / (T_draft(B, S) + T_verify(B * D) + T_rest(B))

less, at batch sizes above 1, what the shape's spread of tokens per round costs the batch outside its rounds
(``lockstep``: requests that would finish in the same round drift apart, and the batch's last request runs on
alone); ``_charge_lockstep``.

speculating only where it clearly pays: from "no speculation" the policy moves to the best tree only where that
tree's rate is ``SPECULATION_MARGIN`` times the baseline's, and it moves back only once no tree it has observed at
this batch size is ``stay_margin`` times the baseline's rate. The band between is hysteresis (per batch size): on a
machine where one step's time varies by tens of percent, a tree that pays 15-30 % would otherwise be dropped
whenever a noisy estimate dips under the margin (the CPU sweep ran without speculation on about a fifth of its
batch-1 steps that way). Only observed trees get the band: a tree whose time at this batch size is still the
model's must clear the margin (a first sweep with the band for every tree kept switching among trees the startup
model made look cheap at batch 16-32, 0.83-0.89 of the best server there).

* ``A(D, S)``, the expected tokens a request emits per step with that shape, comes from online acceptance
  statistics. Every verified tree also answers for every smaller shape: keeping only the nodes of depth <= S and,
  among them, the D - 1 with the best draft scores (EAGLE-2's rerank; parents score at least as high as their
  children, so the kept set is a subtree), the accepted path's nodes that survive are what the smaller tree would
  have accepted (exact for greedy acceptance of that subtree). One step thus updates the statistics of all shapes
  at or below the one it ran; now and then a larger shape runs to keep them fresh (about 1 / ``EXPLORE_SHARE``
  of the time): the smallest shape that covers every tree whose rate is within ``EXPLORE_REACH`` of the best --
  the largest shape at small batches, a small tree where every tree is far behind no speculation (on the CPU at
  batch 64 the largest shape's runs, 1 % of the steps, had cost 1.3 ms per step, 3.5 %, to refresh statistics of
  trees that could not pay there). From "no speculation" it runs, like the probes below, only while some tree
  has ``PROBE_CHANCE`` of paying, and otherwise at 1 / ``EXPLORE_IDLE`` of its share (``_may_explore``);
  and, like the probes, not while the batch decodes in step (most of its requests' tokens left within one of each
  other, ``lockstep.together``): one speculative round there lets some requests finish early while the batch
  still waits for its last, so the run waits until they drift apart of their own accord. The statistics are
  gathered from every ``STATS_EVERY``-th step (and every exploring run): a sample of the steps says as much about
  acceptance as all of them, at a quarter of the bookkeeping.
* The baseline is measured, not only modelled: once a speculative shape has been observed at a batch size, one
  step without speculation runs there too if none has been (and again once that observation is ``EXPLORE_SHARE``
  steps old: the age of the baseline's observation at this batch size, see ``_baseline_due``), so the comparison
  that decides "speculate or not" is between two observed step times. (Measured on the CPU: the model alone,
  calibrated by the speculative shapes' observed times, overestimated a step without speculation at batch 16-64
  and the server speculated where not speculating was up to 30 % faster.)
* ``T_*`` are step times measured on this device at startup (``step_timer``, cached per model, device and TP;
  interpolated in the batch size and, for verification, in the number of verified tokens), plus the rest of the
  round (scheduler, acceptance) measured online. Served steps correct this model through ``TimeFit``, per batch
  size: a Kalman filter over log(served / modelled) with a fast-moving machine term, slow terms for what the model
  gets wrong about speculating, verifying and drafting, and a slow term per shape. The startup model is not itself
  refined online: a curve point refreshed from the steps that ran it carries the machine's speed at that moment,
  so shapes timed in a slow stretch looked slow for as long as they did not run again (measured on the CPU: at
  batch 32 the D2 S1 tree was timed at 68 ms in the first run, 41 ms later, and the policy kept to D3 S1, 5 %
  behind D2, for the rest of the run). In a simulation of the policy under this CPU's step-time noise
  (``benchmark/adaptive_policy_sim.py``) the filter raised the policy's mean throughput from 0.948 to 0.968 of the
  best fixed shape's.
* Every ``PROBE_EVERY`` steps the policy runs the neighbour of its choice (D +- 1 or S +- 1; the smallest tree
  next to "no speculation") that it served longest ago, so that the shapes near the choice keep being served and
  their own terms stay current. Neighbours are at most a few percent apart, so the probes cost little; a probe
  that comes out better makes the policy move there. From "no speculation" the probe runs only while, by the
  fit's uncertainty, some tree has at least ``PROBE_CHANCE`` of clearing the margin. (Probing the tree most likely
  to beat the choice, however far away, in place of the neighbours, lowered the simulator's median (24 seeds)
  from 0.967 to 0.964-0.966, and from 0.964 to 0.954-0.961 with the startup model off by up to 3x: one noisy step
  of a distant shape moved the policy more than a neighbour's did.)

The choice never changes what is emitted: any shape's tree is verified losslessly, and the no-speculation step is
ordinary decoding. On tensor-parallel servers rank 0 chooses and broadcasts (timings differ per rank).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..tree import DraftTree
from . import lockstep

NO_SPECULATION = (1, 0)
# A larger shape (the largest, where it may pay) runs now and then (fresh statistics for every shape below it),
# spending about 1 / EXPLORE_SHARE of the time: after EXPLORE_SHARE x (its predicted step time / the chosen
# shape's) steps of the chosen shape.
EXPLORE_SHARE = 50
# Speculate only where a shape is predicted this much faster than no speculation: near a tie the end-to-end
# throughput (prefill, catch-up after a switch, noise in the step times) favours plain decoding, and the default
# must never lose to it.
SPECULATION_MARGIN = 1.1
# Once speculating at a batch size, the policy stays with an observed tree while its rate is ``stay_margin(batch)``
# times the baseline's (the lower edge of the hysteresis band, see the module doc): 1 at batch 1, rising with log2
# of the batch size to STAY_MARGIN at STAY_MARGIN_BATCH and above. Rounds do not show what speculating costs a
# batch outside them: requests that would finish in one round finish over several, so the batch runs part-full and
# the next requests are prefilled in more, smaller rounds; a batch of one has nothing to drift apart. Measured on
# the CPU (``benchmark/round_accounting.py``), rounds the policy observes against the wall clock: at batch 32
# (GSM8K) D2 S1 1 % ahead of no speculation by the rounds, 6 % behind by the wall clock; at batch 16 (ShareGPT, the
# adaptive server) its D3 S1 rounds 4 % ahead, the server 4 % behind. A tree less than about 8 % ahead by the rounds
# loses by the wall clock from batch 16 on (at 1.04 from batch 32 the policy kept such trees at ShareGPT batch 16:
# 0.89 of the best server, the sweep at d158622). Measured later with fixed trees at ShareGPT batch 16, the gap is
# 12 % for D2 S1 and 25 % for D4 S2: it grows with the tree, which one edge for all trees cannot follow; that part
# is the lockstep charge's (``lockstep``), and the band stays for the noise of the rounds (RESULTS.md).
STAY_MARGIN = 1.08
STAY_MARGIN_BATCH = 16
# Exploration covers the shapes whose rate is within this factor of the best: acceptance this much above the
# statistics' is what it takes for a shape to matter.
EXPLORE_REACH = 1.5
WARMUP_STEPS = 4  # the largest shape runs first, until the statistics have something to say
STATS_DECAY = 0.98  # per step: the acceptance statistics follow the traffic of the last ~50 steps
STATS_EVERY = 4  # acceptance statistics from every 4th step (0.4 ms of tensor work each on the CPU)
TIME_EMA = 0.2  # weight of a new timing against the table's value
PROBE_CHANCE = 0.1  # from no speculation, probe or explore only where a tree has at least this chance of paying
CHANCE_EVERY = 8  # steps between two evaluations of that chance for exploration (0.1-0.2 ms each on the CPU)
EXPLORE_IDLE = 8  # without that chance, exploration runs at 1 / EXPLORE_IDLE of its share
BASELINE_RETRY = 8  # steps between two tries at the baseline's first observation at a batch size
PROBE_EVERY = 32  # steps between two neighbour probes (chosen with benchmark/adaptive_policy_sim.py)
LOCKSTEP_EVERY = 4  # steps between two evaluations of the lockstep charge at one batch size
# The step-time correction tracked per batch size (``TimeFit``), in log(served / modelled) step time. As (standard
# deviation at first, drift per served step): the level (how far off the model is overall), the shared terms (what
# it gets wrong about speculating, verifying, drafting) and each shape's own term. The machine's passing speed is
# mean-reverting: (correlation from one step to the next, innovation per step); on the CPU stretches of tens of
# steps run 20-30 % slow or fast. And one step's own noise.
FIT_LEVEL_SD = (1.0, 0.01)
FIT_SHARED_SD = (0.5, 0.01)
FIT_SHAPE_SD = (0.3, 0.005)
FIT_MACHINE = (0.95, 0.08)
FIT_NOISE_SD = 0.12


def stay_margin(batch: int) -> float:
    """The lower edge of the hysteresis band at this batch size (``STAY_MARGIN``)."""
    return 1 + (STAY_MARGIN - 1) * min(1.0, math.log2(max(batch, 1)) / math.log2(STAY_MARGIN_BATCH))


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
    from .server_args import max_tree_nodes
    shapes = [NO_SPECULATION]
    for s in range(1, max_steps + 1):
        for d in range(2, min(max_tokens, 1 + max_tree_nodes(topk, s)) + 1):
            if d - 1 >= s:  # a shape of depth S needs at least S draft nodes
                shapes.append((d, s))
    return shapes


def counterfactual_accepts(tree: DraftTree, accepted_nodes: torch.Tensor, accept_lens: torch.Tensor,
                           max_steps: int) -> torch.Tensor:
    """``[B, max_steps + 1, D + 1]``: for every request, the tokens it would have emitted had its tree been cut to
    depth <= s and the d - 1 best-scored such nodes (entry ``[b, s, d]``; d = 1 or s = 0: 1 token)."""
    B, D = tree.tokens.shape
    dev = tree.tokens.device
    idx = torch.arange(D, device=dev)
    steps = torch.arange(1, max_steps + 1, device=dev)[None, :, None]  # [1, S, 1]
    on_path = (idx >= 1) & (idx < accept_lens[:, None])  # [B, D]: accepted draft nodes, by depth
    # Per depth cut s: nodes of depth <= s ranked by score (stable: a parent before its equally scored child).
    keep = ((idx < tree.num_nodes[:, None]) & (tree.depths >= 1))[:, None, :] & (tree.depths[:, None, :] <= steps)
    key = torch.where(keep, tree.scores.float()[:, None, :], float("-inf"))
    order = torch.argsort(-key, dim=2, stable=True)
    rank = torch.empty_like(order).scatter_(2, order, idx.expand_as(order).contiguous())
    rank = torch.where(keep, rank, D)
    path_rank = rank.gather(2, accepted_nodes.clamp(min=0)[:, None, :].expand_as(rank))  # [B, S, D]: by depth i
    path_rank = torch.where(on_path[:, None, :] & (idx[None, None, :] <= steps), path_rank, D)
    d = torch.arange(D + 1, device=dev)
    out = torch.ones(B, max_steps + 1, D + 1, dtype=torch.float32, device=dev)
    out[:, 1:, :] = 1 + (path_rank[:, :, None, :] < (d - 1)[None, None, :, None]).sum(-1).float()
    out[:, :, 0] = 1
    return out


class AcceptanceStats:
    """Decayed means of ``counterfactual_accepts`` per shape (only shapes at or below a run shape are updated), and
    of their squares: the spread of a request's tokens per round decides how far apart requests drift
    (``lockstep``)."""

    def __init__(self, max_tokens: int, max_steps: int):
        self.sum = torch.zeros(max_steps + 1, max_tokens + 1)
        self.squares = torch.zeros(max_steps + 1, max_tokens + 1)
        self.weight = torch.zeros(max_steps + 1, max_tokens + 1)

    def update(self, accepts: torch.Tensor, ran: tuple[int, int], decay: float = STATS_DECAY) -> None:
        d, s = ran
        self.sum *= decay
        self.squares *= decay
        self.weight *= decay
        kept = accepts[:, : s + 1, : d + 1]
        self.sum[: s + 1, : d + 1] += kept.sum(0).cpu()
        self.squares[: s + 1, : d + 1] += kept.square().sum(0).cpu()
        self.weight[: s + 1, : d + 1] += accepts.shape[0]

    def expected(self, shape: tuple[int, int]) -> float | None:
        d, s = shape
        if shape == NO_SPECULATION:
            return 1.0
        w = float(self.weight[s, d])
        return float(self.sum[s, d]) / w if w > 0 else None

    def table(self) -> list[list[float | None]]:
        """``expected`` of every shape at once, indexed ``[s][d]`` (one tensor read instead of one per shape)."""
        means = (self.sum / self.weight.clamp(min=1e-30)).tolist()
        weights = self.weight.tolist()
        table = [[m if w > 0 else None for m, w in zip(row, wrow)] for row, wrow in zip(means, weights)]
        table[NO_SPECULATION[1]][NO_SPECULATION[0]] = 1.0
        return table

    def spread_table(self) -> list[list[float]]:
        """The standard deviation of a request's tokens per round, per shape, indexed ``[s][d]`` (0 where unseen;
        over requests and steps alike: a request that accepts more than the others drifts ahead too)."""
        w = self.weight.clamp(min=1e-30)
        return (self.squares / w - (self.sum / w).square()).clamp(min=0).sqrt().tolist()


@dataclass
class Curve:
    """Seconds as a function of one size (batch size or tokens): decayed samples at the sizes seen, linear in
    between, proportional beyond the ends."""

    points: dict[int, float] = field(default_factory=dict)

    def add(self, x: int, seconds: float) -> None:
        old = self.points.get(x)
        self.points[x] = seconds if old is None else (1 - TIME_EMA) * old + TIME_EMA * seconds

    def __call__(self, x: int) -> float | None:
        if not self.points:
            return None
        xs = sorted(self.points)
        if x in self.points:
            return self.points[x]
        i = bisect.bisect_left(xs, x)
        if i == 0:
            return self.points[xs[0]] * x / xs[0]
        if i == len(xs):
            return self.points[xs[-1]] * x / xs[-1]
        x0, x1 = xs[i - 1], xs[i]
        y0, y1 = self.points[x0], self.points[x1]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class TimeFit:
    """At one batch size: how served step times depart from the model, tracked from every shape's steps.

    ``log(served / modelled) = a + m + b * speculating + c * (D - 1) / 8 + e * S / 4 + f[shape] + noise``: ``a`` is
    how far off the model is overall, ``m`` the machine's passing speed (mean-reverting, fast), ``b, c, e`` what the
    model gets wrong about speculating, verifying and drafting, ``f`` a shape's own error; all but ``m`` move
    slowly. A Kalman filter tracks them (``FIT_*``). Why not each shape's own average of its steps: those are the
    few steps it ran, each off by 10-30 % on the CPU and taken at a different moment of a drifting machine, so the
    shapes' averages differ by more than the shapes do and the choice follows the noise (a shape timed in a slow
    stretch stays out of the choice). Here a slow stretch shows in every shape's steps and goes to ``m``, every step
    informs every shape through the shared terms, and a shape's own term grows only with its own steps.
    """

    SHARED = 5  # a, m, b, c, e

    def __init__(self):
        self.shapes: dict[tuple[int, int], int] = {}
        phi, innovation = FIT_MACHINE
        self.beta = np.zeros(self.SHARED)
        self.cov = np.diag(np.array([FIT_LEVEL_SD[0], innovation / math.sqrt(1 - phi ** 2)] + [FIT_SHARED_SD[0]] * 3)
                           ** 2)
        self.drift = np.array([FIT_LEVEL_SD[1], innovation] + [FIT_SHARED_SD[1]] * 3) ** 2
        self.coef = self.beta.tolist()

    def add(self, shape: tuple[int, int], log_ratio: float) -> None:
        """One served step's log(served / modelled). (numpy: these are a few dozen numbers, where torch's per-call
        overhead made an update cost 0.27 ms on the CPU.)"""
        if shape not in self.shapes:
            self.shapes[shape] = len(self.shapes)
            self.beta = np.append(self.beta, 0.0)
            self.cov = np.pad(self.cov, ((0, 1), (0, 1)))
            self.cov[-1, -1] = FIT_SHAPE_SD[0] ** 2
            self.drift = np.append(self.drift, FIT_SHAPE_SD[1] ** 2)
        phi = FIT_MACHINE[0]  # one step on: the machine term reverts towards 0, everything may have moved
        self.beta[1] *= phi
        self.cov[1, :] *= phi
        self.cov[:, 1] *= phi
        self.cov[np.diag_indices_from(self.cov)] += self.drift
        x = self._features(shape, machine=1.0)
        px = self.cov @ x
        spread = float(x @ px) + FIT_NOISE_SD ** 2
        # One outlier (a step stalled by something else on the machine) moves the terms by at most 3 sd of what
        # was expected; a real change takes a few steps.
        surprise = min(max(log_ratio - float(x @ self.beta), -3 * spread ** 0.5), 3 * spread ** 0.5)
        gain = px / spread
        self.beta += gain * surprise
        self.cov -= np.outer(gain, px)
        self.coef = self.beta.tolist()  # read by every prediction of the next choice

    @staticmethod
    def _terms(shape: tuple[int, int], machine: float) -> tuple[float, ...]:
        """The shared terms' features of ``shape`` (a, m, b, c, e); ``machine``: the weight of the machine term
        (1 for the step just served, its decay for the next one)."""
        d, s = shape
        return 1.0, machine, float(s > 0), (d - 1) / 8, s / 4

    def _features(self, shape: tuple[int, int], machine: float = FIT_MACHINE[0]) -> np.ndarray:
        """``shape``'s row: the shared terms (``machine`` as in ``_terms``; by default for the next step's
        prediction) and its own (if it has one yet)."""
        x = np.zeros(len(self.beta))
        x[:self.SHARED] = self._terms(shape, machine)
        if shape in self.shapes:
            x[self.SHARED + self.shapes[shape]] = 1.0
        return x

    def difference_sd(self, shape: tuple[int, int], other: tuple[int, int]) -> float:
        """How uncertain the fit is about ``log_ratio(shape) - log_ratio(other)``: the standard deviation of that
        difference under the filter's covariance, with each unserved shape's own term at its prior spread."""
        dx = self._features(shape) - self._features(other)
        unserved = len({s for s in (shape, other) if s not in self.shapes}) if shape != other else 0
        return math.sqrt(max(float(dx @ self.cov @ dx), 0.0) + unserved * FIT_SHAPE_SD[0] ** 2)

    def log_ratio(self, shape: tuple[int, int]) -> float:
        """The expected log(served / modelled) of ``shape``'s next step here."""
        b = self.coef
        own = b[self.SHARED + self.shapes[shape]] if shape in self.shapes else 0.0
        return sum(c * t for c, t in zip(b, self._terms(shape, machine=FIT_MACHINE[0]))) + own


@dataclass
class StepTimes:
    """The step-time model: draft (per depth S, over the batch size), verify (per verified tokens per request D,
    over the batch size; between two measured D linear in D), rest of the round incl. the scheduler (over the batch
    size).

    Verification is a function of B and D, not of B x D: the same number of verified tokens costs differently
    spread over more or fewer requests. In one startup measurement on the CPU (embedded model), 64 x 1 and 16 x 4
    verified tokens took 18.8 and 21.4 ms; a single curve over B x D, as the model had, gave 32 requests x 8
    nodes the time of 64 x 4, 43.7 ms, where the per-D curves give 50.9 (timed directly: 46-58 ms), so deep
    trees at batch 32 looked cheaper than they are."""

    draft: dict[int, Curve] = field(default_factory=dict)
    verify: dict[int, Curve] = field(default_factory=dict)
    rest: Curve = field(default_factory=Curve)
    # Whole steps as this server ran them, per (batch size, shape): each shape's own average (the record of what
    # was served, and the time where there is no model); and per batch size the fit that corrects the model.
    observed: dict[tuple[int, int, int], float] = field(default_factory=dict)
    fits: dict[int, TimeFit] = field(default_factory=dict)
    # The policy's step count (``clock``, set by the policy) when each observation was last updated.
    observed_at: dict[tuple[int, int, int], int] = field(default_factory=dict)
    clock: int = 0

    def observe(self, batch: int, shape: tuple[int, int], seconds: float) -> None:
        """A served step: into the fit at this batch size, and the shape's own average (for the policy's record
        of what it has served, and the time where there is no model)."""
        key = (batch, *shape)
        old = self.observed.get(key)
        self.observed[key] = seconds if old is None else (1 - TIME_EMA) * old + TIME_EMA * seconds
        self.observed_at[key] = self.clock
        model = self.model(batch, shape)
        if model and seconds > 0:
            fit = self.fits.get(batch)
            if fit is None:  # (not ``setdefault``: it would build a TimeFit on every step to throw it away)
                fit = self.fits[batch] = TimeFit()
            fit.add(shape, math.log(seconds / model))

    def predict(self, batch: int, shape: tuple[int, int]) -> float | None:
        """The model corrected by the fit at this batch size (at a batch size not yet served: the nearest one
        served); without a model, the shape's own observations."""
        model = self.model(batch, shape)
        if model is None:
            return self.observed.get((batch, *shape))
        fit = self.fits.get(batch)
        if fit is None and self.fits:
            fit = self.fits[min(self.fits, key=lambda b: abs(math.log(b / batch)))]
        return model if fit is None else model * math.exp(fit.log_ratio(shape))

    def verify_time(self, batch: int, d: int) -> float | None:
        if d in self.verify:  # the usual case: every D up to 8 is timed
            return self.verify[d](batch)
        return Curve({w: curve(batch) for w, curve in self.verify.items()})(d)  # in D, as a Curve interpolates

    def model(self, batch: int, shape: tuple[int, int]) -> float | None:
        d, s = shape
        verify = self.verify_time(batch, d)
        draft = 0.0 if s == 0 else (self.draft[s](batch) if s in self.draft else None)
        if verify is None or draft is None:
            return None
        return draft + verify + (self.rest(batch) or 0.0)

    def to_json(self) -> dict:
        return {"draft": {str(s): c.points for s, c in self.draft.items()},
                "verify": {str(d): c.points for d, c in self.verify.items()}, "rest": self.rest.points}

    @classmethod
    def from_json(cls, data: dict) -> "StepTimes":
        """Raises ``ValueError`` on a file of another layout (the cache is then measured again)."""
        def curve(points):
            if not isinstance(points, dict) or not all(isinstance(v, (int, float)) for v in points.values()):
                raise ValueError("not a step-time curve")
            return Curve({int(k): float(v) for k, v in points.items()})
        return cls({int(s): curve(p) for s, p in data["draft"].items()},
                   {int(d): curve(p) for d, p in data["verify"].items()}, curve(data["rest"]))


class AdaptivePolicy:
    def __init__(self, max_tokens: int, topk: int, max_steps: int, times: StepTimes):
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
        self.steps += 1
        self.times.clock = self.steps
        if self.steps <= WARMUP_STEPS:
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
        if best != explore and share and self.since_explore >= EXPLORE_SHARE * share and free and \
                self._may_explore(batch, best, self.since_explore >= EXPLORE_SHARE * EXPLORE_IDLE * share):
            best, self.exploring = explore, True
        elif best != NO_SPECULATION and self._baseline_due(batch):
            best = NO_SPECULATION
        elif self.since_probe >= PROBE_EVERY and free:
            if best != NO_SPECULATION or self._chance_to_pay(batch) >= PROBE_CHANCE:
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
        if not self.exploring and ran != self.largest and self.since_stats < STATS_EVERY:
            return
        accepts = counterfactual_accepts(tree, accepted_nodes, accept_lens, self.largest[1])
        self.stats.update(accepts, ran, decay=STATS_DECAY ** self.since_stats)
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
        tree has ``PROBE_CHANCE`` of paying (``_chance_to_pay``, re-evaluated every ``CHANCE_EVERY`` steps), or once
        it is ``EXPLORE_IDLE`` times overdue. Measured on the CPU at batch 32-64, where the policy ran 95-98 % of the
        steps without speculation: the speculative 2-4 % (explorations and probes) each let some requests run ahead
        of the rest of a batch whose requests would otherwise all finish in the same round, and those 2-4 % cost the
        adaptive server 4-6 % against plain decoding. The rare overdue run keeps the acceptance statistics from
        going stale on a server that only ever serves large batches."""
        if best != NO_SPECULATION or overdue:
            return True
        if self.steps - self._chance_at[0] >= CHANCE_EVERY or self._chance_at[1] != batch:
            self._chance_at = (self.steps, batch, self._chance_to_pay(batch))
        return self._chance_at[2] >= PROBE_CHANCE

    def _chance_to_pay(self, batch: int) -> float:
        """By the fit's uncertainty, the chance that the likeliest tree beats no speculation by the margin: where it
        is under ``PROBE_CHANCE`` (at batch 64 on the CPU, trees 30 % behind, or a tree a few percent behind whose
        time the fit knows well), a probe would cost a slower step and tell nothing new."""
        fit, rates = self.times.fits.get(batch), self._rates
        if fit is None or NO_SPECULATION not in rates:
            return 1.0
        bar = rates[NO_SPECULATION][0] * SPECULATION_MARGIN
        z = max((math.log(rate / bar) / max(fit.difference_sd(shape, NO_SPECULATION), 1e-6)
                 for shape, (rate, _) in rates.items() if shape != NO_SPECULATION), default=-math.inf)
        return 0.5 * math.erfc(-z / math.sqrt(2))

    def _explore_shape(self) -> tuple[int, int]:
        """The smallest shape whose runs refresh the acceptance statistics of every contender: the trees whose
        rate at the last decision is within ``EXPLORE_REACH`` of the best rate (baseline included). At small
        batches that is the largest shape; where every tree is far behind no speculation (batch 64 on the CPU,
        where a step of the largest shape costs about four plain steps) it is the best tree."""
        rates = self._rates
        trees = {s: r for s, (r, _) in rates.items() if s != NO_SPECULATION}
        if not trees:
            return self.largest
        top = max(r for r, _ in rates.values())
        contenders = [s for s, r in trees.items() if r * EXPLORE_REACH >= top] or [max(trees, key=trees.get)]
        shape = (max(d for d, _ in contenders), max(s for _, s in contenders))
        return shape if shape in self.menu else self.largest

    def _stalest_neighbour(self, batch: int, shape: tuple[int, int]) -> tuple[int, int] | None:
        """Of the shapes next to ``shape`` in the menu (D +- 1 or S +- 1; next to "no speculation": the smallest
        tree), the one observed at this batch size longest ago (never: first), unless all were observed within
        the last ``PROBE_EVERY`` steps."""
        d, s = shape
        near = [(2, 1)] if shape == NO_SPECULATION else [(d - 1, s), (d + 1, s), (d, s - 1), (d, s + 1)]
        near = [n for n in near if n in self.menu and n != NO_SPECULATION]
        seen = self.times.observed_at
        age = {n: self.steps - seen.get((batch, *n), -10 ** 9) for n in near}
        stalest = max(near, key=lambda n: age[n], default=None)
        return stalest if stalest is not None and age[stalest] >= PROBE_EVERY else None

    def _decide(self, batch: int, remaining: list[int] | None = None) -> tuple[tuple[int, int], float | None]:
        """The policy's own choice (before exploration and baseline probes) and its predicted step time: the best
        tree against the baseline, with the hysteresis of the module doc."""
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

            def pays(shape) -> bool:  # ties go to the baseline
                bar = stay_margin(batch) if speculating and shape in seen else SPECULATION_MARGIN
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
        (about a plain batch-of-one round). With the first term alone the charge at a wave's start was 4-7 % at
        ShareGPT batch 16 (from the server's debug log: D3 S1 1.73 +- 0.44 tokens per round, D3 S2 2.00 +- 0.85),
        under half the 12-25 % by which the rounds had flattered D2 S1 and D4 S2 there against the wall clock.
        Evaluated every ``LOCKSTEP_EVERY`` steps at one batch size (0.1-1.4 ms at batch 64 on the CPU), the tokens
        left every step."""
        trees = [shape for shape in rates if shape != NO_SPECULATION]
        at, at_batch, charges = self._lockstep_at
        if self.steps - at >= LOCKSTEP_EVERY or at_batch != batch or not all(t in charges for t in trees):
            spread = self.stats.spread_table()
            rounds = lockstep.overrun_rounds(remaining, [expected[s][d] for d, s in trees],
                                             [spread[s][d] for d, s in trees])
            plain = self.times.predict(1, NO_SPECULATION) or 0.0
            charges = {t: n * ((self.times.predict(1, t) or 0.0) + plain) for t, n in zip(trees, rounds)}
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

        The age is that of the baseline's last *observation at this batch size*, not of the last step without
        speculation anywhere: a serving run's tail (the batch shrinking request by request) decides "no
        speculation" at batch sizes seen for a step or two, which are never observed (the batch size changes
        between rounds); a shared counter reset by those steps kept the baseline at batch 32 from being measured
        again for a whole CPU run (one observation, from its first minute, against 400 of the tree's). A step
        chosen for the baseline but not observed (the round after a prefill, the first round at a new batch size)
        counts as a try: at batch 1-4, where requests come and go every few steps, retrying at once ran 15 % of the
        CPU's batch-4 steps without speculation, where speculation paid 13 %."""
        times = self.times
        observed = times.observed_at.get((batch, *NO_SPECULATION))
        tried = self.baseline_tried.get(batch, -10 ** 9)
        if observed is None:
            if self.steps - tried < BASELINE_RETRY:
                return False
        elif self.steps - max(observed, tried) < EXPLORE_SHARE:
            return False  # the usual case, without scanning the observations
        return any(key[0] == batch and key[1:] != NO_SPECULATION for key in times.observed)
