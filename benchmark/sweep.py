"""Tree vs matched chain vs no speculation over datasets x budgets x batch sizes, against real SGLang servers.

    python benchmark/sweep.py [--quick] [--datasets gsm8k mbpp sharegpt] [--budgets 5 6 7 8]
        [--batch-sizes 1 2 4 8 16 32 64] [--shapes tree chain none] [--tree-shapes 4:4 2:6]
        [--model-path models/tiny-v4] [--num-prompts N | --min-prompts 8 --waves 1] [--max-new-tokens 64]
        [--repeats 1] [--warmup-runs 1] [--device cpu] [--out benchmark/results/tree_vs_chain_cpu.jsonl] [--resume]
        [--reuse-step-times] [--servers tree:16:4:4 chain:5:1:4 none adaptive mtp_tree:8:3:4 --max-servers 5]

One server per (shape, budget) (no speculation: one server in all), reused for every dataset and batch size:
the per-request ``meta_info`` counts make restarts unnecessary. The servers of one budget (tree and chain) run
side by side and each point is measured on one, then the other, so both see the same background load. Each point
sends ``num_prompts`` prompts (default max(--waves x batch size, --min-prompts)) with ``batch_size`` requests in
flight, greedy (temperature 0) and ignoring EOS so every request decodes ``--max-new-tokens`` tokens, as SGLang's
own benchmarks do. Before a point is measured, each server runs it ``--warmup-runs`` times unmeasured: the first
run at a new batch size pays for memory the server touches for the first time (and an adaptive server has not yet
timed its shapes there), which made the first of three runs the slowest on every server on a CPU. One JSONL line
per point (fields: ``bench_common.RECORD_FIELDS`` plus timing extras), flushed as it is measured so a cut-short
run keeps its points. An adaptive server (``--shapes adaptive``) measures its step times at startup into the run's
own cache folder (``--reuse-step-times``: read the user's cache, as a restarted server would). The tree's (K, S)
per budget is ``bench_common.tree_shape``; ``--tree-shapes`` replaces it with explicit shapes. ``--servers`` names
each server instead, ``mtp_tree`` being a tree on the MTP checkpoint ``--mtp-model-path`` (DSpark against MTP on the
same target; records name their model).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402
import bench_prompts  # noqa: E402
import bench_server  # noqa: E402

from sglang_tree_v4.speculative.server_args import checkpoint_score_temperature  # noqa: E402
from sglang_tree_v4.testing import launcher  # noqa: E402

QUICK = {"datasets": ["gsm8k"], "budgets": [6], "batch_sizes": [1, 4], "min_prompts": 4, "max_new_tokens": 16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=str(bc.ROOT / "models" / "tiny-v4"))
    ap.add_argument("--datasets", nargs="+", choices=bc.DATASETS, default=list(bc.DATASETS))
    ap.add_argument("--budgets", nargs="+", type=int, default=list(bc.BUDGETS))
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=list(bc.BATCH_SIZES))
    ap.add_argument("--shapes", nargs="+", choices=bc.SHAPES, default=list(bc.SHAPES))
    ap.add_argument("--tree-shapes", nargs="+", default=None, metavar="K:S",
                    help="explicit tree shapes instead of the per-budget rule (each run at every budget)")
    ap.add_argument("--servers", nargs="+", default=None, metavar="SHAPE[:D:K:S]",
                    help="explicit servers instead of --shapes x --budgets, e.g. tree:16:4:4 chain:5:1:4 none "
                         "adaptive mtp_tree:8:3:4 (mtp_tree: a tree on --mtp-model-path, beside --model-path's)")
    ap.add_argument("--mtp-model-path", default=str(bc.ROOT / "models" / "tiny-v4"),
                    help="the MTP checkpoint of --servers mtp_tree (same target as --model-path: a DSpark model's "
                         "tiny-v4)")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="prompts per point (default max(waves x bs, min-prompts))")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--waves", type=int, default=1,
                    help="prompts per point as a multiple of the batch size: with more than one wave the server "
                         "holds the batch size for that many requests' lifetimes (closer to steady serving, and a "
                         "run long enough that a stretch of a slow machine does not decide it)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1,
                    help="measure each point this many times (in turn across the servers); the median run is kept")
    ap.add_argument("--warmup-runs", type=int, default=1,
                    help="unmeasured runs of each point on each server before its measured ones")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--respect-eos", action="store_true", help="stop at EOS (default: ignore it, fixed length)")
    ap.add_argument("--device", default=None, help="launch_server --device (default: cuda if present, else cpu)")
    ap.add_argument("--server-args", default="", help="extra launch_server flags, one quoted string")
    ap.add_argument("--out", default=str(bc.ROOT / "benchmark" / "results" / "tree_vs_chain_cpu.jsonl"))
    ap.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    ap.add_argument("--max-servers", type=int, default=2,
                    help="servers of one budget run side by side (tree and chain measured alternately)")
    ap.add_argument("--resume", action="store_true", help="append, skipping points already in --out")
    ap.add_argument("--reuse-step-times", action="store_true",
                    help="let the adaptive server read the user's step-time cache (default: it measures afresh)")
    ap.add_argument("--quick", action="store_true",
                    help="small grid (GSM8K, D=6, batch 1 and 4, 4 prompts, 16 tokens): a few minutes on a CPU")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def adaptive_config(model_path: str) -> tuple[str, int, int, int]:
    """The adaptive server's record fields: its largest shape (DSpark's own for a DSpark checkpoint)."""
    from sglang_tree_v4.dsv4.config import DSV4Config, read_checkpoint_config
    from sglang_tree_v4.dsv4.dspark import DSparkConfig
    from sglang_tree_v4.speculative.server_args import (
        DEFAULT_DRAFT_TOKENS,
        DEFAULT_STEPS,
        DEFAULT_TOPK,
        dspark_adaptive_budget,
    )
    raw = read_checkpoint_config(model_path)
    cfg = DSV4Config.from_dict(raw)
    dspark = DSparkConfig.from_dict(raw, cfg.num_layers, cfg.vocab_size)
    if dspark is not None:
        return ("adaptive", *dspark_adaptive_budget(dspark.block_size))
    return "adaptive", DEFAULT_DRAFT_TOKENS, DEFAULT_TOPK, DEFAULT_STEPS


def explicit_configs(specs: list[str], model_path: str) -> list[tuple[str, int, int, int]]:
    """``--servers``: SHAPE:D:K:S each (``none``, ``adaptive``: no numbers)."""
    out = []
    for spec in specs:
        shape, *numbers = spec.split(":")
        if shape == "none" and not numbers:
            out.append(("none", 1, 0, 0))
        elif shape == "adaptive" and not numbers:
            out.append(adaptive_config(model_path))
        elif shape in ("tree", "chain", "mtp_tree") and len(numbers) == 3:
            out.append((shape, *(int(x) for x in numbers)))
        else:
            raise SystemExit(f"--servers {spec!r}: expected tree|chain|mtp_tree:D:K:S, none or adaptive")
    return out


def server_configs(args: argparse.Namespace) -> list[tuple[str, int, int, int]]:
    """(shape, budget, topk, num_steps) of each server to start, in run order."""
    if args.servers:
        return explicit_configs(args.servers, args.model_path)
    out = []
    for d in args.budgets:
        if "tree" in args.shapes:
            shapes = [tuple(int(x) for x in s.split(":")) for s in args.tree_shapes] if args.tree_shapes else [
                bc.tree_shape(d)]
            out += [("tree", d, k, s) for k, s in shapes]
        if "chain" in args.shapes:
            out.append(("chain", d, *bc.chain_shape(d)))
    if "none" in args.shapes:
        out.append(("none", 1, 0, 0))
    if "adaptive" in args.shapes:
        out.append(adaptive_config(args.model_path))
    return out


def server_groups(configs: list[tuple], max_servers: int) -> list[list[tuple]]:
    """Configurations that run side by side: all of them when they fit in ``max_servers``, else same budget, at
    most ``max_servers`` at a time."""
    if len(configs) <= max_servers:
        return [list(configs)] if configs else []
    groups: list[list[tuple]] = []
    for c in configs:
        if groups and groups[-1][0][1] == c[1] and len(groups[-1]) < max_servers:
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


def _measure_point(server, texts, bs, sampling) -> dict:
    before = bench_server.shape_steps(server)
    m = bench_server.measure(server, texts, bs, sampling)
    after = bench_server.shape_steps(server)
    if after:  # TREE_V4's steps per tree shape during this point ("none": no speculation)
        m["shape_steps"] = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0) > 0}
    return m


def _median_run(ms: list[dict]) -> dict:
    """With ``--repeats`` > 1: the run of median throughput (its metrics, so they stay consistent with each other),
    every run's throughput, and the adaptive server's steps per shape summed over the runs."""
    if len(ms) == 1:
        return ms[0]
    m = dict(sorted(ms, key=lambda r: r["output_throughput"])[len(ms) // 2])
    m["repeats"] = len(ms)
    m["output_throughput_runs"] = [round(r["output_throughput"], 2) for r in ms]
    if any("shape_steps" in r for r in ms):
        total: dict[str, int] = {}
        for r in ms:
            for k, v in r.get("shape_steps", {}).items():
                total[k] = total.get(k, 0) + v
        m["shape_steps"] = total
    return m


def model_path(cfg: tuple, args: argparse.Namespace) -> str:
    return args.mtp_model_path if cfg[0] == "mtp_tree" else args.model_path


def run_group(group, points, args, texts, n_for, sampling, provenance, log_dir: Path, out, bar) -> int:
    """Start the group's servers (an adaptive one first), then measure each point on each server in turn, so that
    the shapes compared at a point see the same background load (the machine may be shared). -> failed
    configurations."""
    servers: dict[tuple, bench_server.Server] = {}
    failures = 0
    try:
        # An adaptive server times its steps at startup: it starts first and alone, as a user's server would, not
        # next to four others loading (which made that measurement up to 5x off on the CPU).
        for cfg in sorted(group, key=lambda c: c[0] != "adaptive"):
            shape, budget, topk, steps = cfg
            log = log_dir / f"server_{shape}_D{budget}_K{topk}_S{steps}.log"
            flags = (["--speculative-algorithm", "TREE_V4"] if shape == "adaptive" else
                     bench_server.spec_args(topk, steps, budget))
            # Its step-time cache is the run's own unless asked otherwise: a cache file measured earlier on a busy
            # machine (a test run beside it) would be read back as this machine's step times.
            env = None if shape != "adaptive" or args.reuse_step_times else launcher.clean_env(
                XDG_CACHE_HOME=str(log_dir / "step_time_cache"))
            servers[cfg] = bench_server.launch(model_path(cfg, args), args.device, flags + args.server_args.split(),
                                               log, env=env)
            if shape == "adaptive":
                try:
                    bench_server.wait_healthy(servers[cfg])
                except Exception:  # noqa: BLE001 - reported by the health check below
                    pass
        bar.set_postfix_str("starting " + ", ".join(f"{c[0]} D={c[1]} K={c[2]} S={c[3]}" for c in group))
        for cfg in list(servers):
            try:
                bench_server.wait_healthy(servers[cfg])
                first = next(ds for c, ds, _ in points if c == cfg)
                bench_server.measure(servers[cfg], texts[first][:1], 1, {**sampling, "max_new_tokens": 8})  # warm-up
            except Exception as e:  # noqa: BLE001 - one bad configuration must not lose the rest of the grid
                failures += 1
                tqdm.write(f"FAILED to start {cfg}: {e!r} (log: {servers[cfg].log})")
                servers.pop(cfg).stop()
                bar.update(sum(1 for c, _, _ in points if c == cfg))
        for ds in args.datasets:
            for bs in args.batch_sizes:
                runs: dict[tuple, list[dict]] = {cfg: [] for cfg in servers if (cfg, ds, bs) in points}
                for _ in range(args.warmup_runs):
                    for cfg in runs:
                        try:
                            bench_server.measure(servers[cfg], texts[ds][:n_for[bs]], bs, sampling)
                        except Exception:  # noqa: BLE001 - reported by the measured runs below
                            pass
                for rep in range(args.repeats):  # in turn, so every shape sees each stretch of background load,
                    order = list(runs)  # starting one server later each time (no server always runs first)
                    first = rep % len(order) if order else 0
                    for cfg in order[first:] + order[:first]:
                        shape, budget, topk, steps = cfg
                        bar.set_postfix_str(f"{shape} D={budget} K={topk} S={steps} {ds} bs={bs}")
                        try:
                            runs[cfg].append(_measure_point(servers[cfg], texts[ds][:n_for[bs]], bs, sampling))
                        except Exception as e:  # noqa: BLE001
                            failures += 1
                            tqdm.write(f"FAILED {cfg} {ds} bs={bs}: {e!r} (log: {servers[cfg].log})")
                            bar.update(1)
                            runs.pop(cfg)
                for cfg, ms in runs.items():
                    shape, budget, topk, steps = cfg
                    m = _median_run(ms)
                    rec = {"dataset": ds, "budget": budget, "batch_size": bs, "shape": shape, "topk": topk,
                           "num_steps": steps, **m, **provenance[model_path(cfg, args)], "timestamp": time.time()}
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
                    bar.update(1)
    finally:
        for server in servers.values():
            server.stop()
    return failures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if args.resume and out_path.exists():
        done = {bc.record_key(r) for r in bc.load_records(out_path)}
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="sweep-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    n_for = {bs: args.num_prompts or max(args.waves * bs, args.min_prompts) for bs in args.batch_sizes}
    texts = {ds: bench_prompts.chat_texts(args.model_path, ds, max(n_for.values())) for ds in args.datasets}
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "ignore_eos": not args.respect_eos}
    configs = server_configs(args)
    provenance = {path: {"model": Path(path).name, "model_sha256": bc.weights_digest(path),
                         "draft_score_temperature": checkpoint_score_temperature(path), "device": args.device,
                         "sglang_version": bc.sglang_version(), "git_commit": bc.git_commit(),
                         "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                         "ignore_eos": not args.respect_eos}
                  for path in {model_path(c, args) for c in configs}}
    points = [(c, ds, bs) for c in configs for ds in args.datasets for bs in args.batch_sizes
              if (ds, c[1], bs, c[0], c[2], c[3]) not in done]
    failures = 0
    bar = tqdm(total=len(points), desc="sweep", unit="pt")
    with open(out_path, "a" if args.resume else "w") as out:
        for group in server_groups([c for c in configs if any(p[0] == c for p in points)], args.max_servers):
            failures += run_group(group, points, args, texts, n_for, sampling, provenance, log_dir, out, bar)
    bar.close()
    print(f"wrote {out_path} ({len(points)} points planned, {failures} failures)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
