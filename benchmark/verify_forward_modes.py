"""The server's target-verify forward on the CPU, eager vs fixed shapes, side by side in one process.

    python benchmark/verify_forward_modes.py [--batches 32 64] [--nodes 1 2 8] [--rounds 7] \
        [--out benchmark/results/verify_forward_modes_cpu.jsonl]

Why: the fixed-shape forward (``StepCaps``) is what a GPU needs (no host reads, capturable), but it pools a
would-be compressed entry for every query and pads every entry list to a context bucket. On a CPU nothing drains,
so the server runs the eager forward there unless ``SGLANG_TREE_V4_FIXED_SHAPES=1``; this measures what that
choice is worth. The forward is ``measure.verify_forward`` (the adapter's tables and caps, as the server and the
adaptive budget's startup measurement run it) on the embedded model, committed contexts of 200-399 tokens, ``d``
nodes per request; the two modes alternate within each round; medians over rounds after the first.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from bench_common import ROOT, write_records

ENV = "SGLANG_TREE_V4_FIXED_SHAPES"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmark" / "results" / "verify_forward_modes_cpu.jsonl"))
    args = ap.parse_args()

    import torch

    from sglang_tree_v4.checkpoint.weights import load_model
    from sglang_tree_v4.speculative.adaptive.measure import verify_forward
    from sglang_tree_v4.testing.runner import DSV4Runner

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = load_model(os.path.join(ROOT, "models", "tiny-v4"))
    rng = random.Random(0)
    V, most = model.cfg.vocab_size, max(args.nodes)
    records = []
    for B in args.batches:
        lens = [200 + (i * 37) % 200 for i in range(B)]
        runner = DSV4Runner(model, num_slots=B * (400 + most) + 64, max_len=512, max_reqs=B)
        rids = [runner.add_request() for _ in range(B)]
        for rid, L in zip(rids, lens, strict=False):
            runner.extend([rid], [[rng.randrange(2, V) for _ in range(L)]])
        table = runner.req_table[torch.tensor(rids)]
        for b, L in enumerate(lens):  # the verify slots the server reserves after the committed positions
            table[b, L:L + most] = torch.tensor(runner.alloc.alloc(most))
        prefix = torch.tensor(lens)
        for d in args.nodes:
            tokens = torch.randint(2, V, (B, d))
            times: dict[str, list[float]] = {"eager": [], "fixed": []}
            for _ in range(args.rounds):
                for mode in times:
                    os.environ[ENV] = "1" if mode == "fixed" else "0"
                    start = time.perf_counter()
                    verify_forward(model, runner.store, table, prefix, tokens, d)
                    times[mode].append(time.perf_counter() - start)
            eager, fixed = (statistics.median(times[m][1:]) for m in ("eager", "fixed"))
            rec = {"bench": "verify_forward_modes", "batch": B, "nodes": d, "rounds": args.rounds - 1,
                   "eager_ms": round(1e3 * eager, 2), "fixed_ms": round(1e3 * fixed, 2),
                   "fixed_vs_eager": round(fixed / eager, 3)}
            print(json.dumps(rec), flush=True)
            records.append(rec)
    os.environ.pop(ENV, None)
    write_records(args.out, records)


if __name__ == "__main__":
    main()
