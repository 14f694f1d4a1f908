"""``benchmark/bar_noise.py``: the statistics behind the adaptive server's bar in a sweep's table (the pooled spread
of one run, the chance that noise alone puts a server under the bar, the bootstrap interval of the ratio)."""
from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
from bar_noise import chance_under, points, pooled_log_sd, ratio_interval  # noqa: E402


def _record(runs: list[float], shape: str = "tree", dataset: str = "gsm8k", batch: int = 1) -> dict:
    return {"shape": shape, "output_throughput": runs[0], "output_throughput_runs": runs, "dataset": dataset,
            "batch_size": batch}


def test_points_pair_the_adaptive_server_with_the_fixed_ones_and_skip_points_without_it():
    records = [_record([10.0], "adaptive"), _record([12.0]), _record([9.0], "none"),
               _record([5.0], batch=4),  # no adaptive server at batch 4
               _record([7.0], "adaptive", "mbpp", 2), _record([8.0], dataset="mbpp", batch=2)]
    assert points(records) == [("gsm8k", 1, [10.0], [[12.0], [9.0]]), ("mbpp", 2, [7.0], [[8.0]])]


def test_pooled_spread_is_each_runs_log_distance_from_its_median():
    s = 0.1
    records = [_record([100 * math.exp(-s), 100, 100 * math.exp(s)]),
               _record([50 * math.exp(-s), 50, 50 * math.exp(s)]),
               _record([80])]  # one run: no spread to pool
    assert pooled_log_sd(records) == pytest.approx(s)


def test_without_noise_the_bar_decides_exactly():
    rng = random.Random(0)
    assert chance_under([1.0, 0.9], share=0.95, bar=0.9, repeats=3, sd=0.0, trials=50, rng=rng) == 0.0
    assert chance_under([1.0, 0.9], share=0.85, bar=0.9, repeats=3, sd=0.0, trials=50, rng=rng) == 1.0


def test_noise_puts_a_good_server_under_the_bar_more_often_among_tied_servers():
    """The best of several noisy medians sits above the true best: with four tied servers a server at 0.97 of
    them falls under 0.9 more often than against one clear best; more repeats make it rarer."""
    rng = random.Random(1)
    tied = chance_under([1.0] * 4, 0.97, 0.9, 3, 0.1, 3000, rng)
    clear = chance_under([1.0, 0.6, 0.6, 0.6], 0.97, 0.9, 3, 0.1, 3000, rng)
    more = chance_under([1.0] * 4, 0.97, 0.9, 9, 0.1, 3000, rng)
    assert clear < tied and more < tied, (clear, tied, more)
    assert 0.05 < clear < 0.5


def test_ratio_interval_holds_the_ratio_and_narrows_without_spread():
    lo, hi = ratio_interval([90.0, 90.0, 90.0], [[100.0, 100.0, 100.0], [80.0, 80.0, 80.0]])
    assert lo == pytest.approx(0.9) and hi == pytest.approx(0.9)
    lo, hi = ratio_interval([80.0, 90.0, 100.0], [[90.0, 100.0, 110.0]])
    assert lo < 0.9 < 1.0 < hi
