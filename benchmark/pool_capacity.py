"""Tokens a real server fits into one memory budget, for two source trees of this project, side by side.

    python benchmark/pool_capacity.py --sources OLD_TREE NEW_TREE [--model-path models/tiny-v4]
        [--mem-fraction-static 0.15] [--swa-full-tokens-ratio 0.5] [--kv-cache-dtypes auto fp8_e4m3]
        [--repeats 2] [--out benchmark/results/pool_capacity.jsonl]

Each source tree (a checkout of this repository, e.g. ``git worktree add /tmp/old COMMIT``) is put first on the
server's ``PYTHONPATH`` and a plain ``sglang.launch_server`` is started with ``--mem-fraction-static`` (the budget:
SGLang gives the KV pool the memory free after loading minus ``1 - fraction`` of what was free before) and a token
cap far above it, so the memory decides; the server's ``max_total_num_tokens`` is read from ``/get_server_info`` and
the server stopped before the next one starts. The trees alternate ``--repeats`` times (the free memory drifts), and
each one's median is kept; with several ``--kv-cache-dtypes`` every tree is run with each of them. Why: the
footprint report predicts the bytes per token from the pool class; this is what
a user's server does with them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
from sglang_tree_v4.testing import launcher  # noqa: E402


def commit_of(tree: str) -> str:
    out = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def capacity(tree: str, kv_cache_dtype: str, args: argparse.Namespace, log: Path) -> int:
    path = [str(Path(tree) / "python")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = launcher.clean_env(PYTHONPATH=os.pathsep.join(path))
    flags = ["--device", "cpu", "--mem-fraction-static", str(args.mem_fraction_static), "--max-total-tokens",
             "100000000", "--swa-full-tokens-ratio", str(args.swa_full_tokens_ratio), "--sleep-on-idle",
             "--kv-cache-dtype", kv_cache_dtype]
    server = launcher.wait_healthy(launcher.launch(args.model_path, flags, log=log, env=env))
    try:
        info = requests.get(server.url + "/get_server_info", timeout=60).json()
        return int(info["max_total_num_tokens"])
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", nargs="+", required=True)
    ap.add_argument("--model-path", default=str(ROOT / "models" / "tiny-v4"))
    ap.add_argument("--mem-fraction-static", type=float, default=0.15)
    ap.add_argument("--swa-full-tokens-ratio", type=float, default=0.5)
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmark" / "results" / "pool_capacity.jsonl"))
    args = ap.parse_args(argv)
    runs = [(tree, dt) for tree in args.sources for dt in args.kv_cache_dtypes]
    got: dict[tuple[str, str], list[int]] = {run: [] for run in runs}
    logs = Path(tempfile.mkdtemp(prefix="pool_capacity_"))
    for i in range(args.repeats):
        for j, (tree, dt) in enumerate(runs):
            got[tree, dt].append(capacity(tree, dt, args, logs / f"server_{i}_{j}.log"))
            print(json.dumps({"source": commit_of(tree), "kv_cache_dtype": dt, "run": i,
                              "max_total_num_tokens": got[tree, dt][-1]}), flush=True)
    rows = [{"source": commit_of(t), "kv_cache_dtype": dt, "mem_fraction_static": args.mem_fraction_static,
             "swa_full_tokens_ratio": args.swa_full_tokens_ratio, "max_total_num_tokens_runs": v,
             "max_total_num_tokens": statistics.median(v)} for (t, dt), v in got.items()]
    base = rows[0]["max_total_num_tokens"]
    for r in rows:
        r["ratio_to_first"] = round(r["max_total_num_tokens"] / base, 3)
        print(json.dumps(r))
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
