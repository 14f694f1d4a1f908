"""Cost of one tree-verify forward vs a matched chain at the same D (tokens per request), and of the accepted-path
commit, at batch sizes 1..64, for the plain-torch DeepSeek-V4 at the tiny config (CPU, fp32, one thread).

    python benchmark/dsv4_tree_verify.py [--D 16] [--batches 1,4,16,64] [--reps 5]

Tree: EAGLE-like shape (top-4 at depth 1, then 2 children of the first two nodes of each level, up to D nodes).
Chain: D nodes in a line. Commit: copy 4 accepted rows per request (target store).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "test"))
from sglang_tree_v4.dsv4.tree_state import TreeVerifier, tree_paths  # noqa: E402
from sglang_tree_v4.testing.runner import DSV4Runner  # noqa: E402
from support.hf_reference import C, H, S, build_hf, ours_from_hf  # noqa: E402


def eagle_like(D: int) -> list[int]:
    par, level = [-1], [0]
    while len(par) < D:
        nxt = []
        for p in level[:2] if len(par) > 1 else level:
            for _ in range(4 if len(par) == 1 else 2):
                if len(par) < D:
                    par.append(p)
                    nxt.append(len(par) - 1)
        level = nxt
    return par


def pack(par_list, rng, vocab):
    B, D = len(par_list), max(len(p) for p in par_list)
    toks = torch.tensor([[rng.randrange(vocab) for _ in range(D)] for _ in range(B)])
    par = torch.full((B, D), -1, dtype=torch.long)
    for b, p in enumerate(par_list):
        par[b, :len(p)] = torch.tensor(p)
    return toks, par, torch.tensor([len(p) for p in par_list])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--D", type=int, default=16)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hca", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    hf = build_hf(args.hca, seed=0, layers=(S, S, C, H, C, H), hidden=256, moe_inter=128)
    model = ours_from_hf(hf)
    vocab = model.cfg.vocab_size
    batches = [int(b) for b in args.batches.split(",")]
    runner = DSV4Runner(model, num_slots=max(batches) * (48 + 2 * args.D) + 64, max_len=256, max_reqs=max(batches))
    base = runner.add_request()
    runner.extend([base], [torch.randint(0, vocab, (48,), generator=torch.Generator().manual_seed(0))])
    rids = [runner.fork(base, 32 + (i % 16)) for i in range(max(batches) - 1)] + [base]  # mixed prefix lengths
    tv = TreeVerifier(runner)
    tree, chain = eagle_like(args.D), [-1] + list(range(args.D - 1))
    print(f"tiny V4 (6 layers, hidden 256, HCA {args.hca}), D={args.D}, prefix 32..48, fp32, 1 thread; "
          f"median of {args.reps}")
    print(f"{'batch':>5} {'tree ms':>9} {'chain ms':>9} {'tree/chain':>10} {'commit ms':>9}")
    for B in batches:
        sub = rids[:B]
        res = {}
        for name, shape in (("tree", tree), ("chain", chain)):
            times = []
            for _ in range(args.reps + 1):
                toks, par, nn = pack([shape] * B, rng, vocab)
                t0 = time.perf_counter()
                tv.verify(sub, toks, par, nn)
                times.append((time.perf_counter() - t0) * 1e3)
                for r in sub:
                    tv.rollback(r)
            res[name] = statistics.median(times[1:])
        ctimes = []
        for _ in range(args.reps):
            toks, par, nn = pack([tree] * B, rng, vocab)
            tv.verify(sub, toks, par, nn)
            depth, path = tree_paths(par, nn)
            node = int(depth[0].argmax())
            acc = [int(path[0, node, j]) for j in range(min(int(depth[0, node]), 3) + 1)]
            t0 = time.perf_counter()
            for r in sub:
                tv.commit(r, acc)
            ctimes.append((time.perf_counter() - t0) * 1e3)
            for r in sub:  # undo the commit so prefix lengths stay put
                n = runner.lens[r]
                runner.alloc.release(runner.req_table[r, n - len(acc):n].tolist())
                runner.req_table[r, n - len(acc):n] = -1
                runner.lens[r] = n - len(acc)
        print(f"{B:>5} {res['tree']:>9.1f} {res['chain']:>9.1f} {res['tree'] / res['chain']:>10.2f} "
              f"{statistics.median(ctimes):>9.2f}")


if __name__ == "__main__":
    main()
