"""Adaptive budget vs no speculation vs the best fixed shape, from one side-by-side sweep.

    python benchmark/adaptive_report.py benchmark/results/adaptive_vs_none_cpu.jsonl
        [--png benchmark/results/adaptive_vs_none_cpu.png]

Per dataset and batch size: throughput of no speculation, of the best fixed tree shape at that point, of the
adaptive default, the ratio adaptive / max(none, best fixed) (the bar is >= 0.95), and the shapes the adaptive
server ran (steps per shape, from ``/get_server_info`` before and after the point). Markdown on stdout.

With ``--repeats`` of 4 or more the noise floor of the per-point bar is printed too: at each point, the fastest
non-adaptive server's runs split into odd and even ones, and the ratio of the two halves' medians (the smaller over
the larger). A policy that ran exactly that server's shape would meet the bar no better than these ratios do.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402


def rows_of(records: list[dict]) -> list[dict]:
    out = []
    for ds in sorted({r["dataset"] for r in records}):
        for bs in sorted({r["batch_size"] for r in records}):
            point = [r for r in records if r["dataset"] == ds and r["batch_size"] == bs]
            none = next((r for r in point if r["shape"] == "none"), None)
            adaptive = next((r for r in point if r["shape"] == "adaptive"), None)
            fixed = [r for r in point if r["shape"] in ("tree", "chain")]
            if none is None or adaptive is None or not fixed:
                continue
            best = max(fixed, key=lambda r: r["output_throughput"])
            base = max(none["output_throughput"], best["output_throughput"])
            steps = adaptive.get("shape_steps") or {}
            total = sum(steps.values()) or 1
            mix = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(steps.items(), key=lambda kv: -kv[1])[:3])
            fastest = max([none] + fixed, key=lambda r: r["output_throughput"])
            out.append({"replica": replica_ratio(fastest.get("output_throughput_runs") or []),
                        "dataset": ds, "batch_size": bs, "none": none["output_throughput"],
                        "best_fixed": best["output_throughput"],
                        "best_fixed_shape": f"D{best['budget']} K{best['topk']} S{best['num_steps']}",
                        "adaptive": adaptive["output_throughput"], "ratio": adaptive["output_throughput"] / base,
                        "adaptive_accept": adaptive["accept_length"], "mix": mix})
    return out


def replica_ratio(runs: list[float]) -> float | None:
    """One server's odd runs against its even runs (median over median, the smaller over the larger)."""
    if len(runs) < 4:
        return None
    a, b = statistics.median(runs[0::2]), statistics.median(runs[1::2])
    return min(a, b) / max(a, b)


def markdown(rows: list[dict]) -> str:
    lines = ["| dataset | batch | none tok/s | best fixed tok/s (shape) | adaptive tok/s | adaptive / max | "
             "adaptive accept | adaptive's shapes (top 3) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dataset']} | {r['batch_size']} | {r['none']:.0f} | {r['best_fixed']:.0f} "
                     f"({r['best_fixed_shape']}) | {r['adaptive']:.0f} | {r['ratio']:.2f} | "
                     f"{r['adaptive_accept']:.2f} | {r['mix']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    datasets = sorted({r["dataset"] for r in rows})
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4), squeeze=False)
    for ax, ds in zip(axes[0], datasets, strict=False):
        pts = [r for r in rows if r["dataset"] == ds]
        bs = [r["batch_size"] for r in pts]
        for key, label in (("none", "no speculation"), ("best_fixed", "best fixed shape"), ("adaptive", "adaptive")):
            ax.plot(bs, [r[key] for r in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(ds)
        ax.set_xlabel("batch size")
        ax.set_ylabel("output tokens/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", type=Path)
    ap.add_argument("--png", type=Path, default=None)
    args = ap.parse_args()
    rows = rows_of(bc.load_records(args.sweep))
    print(markdown(rows))
    ratios = sorted(r["ratio"] for r in rows)
    print(f"\nadaptive / max(none, best fixed): min {ratios[0]:.2f}, median {ratios[len(ratios) // 2]:.2f} "
          f"over {len(rows)} points")
    replicas = sorted(r["replica"] for r in rows if r["replica"] is not None)
    if replicas:
        print(f"noise floor, the fastest non-adaptive server's odd runs against its even runs: min {replicas[0]:.2f}, "
              f"median {replicas[len(replicas) // 2]:.2f}; {sum(x < 0.95 for x in replicas)} of {len(replicas)} "
              f"points under 0.95")
    if args.png:
        plot(rows, args.png)


if __name__ == "__main__":
    main()
