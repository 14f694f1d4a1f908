"""The step-cost report at the shapes that decide GPU speed: one TP4 rank of the published V4-Flash config, context
8K, tree D=8 (K=3, S=4) at batch 1 and 32, the matched chain at batch 1, no speculation at batch 1. One JSONL record
per shape, with the commit it counted.

    python benchmark/step_cost.py [--out benchmark/results/step_cost_v4_flash_tp4.jsonl] [--label NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import git_commit  # noqa: E402

from sglang_tree_v4.step_cost.__main__ import report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLASH = os.path.join(ROOT, "data", "deepseek_v4_flash_config.json")
SHAPES = {"tree_b1": (1, 8, 3, 4), "tree_b32": (32, 8, 3, 4), "chain_b1": (1, 8, 1, 7), "none_b1": (1, 1, 1, 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmark", "results", "step_cost_v4_flash_tp4.jsonl"))
    ap.add_argument("--label", default="current", help="what this code state is (e.g. before / after a change)")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    commit = git_commit()
    for name in args.shapes:
        batch, d, k, s = SHAPES[name]
        r = report(FLASH, tp=4, tp_rank=0, batch=batch, context=8192, draft=d, topk=k, steps=s)
        r.update(shape=name, label=args.label, commit=commit)
        r.pop("config", None)
        with open(args.out, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(name, {k: r[k] for k in ("bytes_total", "bytes_floor", "total_over_floor", "launches_per_layer",
                                       "largest_write_bytes")}, flush=True)


if __name__ == "__main__":
    main()
