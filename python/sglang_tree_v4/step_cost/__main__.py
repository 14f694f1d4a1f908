"""Step-cost report: the bytes and launches of one TREE_V4 round on one TP rank, counted on the meta device.

    python -m sglang_tree_v4.step_cost CONFIG --tp N [--tp-rank R] --batch B --context L
        [--speculative-num-draft-tokens D --speculative-eagle-topk K --speculative-num-steps S | --no-spec]
        [--kv-cache-dtype auto|fp8_e4m3]

It builds the model the server builds for that rank (the checkpoint's quantization swapped in, SGLang's parallel
layers for ``--tp N``) on the meta device, runs one round's device work (``round.run_round``: greedy acceptance)
and counts every op (``counter``). The last line of output is one JSON object: ``bytes_total`` and its split
``bytes_by_class`` (weights, state, activations) and ``bytes_by_phase``; ``bytes_floor``, what the round cannot
avoid moving (non-expert weights once per forward, per MoE layer ``min(local experts, tokens x top_k)`` experts,
the embedding rows of its tokens, and the state its queries must read: per request and layer the window keys, the
CSA index keys and the selected entries, the HCA entries), ``ms_floor_h200`` (the floor at 4.8 TB/s);
``launches_total``, ``launches_per_layer`` (the largest decoder layer of the verify forward), ``launches_metadata``
(the verify forward's per-forward metadata: rope tables, slot lists and rows that every layer shares, computed once
by the layer that first needs them and charged to the forward, ``round.forward_metadata``), ``largest_write_bytes``
and ``routed_expert_bytes`` (one expert's bytes on this rank).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

H200_BYTES_PER_S = 4.8e12
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def build(config_path: str, tp: int, tp_rank: int, dtype: torch.dtype = torch.bfloat16):
    """The server's model for one rank, on meta."""
    from sglang.srt.runtime_context import get_parallel

    from ..checkpoint.fuse import fuse_projections
    from ..checkpoint.swap import build_model
    from ..checkpoint.tp import shard_model
    from ..dsv4.config import DSV4Config

    file = os.path.join(config_path, "config.json") if os.path.isdir(config_path) else config_path
    with open(file) as f:
        raw = json.load(f)
    cfg = DSV4Config.from_dict(raw)
    with get_parallel().override(tp_size=tp, tp_rank=tp_rank):
        model = build_model(cfg, raw, with_mtp=True, dtype=dtype, device="meta", shard=shard_model if tp > 1 else None)
    fuse_projections(model)  # as the server does once its weights are loaded
    return model


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _experts(module) -> list:
    from ..dsv4.moe import Experts
    return [m for m in module.modules() if isinstance(m, Experts)]


