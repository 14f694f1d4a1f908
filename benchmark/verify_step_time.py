"""Per-verify-step time on the CPU, two checkouts side by side: the eager verify (lists sized by the batch) of an
earlier commit against this tree's fixed-shape step (``dsv4.verify_step``).

    python benchmark/verify_step_time.py [--before COMMIT] [--batch 64] [--D 8] [--rounds 5] \
        [--out benchmark/results/verify_step_time_cpu.jsonl]

One step = the target's verify forward over B trees of D nodes (embedded model, committed contexts of 60-123
tokens, so trees cross CSA and HCA block ends), greedy acceptance and the accepted-path commit. Each round runs a
fresh process per variant, in turn (before, after with the CPU's context bucket, after with a 4,096-token capacity
as a captured GPU step would pad), each timing 3 steps after a warm-up; medians over all rounds, and ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import git_commit, write_records

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def eagle_parents(D: int) -> list[int]:
    """K = 3 at the root, then two children of each level's best node: a typical EAGLE-2 tree."""
    par = [-1, 0, 0, 0]
    while len(par) < D:
        p = len(par) - 3 if len(par) > 4 else 1
        par += [p, p][: D - len(par)]
    return par[:D]


def time_steps(variant: str, batch: int, D: int, reps: int) -> list[float]:
    """Runs inside the checkout under test (its ``python`` folders first on sys.path)."""
    import torch

    from sglang_tree_v4.checkpoint.weights import load_model
    from sglang_tree_v4.dsv4.tree_state import TreeVerifier
    from sglang_tree_v4.testing.runner import DSV4Runner
    from sglang_tree_v4.tree import DraftTree, verify_greedy

    torch.set_num_threads(1)
    model = load_model(os.path.join(ROOT, "models", "tiny-v4"))
    rng = random.Random(0)
    V = model.cfg.vocab_size
    lens = [60 + (i * 7) % 64 for i in range(batch)]
    runner = DSV4Runner(model, num_slots=batch * (128 + D * (reps + 2)) + 64, max_len=256, max_reqs=batch)
    rids = [runner.add_request() for _ in range(batch)]
    runner.extend(rids, [[rng.randrange(2, V) for _ in range(L)] for L in lens])
    par = torch.tensor([eagle_parents(D)] * batch)
    times = []
    for _ in range(reps + 1):
        toks = torch.tensor([[rng.randrange(2, V) for _ in range(D)] for _ in range(batch)])
        tree = DraftTree.from_parents(toks, par)
        scratch = [torch.tensor(runner.alloc.alloc(D)) for _ in rids]
        lens_t = torch.tensor([runner.lens[r] for r in rids])
        start = time.perf_counter()
        if variant == "before":
            tv = TreeVerifier(runner)
            res = tv.verify(rids, tree.tokens, tree.parents, tree.num_nodes, scratch=scratch)
            verdict = verify_greedy(tree, torch.stack(res.logits))
            for b, rid in enumerate(rids):
                tv.commit(rid, verdict.accepted_nodes[b, :int(verdict.accept_lens[b])].tolist())
        else:
            from sglang_tree_v4.dsv4.storage import StepCaps
            from sglang_tree_v4.dsv4.verify_step import verify_step
            caps = StepCaps.bucket(int(lens_t.max()) + D, 256) if variant == "after-bucket" else StepCaps(4096)
            s = torch.stack(scratch)
            out = verify_step(model, runner.store, runner.req_table, torch.tensor(rids), lens_t, tree, s, s, caps)
            for b, rid in enumerate(rids):  # the runner's own bookkeeping (the step already moved rows and table)
                k = int(out.verdict.accept_lens[b])
                runner.lens[rid] += k
                runner.alloc.release(scratch[b][k:].tolist())
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="8dafcd5", help="the commit before the fixed-shape step")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--D", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmark/results/verify_step_time_cpu.jsonl")
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "CHECKOUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        variant, checkout = args.child
        sys.path[:0] = [os.path.join(checkout, "python"), os.path.join(checkout, "sgl-kernel-ext")]
        print(json.dumps(time_steps(variant, args.batch, args.D, args.reps)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        before = os.path.join(tmp, "before")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", before, args.before], check=True,
                       capture_output=True)
        try:
            checkouts = {"before": before, "after-bucket": ROOT, "after-capacity": ROOT}
            times: dict[str, list[float]] = {v: [] for v in checkouts}
            for _ in range(args.rounds):
                for variant, checkout in checkouts.items():
                    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--batch", str(args.batch),
                                          "--D", str(args.D), "--reps", str(args.reps), "--child", variant, checkout],
                                         check=True, capture_output=True, text=True, cwd=tmp).stdout
                    times[variant] += json.loads(out.strip().splitlines()[-1])
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", before], capture_output=True)
    med = {v: statistics.median(t) for v, t in times.items()}
    records = [{"bench": "verify_step_time", "variant": v, "before_commit": args.before, "batch": args.batch,
                "D": args.D, "steps": len(t), "median_ms": round(1e3 * med[v], 2),
                "vs_before": round(med[v] / med["before"], 3), "commit": git_commit()} for v, t in times.items()]
    for r in records:
        print(json.dumps(r))
    write_records(args.out, records)


if __name__ == "__main__":
    main()
