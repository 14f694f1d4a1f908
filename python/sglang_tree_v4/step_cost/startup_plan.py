"""The adaptive budget's startup measurement, planned and estimated without running it:

    python -m sglang_tree_v4.step_cost.startup_plan CONFIG [--tp N] [--device cuda|cpu]
        [--speculative-num-draft-tokens D --speculative-eagle-topk K --speculative-num-steps S]
        [--max-running-requests B] [--context L] [--gpu-check FILE]

Prints the plan ``measure.startup_plan`` gives the server for that device (shapes x passes) and how long it would
take, then one JSON object on its last line. Why: the measurement runs once per (checkpoint, device, shape limits)
at startup, and on a GPU it must stay under a minute; no GPU is at hand to time it, so each timed point's seconds
come from a model of the GPU:

* without ``--gpu-check``: the step-cost counter (``step_cost``) on the meta device, one TP rank of the model at
  ``--context`` committed tokens, a point costing its bytes at 4.8 TB/s plus 5 us of host time per launch (the
  measurement's steps run eagerly); counted at the smallest and largest batch, at S = 1 and S, D = 2 and D, and
  without speculation, and interpolated in between;
* with ``--gpu-check FILE`` (``benchmark/gpu_check.py`` records from a GPU): the eager one-layer times measured there
  at 8K context (the mean of the CSA and HCA layer, times the model's layers; a draft step as the MTP record).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from ..speculative.adaptive.config import DEFAULT
from ..speculative.adaptive.measure import startup_plan
from ..speculative.adaptive.timing import Curve

BYTES_PER_S = 4.8e12  # an H200's memory bandwidth
LAUNCH_S = 5e-6  # host time of one eagerly launched op


def counted_seconds(config_path: str, tp: int, context: int, max_tokens: int, topk: int, max_steps: int,
                    batches: tuple[int, ...]):
    """``seconds(kind, batch, size)`` from bytes and launches counted on meta at the corner shapes."""
    from .__main__ import build
    from .counter import StepCounter
    from .round import run_round

    model = build(config_path, tp, 0)
    weights = list(model.parameters()) + list(model.buffers())

    def count(batch: int, d: int, k: int, s: int) -> dict[str, float]:
        counter = StepCounter(weights=weights)
        run_round(model, counter, batch, context, d, k, s, tp, 0)
        out: dict[str, float] = {"draft": 0.0, "verify": 0.0}
        for op in counter.ops:
            if op.phase in out:
                out[op.phase] += (sum(op.read.values()) + sum(op.written.values())) / BYTES_PER_S
                out[op.phase] += op.launches * LAUNCH_S
        return out

    ends = sorted({batches[0], batches[-1]})
    wide, narrow, none = {}, {}, {}
    for b in ends:
        wide[b] = count(b, max_tokens, topk, max(max_steps, 1))
        narrow[b] = count(b, 2, 1, 1)
        none[b] = count(b, 1, 1, 0)

    def seconds(kind: str, batch: int, size: int) -> float:
        if kind == "draft":
            lo, hi, x0, x1 = narrow, wide, 1, max_steps
        elif size == 1:
            return Curve({b: none[b]["verify"] for b in ends})(batch)
        else:
            lo, hi, x0, x1 = narrow, wide, 2, max_tokens
        at = {b: Curve({x0: lo[b][kind], x1: hi[b][kind]} if x1 != x0 else {x0: hi[b][kind]})(size) for b in ends}
        return Curve(at)(batch)

    return seconds, model.cfg.num_layers


def measured_seconds(records: list[dict], num_layers: int):
    """``seconds(kind, batch, size)`` from gpu_check's eager layer and MTP records at the 8K context."""
    layer: dict[tuple[int, int], list[float]] = {}
    mtp: dict[int, float] = {}
    for r in records:
        if r.get("error") or not r.get("median_ms") or r.get("context") not in (8192, None):
            continue
        if r["op"] in ("layer:csa", "layer:hca") and not r["graph"]:
            layer.setdefault((r["batch"], r["draft_tokens"]), []).append(r["median_ms"] / 1e3)
        elif r["op"] == "mtp":
            mtp[r["batch"]] = r["median_ms"] / 1e3
    if not layer or not mtp:
        raise ValueError("the gpu_check records hold no eager layer or MTP timings at context 8192")
    per_layer = {key: statistics.mean(v) * num_layers for key, v in layer.items()}

    def seconds(kind: str, batch: int, size: int) -> float:
        if kind == "draft":
            return size * Curve(mtp)(batch)
        by_d = {d: Curve({b: t for (b, dd), t in per_layer.items() if dd == d})(batch)
                for d in {d for _, d in per_layer}}
        return Curve(by_d)(size)

    return seconds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="a checkpoint folder or its config.json")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="whose plan (default: a GPU's)")
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=16)
    ap.add_argument("--speculative-eagle-topk", type=int, default=4)
    ap.add_argument("--speculative-num-steps", type=int, default=8)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=DEFAULT.MEASURE_CONTEXT,
                    help="committed tokens per synthetic request (the server's: MEASURE_CONTEXT)")
    ap.add_argument("--gpu-check", help="benchmark/gpu_check.py records (JSONL) to take the point times from")
    args = ap.parse_args(argv)
    path = args.config
    if not (os.path.isfile(path) or os.path.isfile(os.path.join(path, "config.json"))):
        ap.error(f"config: no config.json at {path}")
    D, K, S = args.speculative_num_draft_tokens, args.speculative_eagle_topk, args.speculative_num_steps
    if D < 2 or K < 1 or not 1 <= S <= D - 1:
        ap.error(f"--speculative-num-draft-tokens {D}, --speculative-eagle-topk {K}, --speculative-num-steps {S}: "
                 "need D >= 2, K >= 1 and 1 <= S <= D - 1")
    plan = startup_plan(D, K, S, args.max_running_requests, torch.device(args.device))
    try:
        seconds, layers = counted_seconds(path, args.tp, args.context, D, K, S, plan.batches)
        source = f"bytes at {BYTES_PER_S / 1e12:.1f} TB/s + {LAUNCH_S * 1e6:.0f} us per launch (step-cost counter)"
        if args.gpu_check:
            with open(args.gpu_check) as f:
                seconds = measured_seconds([json.loads(line) for line in f if line.strip()], layers)
            source = f"gpu_check records ({args.gpu_check})"
    except ValueError as e:  # ConfigError names the key or the flag
        print(f"plan: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    estimate = plan.estimate(seconds)
    print(f"startup measurement on {args.device}: {plan.describe()}")
    print(f"estimated on a GPU: {estimate:.1f} s ({source})")
    print(json.dumps({"device": args.device, "batches": plan.batches, "draft_steps": plan.draft_steps,
                      "verify_widths": plan.verify_widths, "passes": plan.passes, "points": plan.points,
                      "estimate_s": round(estimate, 2), "source": source, "tp": args.tp, "config": path,
                      "draft_tokens": D, "topk": K, "steps": S, "max_running_requests": args.max_running_requests}))


if __name__ == "__main__":
    main()
