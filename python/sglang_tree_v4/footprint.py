"""Footprint report: the parameter bytes our DeepSeek-V4 holds per rank, measured on the meta device.

    python -m sglang_tree_v4.footprint PATH_OR_CONFIG_JSON [--tp N] [--dtype bfloat16]

It builds the very model the server builds (``dsv4.quantize.build_model``: the checkpoint's quantization swapped in)
on the meta device, which costs no memory, and sums its tensors; nothing here is a formula. The last line of output
is one JSON object: ``param_bytes_per_rank``, ``param_bytes_by_dtype``, ``construct_s`` and the inputs.

Tensor parallelism: the model is not sharded yet (every rank holds all of it), so ``--tp N`` reports the same bytes
for every N and says so in ``"sharded": false``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def report(path: str, tp: int = 1, dtype: str = "bfloat16") -> dict:
    from .dsv4.config import DSV4Config
    from .dsv4.quantize import build_model, parameter_bytes

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(file) as f:
        raw = json.load(f)
    start = time.perf_counter()
    cfg = DSV4Config.from_dict(raw)
    model = build_model(cfg, raw, with_mtp=cfg.num_nextn_predict_layers > 0, dtype=DTYPES[dtype], device="meta")
    out = parameter_bytes(model)
    out.update(construct_s=round(time.perf_counter() - start, 3), config=file, tp=tp, dtype=dtype, sharded=False)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="a checkpoint folder or its config.json")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                    help="dtype of the dense (not quantized) weights, as --dtype of the server")
    args = ap.parse_args(argv)
    if args.tp < 1:
        ap.error("--tp must be >= 1")
    print(json.dumps(report(args.path, args.tp, args.dtype)))


if __name__ == "__main__":
    main()
