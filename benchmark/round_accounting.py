"""Where a served run's wall time goes, per output token: the rounds the adaptive budget observes, every decode
round, and the wall clock, for a pinned TREE_V4 shape against TREE_V4 never speculating, side by side.

    python benchmark/round_accounting.py [--model-path models/tiny-v4] [--dataset gsm8k] [--batch-size 32]
        [--waves 2] [--shape 2:1:1 | --shape adaptive] [--repeats 3] [--max-new-tokens 64]
        [--out benchmark/results/round_accounting_cpu.jsonl]

Why: the adaptive budget compares shapes by the time of the rounds it observes, back-to-back decode rounds at one
batch size (``TreeV4Worker._account``). A run's wall clock holds more: the rounds at other batch sizes (a batch
that empties request by request), the prefill rounds between, and what happens outside the scheduler's loop. If
a shape changes those (speculation spreads the requests' last steps apart, so the tail runs part-full batches and
the next requests are prefilled one by one), the policy cannot see it. Two servers with ``--log-level debug``:
TREE_V4 pinned to ``--shape`` (D:K:S) and TREE_V4 forced never to speculate (the test mutation
``never_speculate``), so both run the same worker and differ only in the shape. Each run (greedy, EOS ignored,
``--waves`` x batch size prompts, ``batch size`` in flight) is sliced out of the server's log; per run and server:
ms per output token of the observed rounds (draft + verify + accept/commit + the scheduler's gap, rounds at the
batch size with a previous round to measure from), of every decode round, and of the wall clock; the rounds below
the batch size, and the prefill rounds. Medians over ``--repeats`` runs after a warm-up run, in the JSONL. Then,
summed over the runs, each shape's observed rounds: count, ms per round, tokens per request per round, output
tokens per ms. ``--shape adaptive`` runs the default (adaptive) server in place of a pinned one, so its rounds
show what the policy chose and how each choice did by the rounds, next to its wall clock.
"""
from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "test"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402
import bench_prompts  # noqa: E402
import bench_server  # noqa: E402
from served_step_breakdown import ROUND  # noqa: E402  (the worker's per-round debug line)

from sglang_tree_v4.testing import launcher  # noqa: E402
from support import serving_checks  # noqa: E402

PREFILL = re.compile(r"Prefill batch")


def account(lines: list[str], batch: int, tokens: int, wall_s: float, shapes: dict | None = None) -> dict:
    """One run's log lines -> ms per output token of the observed rounds, of all decode rounds, of the wall;
    ``shapes`` (shape -> [rounds, ms, tokens]) gathers the observed rounds per shape."""
    observed_ms = observed_tokens = decode_ms = 0.0
    rounds = partial = 0
    shapes = {} if shapes is None else shapes
    for line in lines:
        m = ROUND.search(line)
        if not m:
            continue
        bs, accepted = int(m.group(1)), int(m.group(3))
        work = sum(float(m.group(i)) for i in (4, 5, 6))
        gap = float(m.group(7))
        rounds += 1
        partial += bs < batch
        decode_ms += work + (0.0 if math.isnan(gap) else gap)
        if bs == batch and not math.isnan(gap):  # what the adaptive budget observes
            observed_ms += work + gap
            observed_tokens += accepted
            tally = shapes.setdefault(m.group(2), [0, 0.0, 0])
            tally[0], tally[1], tally[2] = tally[0] + 1, tally[1] + work + gap, tally[2] + accepted
    return {"observed_ms_per_token": observed_ms / max(observed_tokens, 1),
            "decode_ms_per_token": decode_ms / tokens, "wall_ms_per_token": 1e3 * wall_s / tokens,
            "decode_rounds": rounds, "partial_batch_rounds": partial,
            "prefill_rounds": sum(bool(PREFILL.search(line)) for line in lines)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=str(ROOT / "models" / "tiny-v4"))
    ap.add_argument("--dataset", default="gsm8k", choices=["gsm8k", "mbpp", "sharegpt"])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--shape", default="2:1:1", help="the pinned server's D:K:S, or 'adaptive' (no shape flags)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "benchmark" / "results" / "round_accounting_cpu.jsonl"))
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="round_accounting_"))
    common = ["--device", "cpu", "--sleep-on-idle", "--log-level", "debug", "--speculative-algorithm", "TREE_V4",
              "--max-running-requests", str(args.batch_size), "--max-total-tokens", "65536"]
    if args.shape == "adaptive":
        pinned, flags = "adaptive", []
    else:
        d, k, s = args.shape.split(":")
        pinned = f"D{d}_K{k}_S{s}"
        flags = ["--speculative-num-draft-tokens", d, "--speculative-eagle-topk", k, "--speculative-num-steps", s]
    started = {
        pinned: launcher.launch(args.model_path, common + flags, folder / "pinned.log",
                                env=launcher.clean_env(XDG_CACHE_HOME=str(folder / "c1"))),
        "none": serving_checks.launch_mutated(args.model_path, common, "never_speculate", folder / "none.log",
                                              XDG_CACHE_HOME=str(folder / "c2")),
    }
    logs = {pinned: folder / "pinned.log", "none": folder / "none.log"}
    with serving_checks.healthy(started) as servers:
        texts = bench_prompts.chat_texts(args.model_path, args.dataset, args.waves * args.batch_size)
        sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        shapes: dict[str, dict] = {name: {} for name in servers}
        for i in range(args.repeats + 1):
            for name, server in servers.items():  # in turn: both see each stretch of the machine
                start = len(logs[name].read_text().splitlines())
                got = bench_server.measure(server, texts, args.batch_size, sampling)
                if i:  # the first run is a warm-up
                    lines = logs[name].read_text().splitlines()[start:]
                    runs[name].append(account(lines, args.batch_size, got["output_tokens"], got["wall_s"],
                                              shapes[name]))
    records = []
    print(f"\n{args.dataset}, batch {args.batch_size}, {args.waves} waves, medians of {args.repeats} runs\n")
    print("| server | observed rounds, ms/token | all decode rounds, ms/token | wall, ms/token | decode rounds "
          "| of them below the batch size | prefill rounds |")
    print("|---|---|---|---|---|---|---|")
    for name, values in runs.items():
        med = {key: statistics.median(v[key] for v in values) for key in values[0]}
        print(f"| {name} | {med['observed_ms_per_token']:.3f} | {med['decode_ms_per_token']:.3f} | "
              f"{med['wall_ms_per_token']:.3f} | {med['decode_rounds']:.0f} | {med['partial_batch_rounds']:.0f} | "
              f"{med['prefill_rounds']:.0f} |")
        records.append({"bench": "round_accounting", "server": name, "dataset": args.dataset,
                        "batch_size": args.batch_size, "waves": args.waves, **med, "runs": values,
                        "observed_by_shape": shapes[name], "commit": bench_common.git_commit()})
    print("\n| server | shape | observed rounds | ms per round | tokens per request per round | tokens per ms |")
    print("|---|---|---|---|---|---|")
    for name, by_shape in shapes.items():
        for shape, (n, ms, tokens) in sorted(by_shape.items(), key=lambda kv: -kv[1][0]):
            print(f"| {name} | {shape} | {n} | {ms / n:.1f} | {tokens / n / args.batch_size:.2f} | "
                  f"{tokens / ms:.3f} |")
    bench_common.write_records(args.out, records)


if __name__ == "__main__":
    main()
