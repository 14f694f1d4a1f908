"""What the adaptive budget would choose for DeepSeek-V4-Flash on GPUs: the server's own policy
(``speculative.adaptive.AdaptivePolicy``) fed with the cost model's step times at V4-Flash shapes
(``cost_model.GpuAssumptions``: 4 x H200, TP4, stated, not measured) and the accept lengths the CPU sweep measured
for the fixed shapes (accept lengths depend on model and data, not on the hardware).

    python benchmark/adaptive_policy_gpu.py benchmark/results/adaptive_vs_none_cpu.jsonl [--batch-sizes 1 4 16 32 64]

Prints, per dataset and batch size, the shape the policy picks and the predicted tokens/s of every candidate
(no speculation and each fixed tree shape of the sweep), as a markdown table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402
from cost_model import GpuAssumptions, step_ms  # noqa: E402

from sglang_tree_v4.speculative.adaptive import DEFAULT, NO_SPECULATION, AdaptivePolicy  # noqa: E402


class CostModelTimes:
    """``StepTimes``' interface over the stated GPU cost model (seconds per step of a shape)."""

    def __init__(self, cost: GpuAssumptions, topk: dict[tuple[int, int], int], accept: dict[tuple[int, int], float]):
        self.cost, self.topk, self.accept = cost, topk, accept
        self.observed: dict = {}  # nothing is served here: the policy compares the model's times only
        self.observed_at: dict = {}

    def predict(self, batch: int, shape: tuple[int, int]) -> float | None:
        if shape == NO_SPECULATION:
            return step_ms(self.cost, "none", 1, 0, 0, batch, 1.0) / 1e3
        if shape not in self.topk:
            return None
        d, s = shape
        return step_ms(self.cost, "tree", d, self.topk[shape], s, batch, self.accept[shape]) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", type=Path)
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16, 32, 64])
    args = ap.parse_args()
    rows = [r for r in bc.load_records(args.sweep) if r["shape"] == "tree"]
    print("| dataset | batch | policy picks | none | " + " | ".join(
        f"D{d} K{k} S{s}" for d, k, s in sorted({(r["budget"], r["topk"], r["num_steps"]) for r in rows})) + " |")
    shapes = sorted({(r["budget"], r["topk"], r["num_steps"]) for r in rows})
    print("|---|---|---|---|" + "---|" * len(shapes))
    for ds in sorted({r["dataset"] for r in rows}):
        accept = {(d, s): statistics.fmean(r["accept_length"] for r in rows if r["dataset"] == ds
                                           and (r["budget"], r["topk"], r["num_steps"]) == (d, k, s))
                  for d, k, s in shapes}
        topk = {(d, s): k for d, k, s in shapes}
        times = CostModelTimes(GpuAssumptions(), topk, accept)
        for b in args.batch_sizes:
            policy = AdaptivePolicy(max(d for d, _, _ in shapes), max(k for _, k, _ in shapes),
                                    max(s for _, _, s in shapes), times)
            policy.menu = [NO_SPECULATION] + [(d, s) for d, _, s in shapes]
            for (d, s), a in accept.items():
                policy.stats.sum[s, d], policy.stats.weight[s, d] = a, 1.0
            policy.steps = DEFAULT.WARMUP_STEPS  # past the warm-up, not at an exploration step
            pick = policy.choose(b)
            rates = [b / times.predict(b, NO_SPECULATION)] + [b * accept[(d, s)] / times.predict(b, (d, s))
                                                              for d, _, s in shapes]
            name = "none" if pick == NO_SPECULATION else f"D{pick[0]} S{pick[1]}"
            print(f"| {ds} | {b} | {name} | " + " | ".join(f"{x:,.0f}" for x in rates) + " |")


if __name__ == "__main__":
    main()
