"""Footprint report: the parameter bytes our DeepSeek-V4 holds per rank, measured on the meta device.

    python -m sglang_tree_v4.footprint PATH_OR_CONFIG_JSON [--tp N] [--tp-rank R] [--dtype bfloat16]

It builds the very model the server builds (``dsv4.quantize.build_model``: the checkpoint's quantization swapped
in, then ``dsv4.tp.shard_model``: rank R's share of SGLang's parallel layers for ``--tp N``) on the meta device,
which costs no memory, and sums its tensors; nothing here is a formula. No process group is needed: SGLang's
layers are built under a parallel-context override naming the rank and size. The last line of output is one JSON
object: ``param_bytes_per_rank``, ``param_bytes_by_dtype``, ``construct_s`` and the inputs.
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

    from .dsv4.config import DSV4Config
    from .dsv4.quantize import build_model, parameter_bytes
    from .dsv4.tp import shard_model

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(file) as f:
        raw = json.load(f)
    start = time.perf_counter()
    cfg = DSV4Config.from_dict(raw)
    with get_parallel().override(tp_size=tp, tp_rank=tp_rank):
        model = build_model(cfg, raw, with_mtp=cfg.num_nextn_predict_layers > 0, dtype=DTYPES[dtype], device="meta",
                            shard=shard_model)
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
    args = ap.parse_args(argv)
    if args.tp < 1:
        ap.error("--tp must be >= 1")
    if not 0 <= args.tp_rank < args.tp:
        ap.error("--tp-rank must be in [0, --tp)")
    from .dsv4.config import ConfigError
    try:
        print(json.dumps(report(args.path, args.tp, args.dtype, args.tp_rank)))
    except ConfigError as e:
        ap.error(str(e))


if __name__ == "__main__":
    main()
