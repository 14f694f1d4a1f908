"""What a TREE_V4 step that does not speculate costs, against plain decoding, side by side on real servers.

    python benchmark/none_step_cost.py [--model-path models/tiny-v4] [--batch-sizes 16 64] [--max-new-tokens 128]
        [--repeats 4] [--servers NAME ...] [--out benchmark/results/none_step_cost_cpu.jsonl]

Why: where no tree pays (large batches on a CPU), the adaptive budget runs nearly every step without speculation,
so its throughput there is that step's against plain SGLang's decode step. By default four servers run side by
side: plain SGLang with and without overlap scheduling, and the default TREE_V4 forced never to speculate (the test
mutation ``never_speculate``, ``test/support/mutations``) with and without overlap scheduling (forced on with
``SGLANG_TREE_V4_OVERLAP=1``: TREE_V4 drops it on a CPU); ``--servers`` picks others, e.g. the adaptive TREE_V4
with and without overlap, or the adaptive one against the fixed chain D2 K1 S1. Each point is run once
unmeasured, then ``--repeats`` times with the servers interleaved, and the median output tokens/s is kept (greedy,
EOS ignored, GSM8K chat prompts), with each one's ratio to the first of ``--servers``. The forced servers must
report only ``none`` steps.
"""
from __future__ import annotations

import argparse
import json
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

from sglang_tree_v4.speculative.server_args import OVERLAP_ENV  # noqa: E402
from sglang_tree_v4.testing import launcher  # noqa: E402
from support import serving_checks  # noqa: E402

NO_OVERLAP = ["--disable-overlap-schedule"]
TREE_V4 = ["--speculative-algorithm", "TREE_V4"]
SERVERS = {  # name -> (launch_server flags, forced never to speculate)
    "plain_overlap": ([], False),
    "plain_no_overlap": (NO_OVERLAP, False),
    "tree_v4_none_overlap": (TREE_V4, True),
    "tree_v4_none_no_overlap": (TREE_V4 + NO_OVERLAP, True),
    "tree_v4_adaptive_overlap": (TREE_V4, False),
    "tree_v4_adaptive_no_overlap": (TREE_V4 + NO_OVERLAP, False),
    # the matched chain D2 K1 S1: the shape the adaptive server mostly picks at batch 16-32 on this CPU
    "tree_v4_chain2_no_overlap": (TREE_V4 + NO_OVERLAP + ["--speculative-num-draft-tokens", "2",
                                                          "--speculative-eagle-topk", "1",
                                                          "--speculative-num-steps", "1"], False),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=str(ROOT / "models" / "tiny-v4"))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--servers", nargs="+", choices=sorted(SERVERS), default=list(SERVERS)[:4])
    ap.add_argument("--dataset", default="gsm8k", choices=["gsm8k", "mbpp", "sharegpt"])
    ap.add_argument("--out", default=str(ROOT / "benchmark" / "results" / "none_step_cost_cpu.jsonl"))
    args = ap.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="none_step_cost_"))
    common = ["--device", "cpu", "--sleep-on-idle", "--max-running-requests", str(max(args.batch_sizes)),
              "--max-total-tokens", "65536"]
    cache = str(logs / "cache")
    started = {}
    for name in args.servers:
        flags, forced = SERVERS[name]
        log = logs / f"{name}.log"
        overlap = {OVERLAP_ENV: "1"} if name.startswith("tree_v4") and NO_OVERLAP[0] not in flags else {}
        started[name] = (serving_checks.launch_mutated(args.model_path, common + flags, "never_speculate", log,
                                                       XDG_CACHE_HOME=cache, **overlap) if forced else
                         launcher.launch(args.model_path, common + flags, log, env=launcher.clean_env(**overlap)))
    try:
        servers = {name: launcher.wait_healthy(s) for name, s in started.items()}
        texts = bench_prompts.chat_texts(args.model_path, args.dataset, max(args.batch_sizes + [8]))
        sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
        records = []
        for bs in args.batch_sizes:
            runs: dict[str, list[float]] = {name: [] for name in servers}
            for i in range(args.repeats + 1):
                for name, server in servers.items():
                    got = bench_server.measure(server, texts[:max(bs, 8)], bs, sampling)
                    if i:  # the first run of each point is a warm-up
                        runs[name].append(got["output_throughput"])
            for name, server in servers.items():
                steps = bench_server.shape_steps(server)
                if SERVERS[name][1] and set(steps) != {"none"}:
                    raise RuntimeError(f"{name} speculated: {steps}")
            base = statistics.median(runs[args.servers[0]])
            for name, values in runs.items():
                rec = {"server": name, "dataset": args.dataset, "batch_size": bs, "max_new_tokens": args.max_new_tokens,
                       "output_throughput_median": statistics.median(values), "runs": values,
                       f"vs_{args.servers[0]}": statistics.median(values) / base,
                       "commit": bench_common.git_commit()}
                records.append(rec)
                print(json.dumps(rec), flush=True)
        bench_common.write_records(args.out, records)
    finally:
        for s in started.values():
            s.stop()


if __name__ == "__main__":
    main()
