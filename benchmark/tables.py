"""Markdown tables for RESULTS.md from sweep JSONL: accept length tree vs chain per (dataset, D), throughput per
batch size with the tree/chain ratio, and a table of explicit tree shapes (a ``--tree-shapes`` run).

    python benchmark/tables.py benchmark/results/tree_vs_chain_cpu.jsonl
        [--shapes benchmark/results/tree_shapes_d8_gsm8k_cpu.jsonl]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402
from plot import grid_records, pooled_accept, ratio_grid  # noqa: E402


def accept_table(records: list[dict]) -> str:
    acc = pooled_accept(records)
    lines = ["| dataset | D | tree (K,S) | tree accept | chain accept | tree - chain | tree / chain |",
             "|---|---|---|---|---|---|---|"]
    for ds in sorted({k[0] for k in acc}):
        for d in sorted({k[1] for k in acc if k[0] == ds}):
            t, c = acc.get((ds, d, "tree")), acc.get((ds, d, "chain"))
            if t is None or c is None:
                continue
            k, s = next((r["topk"], r["num_steps"]) for r in records
                        if r["shape"] == "tree" and r["dataset"] == ds and r["budget"] == d)
            lines.append(f"| {ds} | {d} | ({k},{s}) | {t:.3f} | {c:.3f} | {t - c:+.3f} | {t / c:.3f} |")
    return "\n".join(lines)


def throughput_table(records: list[dict], ds: str) -> str:
    budgets, sizes, rows = ratio_grid(records, ds)
    val = {(r["budget"], r["batch_size"], r["shape"]): r["output_throughput"] for r in records
           if r["dataset"] == ds}
    head = "| D | shape | " + " | ".join(f"bs {n}" for n in sizes) + " |"
    lines = [head, "|---|---|" + "---|" * len(sizes)]
    none = [val.get((1, n, "none")) for n in sizes]
    if any(v is not None for v in none):
        lines.append("| - | no spec | " + " | ".join(f"{v:.0f}" if v else "" for v in none) + " |")
    for b, row in zip(budgets, rows, strict=False):
        for shape in ("tree", "chain"):
            cells = [val.get((b, n, shape)) for n in sizes]
            lines.append(f"| {b} | {shape} | " + " | ".join(f"{v:.0f}" if v else "" for v in cells) + " |")
        lines.append(f"| {b} | **ratio** | " + " | ".join(f"**{v:.2f}**" if v else "" for v in row) + " |")
    return "\n".join(lines)


def ratio_summary(records: list[dict]) -> str:
    """Median tree/chain throughput ratio per dataset and budget over batch sizes."""
    all_budgets = sorted({r["budget"] for r in records if r["shape"] == "tree"})
    lines = ["| dataset | " + " | ".join(f"D={d}" for d in all_budgets) + " |", "|---|" + "---|" * len(all_budgets)]
    for ds in sorted({r["dataset"] for r in records}):
        budgets, _, rows = ratio_grid(records, ds)
        med = {b: statistics.median([v for v in row if v is not None]) for b, row in zip(budgets, rows, strict=False)
               if any(v is not None for v in row)}
        lines.append(f"| {ds} | " + " | ".join(f"{med[d]:.2f}" if d in med else "" for d in all_budgets) + " |")
    return "\n".join(lines)


def shapes_table(records: list[dict]) -> str:
    lines = ["| shape | K | S | accept length | output tok/s | mean step ms | requests |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (r["shape"] != "tree", r["topk"], r["num_steps"])):
        lines.append(f"| {r['shape']} | {r['topk']} | {r['num_steps']} | {r['accept_length']:.3f} | "
                     f"{r['output_throughput']:.1f} | {r['mean_step_ms']:.1f} | {r['num_requests']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl", nargs="?")
    ap.add_argument("--shapes", default=None, help="JSONL of a --tree-shapes run")
    ap.add_argument("--compare-tree", default=None,
                    help="JSONL of a tree-only run: its trees against the main file's chains (accept length)")
    a = ap.parse_args()
    if a.jsonl:
        records = grid_records(bc.load_records(a.jsonl))
        print("## Accept length\n\n" + accept_table(records) + "\n")
        print("## Median tree/chain throughput ratio over batch sizes\n\n" + ratio_summary(records) + "\n")
        for ds in sorted({r["dataset"] for r in records}):
            print(f"## Output throughput (tokens/s), {ds}\n\n" + throughput_table(records, ds) + "\n")
    if a.jsonl and a.compare_tree:
        chains = [r for r in bc.load_records(a.jsonl) if r["shape"] == "chain"]
        trees = [r for r in bc.load_records(a.compare_tree) if r["shape"] == "tree"]
        print(f"## Accept length, trees of {Path(a.compare_tree).name} vs chains\n\n" + accept_table(trees + chains)
              + "\n")
    if a.shapes:
        print("## Tree shapes\n\n" + shapes_table(bc.load_records(a.shapes)) + "\n")


if __name__ == "__main__":
    main()
