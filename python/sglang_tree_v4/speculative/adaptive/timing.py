"""The step-time model: startup curves (``measure``) for draft, verify and the rest of a round, corrected per batch
size by a Kalman filter over the steps the server actually served (``TimeFit``).

The startup curves are not refreshed from served steps: a point refreshed in a slow stretch of the machine would
keep that stretch for as long as its shape does not run again. The filter instead puts a slow stretch into a term
that every shape shares and that decays on its own.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np

from .config import DEFAULT, PolicyConfig


@dataclass
class Curve:
    """Seconds as a function of one size (batch size or tokens): decayed samples at the sizes seen, linear in
    between, proportional beyond the ends."""

    points: dict[int, float] = field(default_factory=dict)

    def add(self, x: int, seconds: float, weight: float = DEFAULT.TIME_EMA) -> None:
        """``weight``: the new timing's against the point's value (``TIME_EMA``)."""
        old = self.points.get(x)
        self.points[x] = seconds if old is None else (1 - weight) * old + weight * seconds

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
    slowly (``FIT_*``). Not each shape's own average: a shape's few steps each carry the machine's speed at their
    moment, so averages differ by more than the shapes do. Here a slow stretch goes to ``m``, every step informs
    every shape through the shared terms, and a shape's own term grows only with its own steps.
    """

    SHARED = 5  # a, m, b, c, e

    def __init__(self, config: PolicyConfig = DEFAULT):
        self.config = config
        self.shapes: dict[tuple[int, int], int] = {}
        phi, innovation = config.FIT_MACHINE
        level, shared = config.FIT_LEVEL_SD, config.FIT_SHARED_SD
        self.beta = np.zeros(self.SHARED)
        self.cov = np.diag(np.array([level[0], innovation / math.sqrt(1 - phi ** 2)] + [shared[0]] * 3) ** 2)
        self.drift = np.array([level[1], innovation] + [shared[1]] * 3) ** 2
        self.coef = self.beta.tolist()

    def add(self, shape: tuple[int, int], log_ratio: float) -> None:
        """One served step's log(served / modelled). (numpy: these are a few dozen numbers, where torch's per-call
        overhead would dominate the update.)"""
        config = self.config
        if shape not in self.shapes:
            self.shapes[shape] = len(self.shapes)
            self.beta = np.append(self.beta, 0.0)
            self.cov = np.pad(self.cov, ((0, 1), (0, 1)))
            self.cov[-1, -1] = config.FIT_SHAPE_SD[0] ** 2
            self.drift = np.append(self.drift, config.FIT_SHAPE_SD[1] ** 2)
        phi = config.FIT_MACHINE[0]  # one step on: the machine term reverts towards 0, everything may have moved
        self.beta[1] *= phi
        self.cov[1, :] *= phi
        self.cov[:, 1] *= phi
        self.cov[np.diag_indices_from(self.cov)] += self.drift
        x = self._features(shape, machine=1.0)
        px = self.cov @ x
        spread = float(x @ px) + config.FIT_NOISE_SD ** 2
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

    def _features(self, shape: tuple[int, int], machine: float | None = None) -> np.ndarray:
        """``shape``'s row: the shared terms (``machine`` as in ``_terms``; by default for the next step's
        prediction) and its own (if it has one yet)."""
        x = np.zeros(len(self.beta))
        x[:self.SHARED] = self._terms(shape, self.config.FIT_MACHINE[0] if machine is None else machine)
        if shape in self.shapes:
            x[self.SHARED + self.shapes[shape]] = 1.0
        return x

    def difference_sd(self, shape: tuple[int, int], other: tuple[int, int]) -> float:
        """How uncertain the fit is about ``log_ratio(shape) - log_ratio(other)``: the standard deviation of that
        difference under the filter's covariance, with each unserved shape's own term at its prior spread."""
        dx = self._features(shape) - self._features(other)
        unserved = len({s for s in (shape, other) if s not in self.shapes}) if shape != other else 0
        return math.sqrt(max(float(dx @ self.cov @ dx), 0.0) + unserved * self.config.FIT_SHAPE_SD[0] ** 2)

    def log_ratio(self, shape: tuple[int, int]) -> float:
        """The expected log(served / modelled) of ``shape``'s next step here."""
        b = self.coef
        own = b[self.SHARED + self.shapes[shape]] if shape in self.shapes else 0.0
        return sum(c * t for c, t in zip(b, self._terms(shape, machine=self.config.FIT_MACHINE[0]), strict=False)) + own


@dataclass
class StepTimes:
    """The step-time model: draft (per depth S, over the batch size), verify (per verified tokens per request D,
    over the batch size; between two measured D linear in D), rest of the round incl. the scheduler (over the batch
    size). Verification is a function of B and D, not of B x D: the same number of verified tokens costs
    differently spread over more or fewer requests."""

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
    config: PolicyConfig = field(default=DEFAULT, repr=False, compare=False)  # TIME_EMA and the fit's FIT_*

    def observe(self, batch: int, shape: tuple[int, int], seconds: float) -> None:
        """A served step: into the fit at this batch size, and the shape's own average (for the policy's record
        of what it has served, and the time where there is no model)."""
        key = (batch, *shape)
        old = self.observed.get(key)
        ema = self.config.TIME_EMA
        self.observed[key] = seconds if old is None else (1 - ema) * old + ema * seconds
        self.observed_at[key] = self.clock
        model = self.model(batch, shape)
        if model and seconds > 0:
            fit = self.fits.get(batch)
            if fit is None:  # (not ``setdefault``: it would build a TimeFit on every step to throw it away)
                fit = self.fits[batch] = TimeFit(self.config)
            fit.add(shape, math.log(seconds / model))

    def observe_rest(self, batch: int, seconds: float) -> None:
        """A served round's time outside its draft and verify (acceptance, commit, the scheduler's share)."""
        self.rest.add(batch, seconds, self.config.TIME_EMA)

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
    def from_json(cls, data: dict, config: PolicyConfig = DEFAULT) -> "StepTimes":
        """Raises ``ValueError`` on a file of another layout (the cache is then measured again)."""
        def curve(points):
            if not isinstance(points, dict) or not all(isinstance(v, (int, float)) for v in points.values()):
                raise ValueError("not a step-time curve")
            return Curve({int(k): float(v) for k, v in points.items()})
        return cls({int(s): curve(p) for s, p in data["draft"].items()},
                   {int(d): curve(p) for d, p in data["verify"].items()}, curve(data["rest"]), config=config)