def floor_bytes(model, batch: int, context: int, draft: int, topk: int, steps: int, entry_bytes: int) -> dict:
    """What the round must move at least, by the rule in the module docstring."""
    cfg = model.cfg
    experts = _experts(model)
    expert_tensors = {id(t) for m in experts for t in list(m.parameters()) + list(m.buffers())}
    held = experts[0].w1.shape[0]
    one_expert = _bytes(list(experts[0].parameters()) + list(experts[0].buffers())) // held

    def nonexpert(module, skip=()) -> int:
        ts = [t for t in list(module.parameters()) + list(module.buffers()) if id(t) not in expert_tensors]
        return _bytes(t for t in ts if id(t) not in skip)

    embed = {id(t) for t in model.embed.parameters()}
    mtp = {id(t) for t in model.mtp.parameters()} | {id(t) for t in model.mtp.buffers()}
    target_weights = nonexpert(model, embed | mtp)
    mtp_weights = nonexpert(model.mtp) + _bytes(model.head.parameters())  # the MTP reads the target's head
    row = model.embed.weight.shape[1] * model.embed.weight.element_size()

    def forward(tokens: int, layers: int, weights: int) -> int:
        return weights + layers * min(held, tokens * cfg.num_experts_per_tok) * one_expert + tokens * row

    # state per request: every layer's window keys; CSA index keys and selected entries; HCA entries
    window = min(context, cfg.window) * cfg.head_dim * entry_bytes
    per_request = 0
    for r in cfg.compress_ratios:
        per_request += window
        if r == 4:
            per_request += (context // r) * cfg.index_head_dim * entry_bytes
            per_request += min(cfg.index_topk, context // r) * cfg.head_dim * entry_bytes
        elif r > 0:
            per_request += (context // r) * cfg.head_dim * entry_bytes
    state = batch * per_request
    verify = forward(batch * draft, cfg.num_layers, target_weights)
    mtp_layers = len(model.mtp)
    drafting = 0
    if draft > 1:
        drafting = forward(batch * draft, mtp_layers, mtp_weights)  # the catch-up that drafts the root
        drafting += (steps - 1) * forward(batch * topk, mtp_layers, mtp_weights)
        drafting += (1 + steps - 1) * batch * mtp_layers * window  # the MTP's window keys per step
    return {"bytes_floor": verify + drafting + state, "floor_by_part": {
        "verify_weights": verify, "draft": drafting, "state": state}, "routed_expert_bytes": one_expert,
        "local_experts": held}


def report(config_path: str, tp: int = 1, tp_rank: int = 0, batch: int = 1, context: int = 8192, draft: int = 8,
           topk: int = 3, steps: int = 4, kv_cache_dtype: str = "auto") -> dict:
    from .counter import StepCounter
    from .round import run_round

    start = time.perf_counter()
    model = build(config_path, tp, tp_rank)
    entry_format = None if kv_cache_dtype == "auto" else kv_cache_dtype
    counter = StepCounter(weights=list(model.parameters()) + list(model.buffers()))
    run_round(model, counter, batch, context, draft, topk, steps, tp, tp_rank, entry_format)
    out = counter.summary()
    entry_bytes = 1 if entry_format else model.embed.weight.element_size()
    out.update(floor_bytes(model, batch, context, draft, topk, steps, entry_bytes))
    out["ms_floor_h200"] = round(out["bytes_floor"] / H200_BYTES_PER_S * 1e3, 3)
    out["ms_total_h200"] = round(out["bytes_total"] / H200_BYTES_PER_S * 1e3, 3)
    out["total_over_floor"] = round(out["bytes_total"] / out["bytes_floor"], 3)
    out.update(config=config_path, tp=tp, tp_rank=tp_rank, batch=batch, context=context, draft_tokens=draft,
               topk=topk, steps=steps, kv_cache_dtype=kv_cache_dtype, count_s=round(time.perf_counter() - start, 1))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="a checkpoint folder or its config.json")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=8192, help="committed tokens per request")
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=8)
    ap.add_argument("--speculative-eagle-topk", type=int, default=3)
    ap.add_argument("--speculative-num-steps", type=int, default=4)
    ap.add_argument("--no-spec", action="store_true", help="a decode step without speculation")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    args = ap.parse_args(argv)
    path = args.config
    if not (os.path.isfile(path) or os.path.isfile(os.path.join(path, "config.json"))):
        ap.error(f"config: no config.json at {path}")
    if args.tp < 1 or not 0 <= args.tp_rank < args.tp:
        ap.error(f"--tp-rank must be in [0, --tp), got --tp {args.tp} --tp-rank {args.tp_rank}")
    for flag, value in (("--batch", args.batch), ("--context", args.context)):
        if value < 1:
            ap.error(f"{flag} must be positive, got {value}")
    D, K, S = (1, 1, 0) if args.no_spec else (args.speculative_num_draft_tokens, args.speculative_eagle_topk,
                                                args.speculative_num_steps)
    if not args.no_spec and (D < 2 or K < 1 or S < 1 or S > D - 1):
        ap.error(f"--speculative-num-draft-tokens {D}, --speculative-eagle-topk {K}, --speculative-num-steps {S}: "
                 "need D >= 2, K >= 1 and 1 <= S <= D - 1")
    try:
        out = report(path, args.tp, args.tp_rank, args.batch, args.context, D, K, S, args.kv_cache_dtype)
    except ValueError as e:  # ConfigError names the key or the flag (e.g. a --tp that divides nothing)
        print(f"step_cost: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    print(json.dumps(out))


if __name__ == "__main__":
    main()
