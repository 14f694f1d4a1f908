"""Serving throughput of two commits side by side, through real ``sglang.launch_server`` TREE_V4 servers on a CPU.

Why: a change to the model's layer code (new custom ops, weights kept quantized) should not cost a user of the
stock server throughput or change their tokens. A small CPU is noisy, so the two commits are measured in turn
(before, after, before, after, ...), each time on a fresh server, and medians with their min-max spread are
compared. Two models: the embedded ``models/tiny-v4`` and the same weights re-written in DeepSeek's published
layout (FP8 block-scaled linears, FP4 experts; ``test/support/real_format.published_checkpoint``), served
quantized in float32.

How: check the two commits out as worktrees, then name them; each server runs with ``PYTHONPATH`` pointing at its
worktree (``python/`` and ``sgl-kernel-ext/``), which wins over the editable install. The script only sends HTTP
requests and tokenizes prompts itself, so it may run from either tree. Before any server starts, a process given a
server's environment must import both packages from that server's worktree.

    git worktree add ../before <commit>; git worktree add ../after <commit>
    python benchmark/cpu_serving_ab.py --before ../before --after ../after [--rounds 3]
        [--models embedded published] [--out benchmark/results/cpu_serving_ab.jsonl]

Per (model, round, variant): start a server (TREE_V4, D=8, K=3, S=4, ``--device cpu``), wait until healthy, warm it
up with 2 requests (prompts not in the workload), then time 8 GSM8K chat prompts sent 8 at once, greedy,
``max_new_tokens`` 48 with EOS ignored: completion tokens / wall seconds. The timed workload takes about a second
on a 2-core CPU, so each server runs it ``--repeats`` times (cache flushed before each), one row per run. Every
run's output token ids are compared with the first ``before`` run's of the same model (``outputs_match`` on the
after rows: identical tokens for every prompt). One JSON line per timed run, then one summary line per model
(medians and min-max over all runs of a variant, and the per-round medians).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmark"))
import bench_prompts  # noqa: E402

from sglang_tree_v4.testing import launcher  # noqa: E402

EMBEDDED = ROOT / "models" / "tiny-v4"
SPEC = ["--speculative-algorithm", "TREE_V4", "--speculative-num-draft-tokens", "8", "--speculative-eagle-topk", "3",
        "--speculative-num-steps", "4"]
COMMON = ["--device", "cpu", "--max-total-tokens", "32768", "--random-seed", "7"]
# The published layout is served quantized in float32; its tokenizer is named from the HF-layout folder (see
# test/test_real_format_serving.py).
FLAGS = {"embedded": COMMON, "published": COMMON + ["--dtype", "float32", "--tokenizer-path", str(EMBEDDED)]}
PROBE = "import sglang_tree_v4, sgl_kernel_ext; print(sglang_tree_v4.__file__); print(sgl_kernel_ext.__file__)"


def variant_env(tree: Path) -> dict[str, str]:
    return launcher.clean_env(PYTHONPATH=f"{tree / 'python'}:{tree / 'sgl-kernel-ext'}")


def check_imports(tree: Path) -> list[str]:
    """The files a process started with the server's environment imports; both must lie in ``tree``."""
    out = subprocess.run([sys.executable, "-c", PROBE], env=variant_env(tree), capture_output=True, text=True,
                         check=True).stdout.split()
    if not all(Path(f).resolve().is_relative_to(tree.resolve()) for f in out):
        raise RuntimeError(f"{tree}: imports resolve elsewhere: {out}")
    return out


def generate(server: launcher.Server, texts: list[str], max_new: int) -> list[dict]:
    sampling = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(len(texts)) as pool:
        return list(pool.map(lambda t: server.generate({"text": t, "sampling_params": sampling}), texts))


def run_server(model: Path, flags: list[str], tree: Path, texts: list[str], warm: list[str], max_new: int,
               repeats: int, log: Path) -> list[dict]:
    """Fresh server from ``tree``: warm up, time the workload ``repeats`` times. -> per run: tokens, seconds,
    output ids, accept length."""
    server = launcher.launch(model, flags + SPEC, log, env=variant_env(tree))
    runs = []
    try:
        launcher.wait_healthy(server, timeout=600)
        generate(server, warm, max_new)
        for _ in range(repeats):
            requests.post(server.url + "/flush_cache", timeout=60)
            t0 = time.perf_counter()
            outs = generate(server, texts, max_new)
            seconds = time.perf_counter() - t0
            tokens = sum(int(o["meta_info"]["completion_tokens"]) for o in outs)
            verify = sum(int(o["meta_info"].get("spec_verify_ct") or 0) for o in outs)
            runs.append({"tokens": tokens, "seconds": seconds, "output_ids": [o["output_ids"] for o in outs],
                         "accept_length": tokens / verify if verify else None})
    finally:
        server.stop()
    return runs


