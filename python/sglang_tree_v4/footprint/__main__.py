"""Footprint report: the parameter bytes our DeepSeek-V4 holds per rank, measured on the meta device, and with
``--tokens`` the attention state the server holds for T tokens and R running requests.

    python -m sglang_tree_v4.footprint PATH_OR_CONFIG_JSON [--tp N] [--tp-rank R] [--dtype bfloat16]
        [--tokens T --requests R --kv-cache-dtype auto --speculative-num-draft-tokens D ... --context-length C]

It builds the very model the server builds (``checkpoint.swap.build_model``: the checkpoint's quantization swapped
in, then ``checkpoint.tp.shard_model``: rank R's share of SGLang's parallel layers for ``--tp N``) on the meta device,
which costs no memory, and sums its tensors; nothing here is a formula. No process group is needed: SGLang's
layers are built under a parallel-context override naming the rank and size. The last line of output is one JSON
object: ``param_bytes_per_rank``, ``param_bytes_by_dtype``, ``construct_s`` and the inputs; with ``--tokens``
also ``state_bytes_per_token`` (the slope), ``state_bytes_per_request`` (the intercept: draft-tree slots and the
``req_to_token`` row), ``state_bytes_by_kind`` and upstream's fp8 figures beside them (``footprint.state``). The
state is per rank and the same on every rank: the per-slot rows are not split by tensor parallelism.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def report(path: str, tp: int = 1, dtype: str = "bfloat16", tp_rank: int = 0) -> dict:
    from sglang.srt.runtime_context import get_parallel

    from ..checkpoint.fuse import fuse_projections
    from ..checkpoint.swap import build_model, parameter_bytes
    from ..checkpoint.tp import shard_model
    from ..dsv4.config import DSV4Config

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(file) as f:
        raw = json.load(f)
    start = time.perf_counter()
    cfg = DSV4Config.from_dict(raw)
    with get_parallel().override(tp_size=tp, tp_rank=tp_rank):
        model = build_model(cfg, raw, with_mtp=cfg.num_nextn_predict_layers > 0, dtype=DTYPES[dtype], device="meta",
                            shard=shard_model)
    fuse_projections(model)  # as the server holds it once loaded (its stored-as-read biases included)
    out = parameter_bytes(model)
    out.update(construct_s=round(time.perf_counter() - start, 3), config=file, tp=tp, tp_rank=tp_rank, dtype=dtype)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="a checkpoint folder or its config.json")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (as the server's --tp)")
    ap.add_argument("--tp-rank", type=int, default=0, help="which rank's share to report")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                    help="dtype of the dense (not quantized) weights, as --dtype of the server")
    state = ap.add_argument_group("attention state (with --tokens)")
    state.add_argument("--tokens", type=int, default=None, help="tokens held (committed and cached)")
    state.add_argument("--requests", type=int, default=0, help="running requests")
    state.add_argument("--kv-cache-dtype", default="auto", help="as the server's flag (auto: the --dtype)")
    state.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    state.add_argument("--speculative-eagle-topk", type=int, default=None)
    state.add_argument("--speculative-num-steps", type=int, default=None)
    state.add_argument("--context-length", type=int, default=None, help="default: the config's max positions")
    args = ap.parse_args(argv)
    if args.tp < 1:
        ap.error("--tp must be >= 1")
    if not 0 <= args.tp_rank < args.tp:
        ap.error("--tp-rank must be in [0, --tp)")
    if args.tokens is not None and (args.tokens < 0 or args.requests < 0):
        ap.error("--tokens and --requests must be >= 0")
    from .state import KV_CACHE_DTYPES
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        ap.error(f"--kv-cache-dtype {args.kv_cache_dtype}: one of {sorted(KV_CACHE_DTYPES)} (fp8_e4m3: the "
                 f"compressed entries and window keys as fp8, the rest in --dtype)")
    from ..dsv4.config import ConfigError
    try:
        out = report(args.path, args.tp, args.dtype, args.tp_rank)
        if args.tokens is not None:
            out.update(_state(args))
        print(json.dumps(out))
    except (ConfigError, ValueError) as e:
        ap.error(str(e))


def _state(args) -> dict:
    from ..speculative.server_args import validate_budget
    from .state import KV_CACHE_DTYPES, state_report

    file = os.path.join(args.path, "config.json") if os.path.isdir(args.path) else args.path
    with open(file) as f:
        raw = json.load(f)
    budget = validate_budget(args.speculative_num_draft_tokens, args.speculative_eagle_topk,
                             args.speculative_num_steps)
    dtype, entry_format = KV_CACHE_DTYPES[args.kv_cache_dtype]
    return state_report(raw, args.tokens, args.requests, budget.draft_tokens, budget.topk, budget.steps,
                        args.context_length, dtype or DTYPES[args.dtype], entry_format)


if __name__ == "__main__":
    main()
