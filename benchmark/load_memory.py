"""Peak host memory while one tensor-parallel rank loads a published-layout DeepSeek-V4 checkpoint from disk.

    python benchmark/load_memory.py [--out benchmark/results/load_memory_cpu.jsonl] [--tp 2]

Writes a random V4 (hidden 1024, 4 layers + MTP, 32 experts of 512, vocabulary 16384: about 0.3 GB in the
published FP8/FP4 layout, 1 GB shards + index) with ``checkpoint.weights.save_published``, then, in a fresh process per
(tp, rank), does what a server rank does -- ``build_model`` on the meta device with SGLang's parallel layers for
that rank (``tp.shard_model`` under a parallel-context override), allocate, stream the files in through
safetensors slice handles (``StreamingLoader``) -- and records, from ``/proc/self/status``, the process's resident
memory before the build and its peak during build + load: anonymous memory (sampled every 2 ms by a thread) and
``VmHWM`` (which also counts the checkpoint pages the read touched, file-backed and reclaimable). The budget is
1.2 x the rank's parameter bytes + the largest checkpoint tensor.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time

from bench_common import git_commit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = dict(vocab_size=16384, hidden_size=1024, num_attention_heads=8, head_dim=128, q_lora_rank=256,
              o_groups=4, o_lora_rank=128, n_routed_experts=32, moe_intermediate_size=512, index_n_heads=8,
              index_head_dim=64)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def write_checkpoint(path: str) -> None:
    import torch

    from sglang_tree_v4.checkpoint.weights import save_published
    from sglang_tree_v4.dsv4.config import DSV4Config
    from sglang_tree_v4.dsv4.model import DSV4Model

    with open(os.path.join(ROOT, "models", "tiny-v4", "config.json")) as f:
        raw = json.load(f)
    raw.update(SHAPES)
    raw.pop("tree_v4", None)
    torch.manual_seed(0)
    model = DSV4Model(DSV4Config.from_dict(raw))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    save_published(model, path)


def measure_rank(path: str, tp: int, rank: int) -> dict:
    """One rank's build + load in this process (call it in a fresh one)."""
    import torch
    from safetensors import safe_open
    from sglang.srt.runtime_context import get_parallel

    from sglang_tree_v4.checkpoint.swap import build_model, parameter_bytes
    from sglang_tree_v4.checkpoint.tp import shard_model
    from sglang_tree_v4.checkpoint.weights import (
        _FILE_DTYPES,
        StreamingLoader,
        iter_safetensors,
    )
    from sglang_tree_v4.dsv4.config import DSV4Config

    torch.set_num_threads(1)
    largest = 0
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as h:
                for k in h.keys():
                    s = h.get_slice(k)
                    n = math.prod(s.get_shape()) * _FILE_DTYPES[s.get_dtype()].itemsize
                    largest = max(largest, n)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    # Warm-up: the same build on the meta device (no memory) imports SGLang's layer modules (lazily imported by
    # ``tp``), so the baseline below holds the interpreter and its libraries and the peak only the model and load.
    with get_parallel().override(tp_size=tp, tp_rank=rank):
        build_model(DSV4Config.from_dict(raw), raw, device="meta", shard=shard_model)
    peak_anon, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak_anon[0] = max(peak_anon[0], _status("RssAnon"))
            time.sleep(0.002)

    before_anon, before_hwm = _status("RssAnon"), _status("VmRSS")
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    with get_parallel().override(tp_size=tp, tp_rank=rank):
        model = build_model(DSV4Config.from_dict(raw), raw, dtype=torch.bfloat16, device="cpu", shard=shard_model)
    loader = StreamingLoader(model)
    with torch.no_grad():
        for name, t in iter_safetensors(path, lazy=True):
            loader.feed(name, t)
    loader.finish()
    load_s = time.perf_counter() - start
    stop.set()
    sampler.join()
    params = parameter_bytes(model)["param_bytes_per_rank"]
    anon = max(peak_anon[0], _status("RssAnon")) - before_anon
    hwm = _status("VmHWM") - before_hwm
    return {"tp": tp, "tp_rank": rank, "param_bytes": params, "largest_tensor_bytes": largest,
            "peak_anon_bytes": anon, "peak_rss_bytes": hwm, "anon_ratio": round(anon / params, 3),
            "rss_ratio": round(hwm / params, 3), "budget_bytes": int(1.2 * params + largest),
            "within_budget_anon": anon <= 1.2 * params + largest, "load_s": round(load_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmark", "results", "load_memory_cpu.jsonl"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rank-of", nargs=3, metavar=("PATH", "TP", "RANK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_of:
        print(json.dumps(measure_rank(args.rank_of[0], int(args.rank_of[1]), int(args.rank_of[2]))))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(tmp)
        on_disk = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.endswith(".safetensors"))
        for tp, rank in [(1, 0)] + [(args.tp, r) for r in range(args.tp)]:
            done = subprocess.run([sys.executable, __file__, "--rank-of", tmp, str(tp), str(rank)],
                                  capture_output=True, text=True, check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            row["checkpoint_bytes"] = on_disk
            row["commit"] = git_commit()
            rows.append(row)
            print(json.dumps(row))
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