def compare(ids: list[list[int]], ref: list[list[int]]) -> dict:
    """Prompts with identical tokens, and per prompt the first differing position (None: identical)."""
    first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b),
                  None if len(x) == len(y) else min(len(x), len(y))) for x, y in zip(ids, ref, strict=True)]
    return {"prompts_matching": sum(f is None for f in first), "first_divergence": first}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="worktree of the commit before the change")
    ap.add_argument("--after", type=Path, required=True, help="worktree of the commit after the change")
    ap.add_argument("--models", nargs="+", choices=list(FLAGS), default=list(FLAGS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of the workload per server")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmark" / "results" / "cpu_serving_ab.jsonl")
    args = ap.parse_args(argv)
    trees = {"before": args.before, "after": args.after}
    commits = {v: subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, check=True).stdout.strip() for v, t in trees.items()}
    for v, t in trees.items():
        print(v, commits[v], *check_imports(t), flush=True)
    texts = bench_prompts.chat_texts(EMBEDDED, "gsm8k", args.num_prompts + 2)
    texts, warm = texts[:args.num_prompts], texts[args.num_prompts:]
    work = Path(tempfile.mkdtemp(prefix="cpu_serving_ab_"))
    models = {"embedded": EMBEDDED}
    if "published" in args.models:
        sys.path.insert(0, str(ROOT / "test"))
        from support.real_format import published_checkpoint
        models["published"] = published_checkpoint(work / "published")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as out:
        def write(rec: dict) -> None:
            out.write(json.dumps(rec) + "\n")
            out.flush()
            print(json.dumps(rec), flush=True)

        for name in args.models:
            rows: list[dict] = []
            ref: list[list[int]] | None = None
            for rnd in range(args.rounds):
                for variant in ("before", "after"):
                    runs = run_server(models[name], FLAGS[name], trees[variant], texts, warm, args.max_new_tokens,
                                      args.repeats, work / f"{name}_{variant}_{rnd}.log")
                    for rep, r in enumerate(runs):
                        first = ref is None
                        ref = ref if ref is not None else r["output_ids"]
                        cmp = compare(r["output_ids"], ref)
                        same = cmp["prompts_matching"] == len(texts)
                        rec = {"model": name, "variant": variant, "commit": commits[variant], "round": rnd,
                               "repeat": rep, "tokens": r["tokens"], "seconds": round(r["seconds"], 3),
                               "tokens_per_s": round(r["tokens"] / r["seconds"], 2),
                               "outputs_match": same if variant == "after" else None,
                               "same_as_first_before": same, **cmp,
                               "accept_length": r["accept_length"] and round(r["accept_length"], 3), "device": "cpu",
                               "num_prompts": len(texts), "max_new_tokens": args.max_new_tokens,
                               "concurrency": len(texts)}
                        if first or not same:  # the reference tokens, and any that differ from them
                            rec["output_ids"] = r["output_ids"]
                        rows.append(rec)
                        write(rec)
            tps = {v: [r["tokens_per_s"] for r in rows if r["variant"] == v] for v in ("before", "after")}
            med = {v: statistics.median(x) for v, x in tps.items()}
            per_round = {v: [statistics.median(r["tokens_per_s"] for r in rows if r["variant"] == v and r["round"] == i)
                             for i in range(args.rounds)] for v in ("before", "after")}
            write({"model": name, "summary": True, "rounds": args.rounds, "repeats": args.repeats,
                   "commit_before": commits["before"], "commit_after": commits["after"],
                   "median_tokens_per_s_before": med["before"], "median_tokens_per_s_after": med["after"],
                   "ratio_after_before": round(med["after"] / med["before"], 3),
                   "spread_before": [min(tps["before"]), max(tps["before"])],
                   "spread_after": [min(tps["after"]), max(tps["after"])],
                   "round_medians_before": per_round["before"], "round_medians_after": per_round["after"],
                   "outputs_match": all(r["outputs_match"] for r in rows if r["variant"] == "after")})
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
