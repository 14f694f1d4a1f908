"""Time of the tree speculation core: build (EAGLE-2 expand + rerank) and verify (greedy, sampled) per batch.

The drafter is a stand-in that returns pre-drawn logits (so only the core's own work is timed); target logits are
random except that each node's first child is the target's favourite, so verification walks the full depth (the
costly case). Prints one line of medians per configuration and appends JSONL records.

    PYTHONPATH=python python benchmark/tree_core.py                      # default grid, a few minutes
    PYTHONPATH=python python benchmark/tree_core.py --batch 64 --nodes 8 --topk 1 8 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
from bench_common import git_commit

from sglang_tree_v4.tree import (
    SamplingParams,
    build_draft_tree,
    verify_greedy,
    verify_sampling,
)
from sglang_tree_v4.tree.synthetic import FixedLogitsDrafter


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--nodes", type=int, nargs="+", default=[5, 6, 7, 8], help="budget D, root included")
    parser.add_argument("--topk", type=int, nargs="+", default=[1, 2, 4, 8], help="branching K")
    parser.add_argument("--steps", type=int, default=None, help="draft steps S (default D - 1)")
    parser.add_argument("--vocab", type=int, default=129_280)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (after one warm-up)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmark/out/tree_core.jsonl")
    return parser.parse_args()


def favour_first_children(tree, logits: torch.Tensor) -> None:
    """Make each node's first child the target's clear favourite (in place)."""
    first_child, _ = tree.sibling_links()
    batch, width = first_child.shape
    rows = torch.arange(batch)[:, None].expand(batch, width)
    nodes = torch.arange(width)[None, :].expand(batch, width)
    has = first_child >= 0
    tokens = tree.tokens.gather(1, first_child.clamp(min=0))
    logits[rows[has], nodes[has], tokens[has]] += 20.0


def timed(fn) -> tuple[tuple[float, float], object]:
    """``((wall ms, process CPU ms), result)``; CPU time is what a shared machine cannot inflate."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return ((time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3), out


def run_config(batch: int, nodes: int, topk: int, steps: int, args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(batch * 1000 + nodes * 10 + topk)
    draft_logits = torch.randn(batch, topk, args.vocab, generator=gen) * 3
    drafter = FixedLogitsDrafter(draft_logits)
    roots = torch.randint(args.vocab, (batch,), generator=gen)
    prefix = torch.randint(100, 2000, (batch,), generator=gen)
    parent_hidden = torch.zeros(batch, 1)
    build = lambda: build_draft_tree(roots, prefix, drafter, steps, topk, nodes, parent_hidden)  # noqa: E731
    tree = build()
    target = torch.randn(batch, tree.width, args.vocab, generator=gen)
    favour_first_children(tree, target)
    params = SamplingParams.uniform(batch, args.temperature, args.top_k, args.top_p)
    sample_gen = torch.Generator().manual_seed(0)
    times = {k: [] for k in ("build", "verify_greedy", "verify_sample")}
    cpu_times = {k: [] for k in times}
    accept = None
    for rep in range(args.repeats + 1):
        t_build, tree = timed(build)
        t_greedy, greedy = timed(lambda tree=tree: verify_greedy(tree, target))
        t_sample, sampled = timed(lambda tree=tree: verify_sampling(tree, target, params, generator=sample_gen))
        if rep == 0:
            accept = (greedy.accept_lens.float().mean().item(), sampled.accept_lens.float().mean().item())
            continue
        for key, t in (("build", t_build), ("verify_greedy", t_greedy), ("verify_sample", t_sample)):
            times[key].append(t[0])
            cpu_times[key].append(t[1])
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu = {k: statistics.median(v) for k, v in cpu_times.items()}
    return {
        "batch": batch,
        "num_nodes": nodes,
        "topk": topk,
        "steps": steps,
        "vocab": args.vocab,
        "build_ms": med["build"],
        "verify_greedy_ms": med["verify_greedy"],
        "verify_sample_ms": med["verify_sample"],
        "build_verify_greedy_ms": med["build"] + med["verify_greedy"],
        "build_verify_sample_ms": med["build"] + med["verify_sample"],
        "build_cpu_ms": cpu["build"],
        "verify_greedy_cpu_ms": cpu["verify_greedy"],
        "verify_sample_cpu_ms": cpu["verify_sample"],
        "accept_len_greedy": accept[0],
        "accept_len_sample": accept[1],
        "repeats": args.repeats,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "commit": git_commit(),
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    header = (f"{'B':>3} {'D':>2} {'K':>2} {'S':>2} {'build':>9} {'greedy':>9} {'sample':>9} {'b+g':>9} {'b+s':>9}"
              f" {'cpu b+g':>9} {'cpu b+s':>9}  acc(g/s)")
    print(f"median ms over {args.repeats} runs (wall; 'cpu' = process CPU time), vocab {args.vocab}, "
          f"{args.threads} thread(s)")
    print(header)
    with open(args.out, "a") as out:
        for batch in args.batch:
            for nodes in args.nodes:
                for topk in args.topk:
                    steps = args.steps if args.steps is not None else nodes - 1
                    rec = run_config(batch, nodes, topk, steps, args)
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
                    print(
                        f"{batch:>3} {nodes:>2} {topk:>2} {steps:>2} {rec['build_ms']:>9.2f} "
                        f"{rec['verify_greedy_ms']:>9.2f} {rec['verify_sample_ms']:>9.2f} "
                        f"{rec['build_verify_greedy_ms']:>9.2f} {rec['build_verify_sample_ms']:>9.2f} "
                        f"{rec['build_cpu_ms'] + rec['verify_greedy_cpu_ms']:>9.2f} "
                        f"{rec['build_cpu_ms'] + rec['verify_sample_cpu_ms']:>9.2f}  "
                        f"{rec['accept_len_greedy']:.2f}/{rec['accept_len_sample']:.2f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
