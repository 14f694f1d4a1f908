"""The adaptive budget's tunables, in one place. What each value rests on is in ``docs/adaptive_budget.md``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyConfig:
    """Every tunable of the policy, its step-time model, the lockstep charge and the startup measurement.

    Field names are upper case so that they read as the constants they are (``dataclasses.replace(DEFAULT, X=...)``;
    ``benchmark/adaptive_policy_sim.py --set X=...``)."""

    # --- when to speculate ---
    # A tree must be predicted this much faster than no speculation to be chosen from it: near a tie, prefill,
    # catch-up after a switch and noise favour plain decoding, which the default must never lose to.
    SPECULATION_MARGIN: float = 1.1
    # Once speculating, an observed tree stays while this much ahead of the baseline (``stay_margin``): the band's
    # lower edge, reached at STAY_MARGIN_BATCH; requests drifting apart cost a batch what its rounds do not show.
    STAY_MARGIN: float = 1.08
    # From this batch size on the lower edge is STAY_MARGIN; below it rises with log2 of the batch (1 at batch 1).
    STAY_MARGIN_BATCH: int = 16
    WARMUP_STEPS: int = 4  # the largest shape runs first, until the statistics have something to say

    # --- keeping the statistics and the step times fresh ---
    # A larger shape runs now and then, for about 1 / EXPLORE_SHARE of the time: the only source of statistics for
    # the shapes above the chosen one. Also the age at which the baseline's observation is measured again.
    EXPLORE_SHARE: int = 50
    # Exploration covers the shapes within this factor of the best rate: acceptance this much above the statistics'
    # is what it would take for such a shape to matter.
    EXPLORE_REACH: float = 1.5
    # Without a chance of paying (PROBE_CHANCE), exploration from "no speculation" runs at 1 / EXPLORE_IDLE of its
    # share: rare enough to leave a batch in step, often enough to keep the statistics from going stale.
    EXPLORE_IDLE: int = 8
    # Steps between two neighbour probes: close shapes stay served and their terms current, at little cost.
    PROBE_EVERY: int = 32
    # From no speculation, probe or explore only where a tree has at least this chance of clearing the margin:
    # otherwise the slower step tells nothing new and lets the batch's requests drift apart.
    PROBE_CHANCE: float = 0.1
    CHANCE_EVERY: int = 8  # steps between two evaluations of that chance (each costs a fraction of a ms)
    BASELINE_RETRY: int = 8  # steps between tries at the baseline's first observation (tries may go unobserved)
    LOCKSTEP_EVERY: int = 4  # steps between two evaluations of the lockstep charge at one batch size (its cost)

    # --- acceptance statistics ---
    STATS_DECAY: float = 0.98  # per step: the statistics follow the traffic of the last ~50 steps
    STATS_EVERY: int = 4  # statistics from every 4th step: a sample says as much, at a quarter of the work

    # --- the step-time model ---
    TIME_EMA: float = 0.2  # weight of a new timing against a curve point's or a shape's average
    # The per-batch-size correction (``TimeFit``) in log(served / modelled), as (sd at first, drift per served
    # step): the level (how far off the model is), the shared terms (speculating, verifying, drafting), each shape.
    FIT_LEVEL_SD: tuple[float, float] = (1.0, 0.01)
    FIT_SHARED_SD: tuple[float, float] = (0.5, 0.01)
    FIT_SHAPE_SD: tuple[float, float] = (0.3, 0.005)
    # The machine's passing speed, mean-reverting: (correlation from one step to the next, innovation per step).
    FIT_MACHINE: tuple[float, float] = (0.95, 0.08)
    FIT_NOISE_SD: float = 0.12  # one served step's own noise

    # --- the lockstep charge: the integral over the batch's last finishing round ---
    OVERRUN_GRID_POINTS: int = 41  # enough for the integral to be accurate to a fraction of a percent
    OVERRUN_GRID_SD: float = 6.0  # its span, in standard deviations of the widest request: the maximum lies inside

    # --- the startup measurement ---
    MEASURE_BATCHES: tuple[int, ...] = (1, 4, 16, 64)  # batch sizes timed (plus the largest); curves interpolate
    MEASURE_CONTEXT: int = 96  # committed tokens per synthetic request: crosses the embedded model's CSA/HCA blocks
    # Passes over the whole grid, each point keeping its fastest: contention lasts seconds, so passes seconds apart
    # mostly miss it where back-to-back repeats would share it.
    MEASURE_PASSES: int = 10
    # On a GPU: a GPU's step times are steadier, and every shape costs a capture-free eager step of ~10^4 launches,
    # so fewer passes and fewer shapes (the ends of S, powers of two in D; the model interpolates between them)
    # keep startup under a minute (``measure.startup_plan``).
    MEASURE_PASSES_GPU: int = 3


DEFAULT = PolicyConfig()
