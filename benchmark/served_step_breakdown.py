"""Where a served TREE_V4 round goes, per shape, against the adaptive budget's startup model.

    python benchmark/served_step_breakdown.py [--model-path models/tiny-v4] [--datasets sharegpt gsm8k]
        [--batch-size 16] [--waves 4] [--max-new-tokens 64] [--out benchmark/results/served_step_breakdown_cpu.jsonl]

Why: the adaptive budget compares shapes by a step-time model measured at startup (``adaptive.measure``: the MTP draft
and the target's verify forward, on scratch state) and corrected by a fit over served steps. Where the model is
wrong by a different factor per shape, the fit has to learn that shape by shape. This script shows, per shape,
what the model holds against what a server spends. One server runs the adaptive default forced through every
shape of its menu in turn (the test mutation ``cycle_shapes``, ``test/support/mutations``) with debug logging;
``--waves`` x batch size prompts are sent with the batch size in flight (greedy, EOS ignored). From the worker's
per-round debug line, for rounds at exactly that batch size, the medians per shape of: draft, verify (SGLang's
forward of the verified tokens), accept+commit, the scheduler's time since the previous round, and their sum;
next to the model's verify and whole-round time (``StepTimes.verify_time`` / ``model``) from the server's own
step-time cache. The rounds per shape are few (each shape gets one round in ~30), so read the columns for their
pattern, not their last digit.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "test"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402
import bench_prompts  # noqa: E402
import bench_server  # noqa: E402

from sglang_tree_v4.speculative.adaptive.timing import StepTimes  # noqa: E402
from sglang_tree_v4.testing import launcher  # noqa: E402
from support import serving_checks  # noqa: E402

ROUND = re.compile(r"TREE_V4 step: batch (\d+), shape (\S+), accepted (\d+), draft ([\d.]+) ms, verify ([\d.]+) ms, "
                   r"accept\+commit ([\d.]+) ms, scheduler since the last round ([\d.]+|nan) ms")
PARTS = ("draft", "verify", "accept_commit", "scheduler")


def shape_of(key: str) -> tuple[int, int]:
    """``D4_K3_S2`` -> (4, 2); ``none`` -> (1, 0)."""
    if key == "none":
        return 1, 0
    d, _, s = key.split("_")
    return int(d[1:]), int(s[1:])


def breakdown(lines: list[str], batch: int, times: StepTimes) -> list[dict]:
    rounds: dict[str, list[list[float]]] = defaultdict(list)
    for line in lines:
        m = ROUND.search(line)
        if m and int(m.group(1)) == batch:
            rounds[m.group(2)].append([float(x) for x in m.groups()[3:]])
    rows = []
    for key in sorted(rounds, key=lambda k: (k != "none", shape_of(k))):
        parts = {}
        for i, name in enumerate(PARTS):
            values = [r[i] for r in rounds[key] if not math.isnan(r[i])]  # nan: no previous round to measure from
            parts[name] = statistics.median(values) if values else None
        d, s = shape_of(key)
        model = times.model(batch, (d, s))
        rows.append({"shape": key, "rounds": len(rounds[key]), **{f"{k}_ms": v for k, v in parts.items()},
                     "served_ms": sum(v for v in parts.values() if v is not None),
                     "model_verify_ms": 1e3 * times.verify_time(batch, d),
                     "model_ms": None if model is None else 1e3 * model})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=str(ROOT / "models" / "tiny-v4"))
    ap.add_argument("--datasets", nargs="+", default=["sharegpt", "gsm8k"], choices=["gsm8k", "mbpp", "sharegpt"])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "benchmark" / "results" / "served_step_breakdown_cpu.jsonl"))
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="served_step_breakdown_"))
    log = folder / "server.log"
    flags = ["--device", "cpu", "--speculative-algorithm", "TREE_V4", "--log-level", "debug",
             "--max-running-requests", "64", "--disable-overlap-schedule"]
    server = serving_checks.launch_mutated(args.model_path, flags, "cycle_shapes", log,
                                           XDG_CACHE_HOME=str(folder / "cache"))
    try:
        launcher.wait_healthy(server)
        cache = re.findall(r"step times (?:measured|read) in [0-9.]+ s \((.*)\)", log.read_text())[0]
        times = StepTimes.from_json(json.loads(Path(cache).read_text())["times"])
        records = []
        for dataset in args.datasets:
            texts = bench_prompts.chat_texts(args.model_path, dataset, args.waves * args.batch_size)
            start = len(log.read_text().splitlines())
            bench_server.measure(server, texts, args.batch_size,
                                 {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True})
            rows = breakdown(log.read_text().splitlines()[start:], args.batch_size, times)
            print(f"\n{dataset}, batch {args.batch_size} (ms, medians per shape)\n")
            print("| shape | rounds | draft | verify | model's verify | accept+commit | scheduler | served round "
                  "| model's round |")
            print("|---|---|---|---|---|---|---|---|---|")
            for r in rows:
                cells = [r["draft_ms"], r["verify_ms"], r["model_verify_ms"], r["accept_commit_ms"],
                         r["scheduler_ms"], r["served_ms"], r["model_ms"]]
                print(f"| {r['shape']} | {r['rounds']} | " + " | ".join(
                    "-" if c is None else f"{c:.1f}" for c in cells) + " |")
                records.append({"bench": "served_step_breakdown", "dataset": dataset, "batch_size": args.batch_size,
                                **r, "commit": bench_common.git_commit()})
        bench_common.write_records(args.out, records)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
