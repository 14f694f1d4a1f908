"""Throughput of a ``sweep.py --servers`` run: one line per server against the batch size, one panel per dataset,
each point the median of its repeats with the spread of the repeats as its bar; and the Markdown table for RESULTS
(median, spread in brackets, accept length; the adaptive server against the best fixed server at each point).

    python benchmark/plot_servers.py benchmark/results/dspark_throughput_cpu.jsonl [--out NAME.png]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402
from bar_noise import points, ratio_interval  # noqa: E402
from plot import save_batch_panels  # noqa: E402

STYLE = {"tree": ("tab:green", "o-"), "chain": ("tab:blue", "s-"), "none": ("tab:gray", "^-"),
         "adaptive": ("tab:red", "D-"), "mtp_tree": ("tab:purple", "v--")}


def label(r: dict) -> str:
    """A server's name in the plot and the table."""
    if r["shape"] == "none":
        return "none"
    name = {"tree": "DSpark tree", "chain": "DSpark chain", "mtp_tree": "MTP tree",
            "adaptive": "adaptive"}.get(r["shape"], r["shape"])
    return f"{name} D{r['budget']} K{r['topk']} S{r['num_steps']}"


def servers(records: list[dict]) -> list[str]:
    order = {s: i for i, s in enumerate(STYLE)}
    seen = {label(r): (order.get(r["shape"], 9), r["budget"]) for r in records}
    return sorted(seen, key=lambda k: seen[k])


def plot(records: list[dict], out: Path) -> Path:
    datasets = sorted({r["dataset"] for r in records})
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.6 * len(datasets), 3.8), squeeze=False)
    shape_of = {label(r): r["shape"] for r in records}
    names = servers(records)
    for ax, ds in zip(axes[0], datasets, strict=True):
        for name in names:
            pts = sorted((r["batch_size"], bc.throughput_runs(r), r["shape"]) for r in records
                         if r["dataset"] == ds and label(r) == name)
            if not pts:
                continue
            color, fmt = STYLE.get(pts[0][2], ("black", "o-"))
            # a second server of the same shape (another budget): dotted
            if [n for n in names if shape_of[n] == shape_of[name]].index(name) > 0:
                fmt = fmt[0] + ":"
            xs = [p[0] for p in pts]
            med = [statistics.median(p[1]) for p in pts]
            err = [[m - min(p[1]) for m, p in zip(med, pts, strict=True)],
                   [max(p[1]) - m for m, p in zip(med, pts, strict=True)]]
            ax.errorbar(xs, med, yerr=err, fmt=fmt, color=color, capsize=2, label=name, markersize=4)
        ax.set_title(ds)
    save_batch_panels(fig, axes, out)
    return out


def table(records: list[dict]) -> str:
    """Per dataset and batch size: each server's median throughput [min-max of the repeats] and accept length,
    the adaptive server's median over the best fixed server's, and that ratio's bootstrap interval
    (``ratio_interval``)."""
    names = servers(records)
    fixed = [n for n in names if not n.startswith("adaptive")]
    lines = ["| dataset | batch | " + " | ".join(names) + " | adaptive / best | 90 % interval |",
             "|---|---|" + "---|" * (len(names) + 2)]
    for ds in sorted({r["dataset"] for r in records}):
        for bs in sorted({r["batch_size"] for r in records if r["dataset"] == ds}):
            at = {label(r): r for r in records if r["dataset"] == ds and r["batch_size"] == bs}
            cells, med = [], {}
            for n in names:
                r = at.get(n)
                if r is None:
                    cells.append("")
                    continue
                xs = bc.throughput_runs(r)
                med[n] = statistics.median(xs)
                cells.append(f"{med[n]:.0f} [{min(xs):.0f}-{max(xs):.0f}] ({r['accept_length']:.2f})")
            best_name = max((n for n in fixed if n in med), key=lambda n: med[n], default=None)
            adaptive_name = next((n for n in names if n.startswith("adaptive") and n in med), None)
            ratio = interval = ""
            if best_name and adaptive_name:
                ratio = f"{med[adaptive_name] / med[best_name]:.2f}"
                lo, hi = ratio_interval(bc.throughput_runs(at[adaptive_name]),
                                        [bc.throughput_runs(at[n]) for n in fixed if n in at])
                interval = f"{lo:.2f}-{hi:.2f}"
            lines.append(f"| {ds} | {bs} | " + " | ".join(cells) + f" | {ratio} | {interval} |")
    return "\n".join(lines)


def batch_summary(records: list[dict]) -> str:
    """Per batch size: the adaptive server's median over the best fixed server's, as the geometric mean over the
    datasets and the lowest of them."""
    ratios: dict[int, list[float]] = {}
    for _, bs, adaptive, fixed in points(records):
        ratios.setdefault(bs, []).append(statistics.median(adaptive) / max(statistics.median(xs) for xs in fixed))
    lines = ["| batch | adaptive / best, geometric mean over datasets | lowest |", "|---|---|---|"]
    for bs, xs in sorted(ratios.items()):
        lines.append(f"| {bs} | {statistics.geometric_mean(xs):.2f} | {min(xs):.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl")
    ap.add_argument("--out", default=None, help="the PNG (default: next to the JSONL, same name)")
    a = ap.parse_args()
    records = bc.load_records(a.jsonl)
    out = Path(a.out) if a.out else Path(a.jsonl).with_suffix(".png")
    print("wrote", plot(records, out))
    print(table(records))
    print(batch_summary(records))


if __name__ == "__main__":
    main()
