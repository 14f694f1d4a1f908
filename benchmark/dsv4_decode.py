"""Decode latency of the plain-torch DeepSeek-V4 (per-slot state) vs HF transformers' DeepseekV4ForCausalLM at a
tiny config on the CPU, one thread, fp32. Prints the median ms per decoded token for each.

    python benchmark/dsv4_decode.py [--hca 8] [--prompt 64] [--steps 64]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "test"))
from sglang_tree_v4.testing.runner import DSV4Runner  # noqa: E402
from support.hf_reference import C, H, S, build_hf, ours_from_hf  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hca", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # the tiny config of the design notes: 6 layers (2 sliding, CSA/HCA alternating), hidden 256
    hf = build_hf(args.hca, seed=0, layers=(S, S, C, H, C, H), hidden=256, moe_inter=128)
    ours = ours_from_hf(hf)
    prompt = torch.randint(0, 512, (args.prompt,), generator=torch.Generator().manual_seed(0))

    # ours and HF decode in lockstep (one step each, alternating) so both see the same machine load
    from transformers import DynamicCache
    r = DSV4Runner(ours, num_slots=args.prompt + args.steps + 8)
    rid = r.add_request()
    tok_o = int(r.extend([rid], [prompt])[0].logits[-1].argmax())
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        tok_h = int(hf(prompt[None], past_key_values=cache, use_cache=True).logits[0, -1].argmax())
    ours_ms, hf_ms, ours_cpu, hf_cpu, ours_toks, hf_toks = [], [], [], [], [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        tok_o = int(r.decode([rid], [tok_o])[0].logits[-1].argmax())
        ours_ms.append((time.perf_counter() - t0) * 1e3)
        ours_cpu.append((time.process_time() - c0) * 1e3)
        ours_toks.append(tok_o)
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            tok_h = int(hf(torch.tensor([[tok_h]]), past_key_values=cache, use_cache=True).logits[0, -1].argmax())
        hf_ms.append((time.perf_counter() - t0) * 1e3)
        hf_cpu.append((time.process_time() - c0) * 1e3)
        hf_toks.append(tok_h)

    mo, mh = statistics.median(ours_ms), statistics.median(hf_ms)
    print(f"config: 6 layers [S,S,CSA,HCA{args.hca},CSA,HCA{args.hca}], hidden 256, fp32, threads {args.threads}, "
          f"prompt {args.prompt}, {args.steps} greedy steps")
    co, ch = statistics.median(ours_cpu), statistics.median(hf_cpu)
    print(f"ours (per-slot state): median {mo:.2f} ms/token wall, {co:.2f} ms CPU")
    print(f"HF transformers:       median {mh:.2f} ms/token wall, {ch:.2f} ms CPU")
    print(f"speed-up {mh / mo:.2f}x; greedy tokens identical: {ours_toks == hf_toks}")


if __name__ == "__main__":
    main()
