"""How often a sweep's own noise puts a good adaptive server under a bar, from the sweep's runs.

    python benchmark/bar_noise.py benchmark/results/dspark_adaptive_repeats5_cpu.jsonl [--bar 0.9] [--share 0.97]

Why: a ``sweep.py --servers`` point compares the adaptive server's median run with the best of the fixed servers'
medians. Each median carries the machine's noise, and the best of several noisy medians sits above the best
server's true speed, so an adaptive server as fast as the best server less its own overhead still scores under a
bar like 0.9 at some points. This script states how often, on the sweep's own noise: every server's runs give a
pooled log-normal spread (each run against its point's median, corrected for the median's degrees of freedom);
at each point the fixed servers' medians are taken as their true speeds, and an adaptive server at ``--share`` of
the best is simulated with the point's number of repeats. Printed: the pooled spread, then per point the chance of
a ratio under ``--bar``, and the expected number of points under it against the number the sweep measured.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402


def ratio_interval(adaptive: list[float], fixed: list[list[float]], reps: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """The 5th and 95th percentiles of the adaptive server's median over the best fixed server's median when each
    server's runs are resampled with replacement (a bootstrap). The point ratio is the maximum of several noisy
    medians in its denominator, so it sits below what the adaptive server would score against the true best; the
    interval says how far the runs' own spread moves it."""
    rng = random.Random(seed)

    def median_of_resample(xs: list[float]) -> float:
        return statistics.median(rng.choice(xs) for _ in xs)

    ratios = sorted(median_of_resample(adaptive) / max(median_of_resample(xs) for xs in fixed)
                    for _ in range(reps))
    return ratios[int(0.05 * reps)], ratios[int(0.95 * reps) - 1]


def points(records: list[dict]) -> list[tuple[str, int, list[float], list[list[float]]]]:
    """Per dataset and batch size with an adaptive server: (dataset, batch size, the adaptive server's runs, each
    fixed server's runs)."""
    out = []
    for ds in sorted({r["dataset"] for r in records}):
        for bs in sorted({r["batch_size"] for r in records if r["dataset"] == ds}):
            at = [r for r in records if r["dataset"] == ds and r["batch_size"] == bs]
            adaptive = [bc.throughput_runs(r) for r in at if r["shape"] == "adaptive"]
            fixed = [bc.throughput_runs(r) for r in at if r["shape"] != "adaptive"]
            if adaptive and fixed:
                out.append((ds, bs, adaptive[0], fixed))
    return out


def pooled_log_sd(records: list[dict]) -> float:
    """The spread of one run around its point's median, in log: pooled over every server and point with more
    than one run (squares over n - 1)."""
    squares, dof = 0.0, 0
    for r in records:
        xs = bc.throughput_runs(r)
        if len(xs) < 2:
            continue
        mid = math.log(statistics.median(xs))
        squares += sum((math.log(x) - mid) ** 2 for x in xs)
        dof += len(xs) - 1
    return math.sqrt(squares / dof) if dof else 0.0


def chance_under(fixed: list[float], share: float, bar: float, repeats: int, sd: float, trials: int,
                 rng: random.Random) -> float:
    """The chance that an adaptive server at ``share`` of the best of ``fixed`` (true speeds) scores a median
    under ``bar`` times the best of the fixed servers' medians, ``repeats`` runs each with log-normal noise."""
    def med(speed: float) -> float:
        return statistics.median(speed * math.exp(rng.gauss(0.0, sd)) for _ in range(repeats))

    truth = share * max(fixed)
    return sum(med(truth) < bar * max(med(x) for x in fixed) for _ in range(trials)) / trials


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl")
    ap.add_argument("--bar", type=float, default=0.9)
    ap.add_argument("--share", type=float, default=0.97, help="the simulated adaptive server's true speed over the "
                    "best fixed server's")
    ap.add_argument("--trials", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    records = bc.load_records(a.jsonl)
    sd = pooled_log_sd(records)
    rng = random.Random(a.seed)
    print(f"pooled spread of one run: {sd:.3f} (log)")
    expected = measured = 0.0
    for ds, bs, adaptive, fixed_runs in points(records):
        fixed = [statistics.median(xs) for xs in fixed_runs]
        p = chance_under(fixed, a.share, a.bar, len(adaptive), sd, a.trials, rng)
        ratio = statistics.median(adaptive) / max(fixed)
        expected += p
        measured += ratio < a.bar
        print(f"{ds} {bs}: P(under {a.bar}) {p:.2f}; measured {ratio:.2f}")
    print(f"points under {a.bar}: expected {expected:.1f} for a server at {a.share} of the best, measured "
          f"{measured:.0f}")


if __name__ == "__main__":
    main()
