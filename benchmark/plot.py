"""Plots of a sweep's JSONL: accept length vs budget (tree vs chain, per dataset), throughput vs batch size, and
the tree/chain throughput-ratio heat map. PNGs go next to the JSONL unless ``--out-dir`` says otherwise.

    python benchmark/plot.py benchmark/results/tree_vs_chain_cpu.jsonl [--out-dir benchmark/results]

Accept length per (dataset, budget, shape) pools every batch size's requests (greedy decoding makes it independent
of batching), weighted by request count.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

COLORS = {"tree": "tab:green", "chain": "tab:blue", "none": "tab:gray"}


def pooled_accept(records: list[dict]) -> dict[tuple[str, int, str], float]:
    """(dataset, budget, shape) -> request-weighted mean accept length over batch sizes (grid shapes only)."""
    num, den = defaultdict(float), defaultdict(int)
    for r in records:
        if r["shape"] in ("tree", "chain"):
            k = (r["dataset"], r["budget"], r["shape"])
            num[k] += r["accept_length"] * r["num_requests"]
            den[k] += r["num_requests"]
    return {k: num[k] / den[k] for k in num}


def grid_records(records: list[dict]) -> list[dict]:
    """One tree per point: where a file holds several tree shapes for the same (dataset, budget, batch size) (a
    ``--tree-shapes`` run), keep the per-budget rule's (``bench_common.tree_shape``); chains and no-spec stay."""
    shapes: dict[tuple, set] = defaultdict(set)
    for r in records:
        if r["shape"] == "tree":
            shapes[(r["dataset"], r["budget"], r["batch_size"])].add((r["topk"], r["num_steps"]))
    return [r for r in records if r["shape"] != "tree" or len(shapes[(r["dataset"], r["budget"], r["batch_size"])]) == 1
            or (r["topk"], r["num_steps"]) == bc.tree_shape(r["budget"])]


def plot_accept(records: list[dict], out: Path) -> Path:
    acc = pooled_accept(records)
    datasets = sorted({k[0] for k in acc})
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 3.6), squeeze=False, sharey=True)
    for ax, ds in zip(axes[0], datasets, strict=False):
        for shape in ("tree", "chain"):
            pts = sorted((d, v) for (dd, d, s), v in acc.items() if dd == ds and s == shape)
            if pts:
                ax.plot(*zip(*pts, strict=False), "o-", color=COLORS[shape], label=shape)
        ax.set_xticks(sorted({k[1] for k in acc if k[0] == ds}))
        ax.set_title(ds)
        ax.set_xlabel("budget D (tokens verified per request per pass)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accept length (tokens per verify pass)")
    axes[0][0].legend()
    fig.tight_layout()
    path = out / "tree_vs_chain_accept.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_throughput(records: list[dict], out: Path) -> Path:
    datasets = sorted({r["dataset"] for r in records})
    budgets = sorted({r["budget"] for r in records if r["shape"] != "none"})
    show = [b for b in (budgets[0], budgets[-1]) if b] if budgets else []
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 3.6), squeeze=False)
    for ax, ds in zip(axes[0], datasets, strict=False):
        for shape in ("tree", "chain"):
            for d in sorted(set(show)):
                pts = sorted((r["batch_size"], r["output_throughput"]) for r in records
                             if r["dataset"] == ds and r["shape"] == shape and r["budget"] == d)
                if pts:
                    ax.plot(*zip(*pts, strict=False), "o-" if d == show[-1] else "s--", color=COLORS[shape],
                            alpha=1.0 if d == show[-1] else 0.55, label=f"{shape} D={d}")
        pts = sorted((r["batch_size"], r["output_throughput"]) for r in records
                     if r["dataset"] == ds and r["shape"] == "none")
        if pts:
            ax.plot(*zip(*pts, strict=False), "^-", color=COLORS["none"], label="no speculation")
        ax.set_title(ds)
    path = out / "tree_vs_chain_throughput.png"
    save_batch_panels(fig, axes, path)
    return path


def save_batch_panels(fig, axes, path: Path, ylabel: str = "output throughput (tokens/s)",
                      xlabel: str = "batch size (requests in flight)") -> None:
    """Panels of some quantity against the batch size (log 2), the legend in the first: finish and write them."""
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ratio_grid(records: list[dict], ds: str, key: str = "output_throughput") -> tuple[list[int], list[int], list]:
    """(budgets, batch sizes, rows of tree/chain ratios or None) for one dataset."""
    val = {(r["budget"], r["batch_size"], r["shape"]): r[key] for r in records if r["dataset"] == ds}
    budgets = sorted({b for b, _, s in val if s == "tree"})
    sizes = sorted({n for _, n, s in val if s == "tree"})
    rows = [[(val[(b, n, "tree")] / val[(b, n, "chain")]) if (b, n, "tree") in val and (b, n, "chain") in val
             and val[(b, n, "chain")] else None for n in sizes] for b in budgets]
    return budgets, sizes, rows


def plot_ratio(records: list[dict], out: Path) -> Path:
    datasets = sorted({r["dataset"] for r in records})
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.4 * len(datasets), 3.4), squeeze=False)
    im = None
    for ax, ds in zip(axes[0], datasets, strict=False):
        budgets, sizes, rows = ratio_grid(records, ds)
        data = [[v if v is not None else float("nan") for v in row] for row in rows]
        im = ax.imshow(data, cmap="RdYlGn", vmin=0.6, vmax=1.4, aspect="auto", origin="lower")
        ax.set_xticks(range(len(sizes)), [str(s) for s in sizes])
        ax.set_yticks(range(len(budgets)), [str(b) for b in budgets])
        for i, row in enumerate(rows):
            for j, v in enumerate(row):
                if v is not None:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_title(f"{ds}: tree / chain throughput")
        ax.set_xlabel("batch size")
        ax.set_ylabel("budget D")
    fig.subplots_adjust(bottom=0.2, top=0.88, wspace=0.35)
    if im is not None:
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    path = out / "tree_vs_chain_ratio.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl")
    ap.add_argument("--out-dir", default=None)
    a = ap.parse_args()
    records = grid_records(bc.load_records(a.jsonl))
    out = Path(a.out_dir) if a.out_dir else Path(a.jsonl).parent
    out.mkdir(parents=True, exist_ok=True)
    for p in (plot_accept(records, out), plot_throughput(records, out), plot_ratio(records, out)):
        print("wrote", p)


if __name__ == "__main__":
    main()
