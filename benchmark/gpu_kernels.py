"""Check and time the tree-verification kernels on a GPU; one JSONL record per (op, backend, size).

Why: on a GPU a tree verify must cost about what a chain verify of the same budget costs, so each kernel is timed
(median) at V4-Flash dimensions for batch 1..64 and draft budgets D = 5..8, next to the floors set by the bytes it
must move and the FLOPs it must do, and checked against its torch reference on the same inputs first.

    python benchmark/gpu_kernels.py [--out benchmark/results/gpu_kernels.jsonl] [--quick]

Needs CUDA and `sgl_kernel_ext` importable (the project installed, or PYTHONPATH=sgl-kernel-ext). Without CUDA
the script says so and exits with status 2, writing nothing. The "flashinfer" rows call the FlashInfer wrapper
directly (no Triton fallback), so a FlashInfer failure is recorded as such (median_ms NaN, ok false).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from bench_common import git_commit

# V4-Flash attention dimensions
HEADS, HEAD_DIM, WINDOW, TOPK, ROPE_DIMS, INDEX_DIM = 64, 512, 128, 512, 64, 128
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DEVICE = "cuda"


def median_ms(fn, warmup: int = 10, reps: int = 50) -> float:
    """Median of `reps` CUDA-event-timed calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def fp32_copy(case: dict) -> dict:
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in case.items()}


def distinct_rows(*lists: torch.Tensor | None) -> int:
    return sum(int(torch.unique(x[x >= 0]).numel()) for x in lists if x is not None)


def record(out_file, peak_gbps: float, peak_tflops: float, **fields) -> None:
    """Add the floors (time if only bytes / only FLOPs limited) and achieved rates, print, append to JSONL."""
    fields = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in fields.items()}
    ms = fields["median_ms"] or 0.0
    fields["bytes_floor_ms"] = fields["bytes"] / (peak_gbps * 1e9) * 1e3
    fields["flop_floor_ms"] = fields["flops"] / (peak_tflops * 1e12) * 1e3
    fields["achieved_gbps"] = fields["bytes"] / (ms * 1e-3) / 1e9 if ms > 0 else None
    fields["achieved_tflops"] = fields["flops"] / (ms * 1e-3) / 1e12 if ms > 0 else None
    print(json.dumps({k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in fields.items()}), flush=True)
    out_file.write(json.dumps(fields) + "\n")


def bench_attention(out_file, sizes, args) -> bool:
    from sgl_kernel_ext import ops
    from sgl_kernel_ext.cases import attention_case, rel_err
    from sgl_kernel_ext.reference import tree_sparse_attention_ref

    all_ok = True
    for source_b, t_b in (("csa_topk", TOPK), ("hca_64", 64)):
        for batch, draft in sizes:
            n = batch * draft
            case = attention_case(n, HEADS, HEAD_DIM, WINDOW, t_b, dtype=torch.bfloat16, device=DEVICE, ragged=False)
            ref = tree_sparse_attention_ref(**fp32_copy(case))
            valid = int((case["idx_a"] >= 0).sum()) + int((case["idx_b"] >= 0).sum())
            rows = distinct_rows(case["idx_a"], case["idx_b"])
            bytes_moved = 2 * (2 * n * HEADS * HEAD_DIM + rows * HEAD_DIM) + 4 * n * (WINDOW + t_b)
            flops = 4 * HEADS * HEAD_DIM * valid
            for backend in ("triton", "torch"):
                fn = lambda case=case, backend=backend: ops.tree_sparse_attention(**case, backend=backend)  # noqa: E731
                err = rel_err(fn(), ref)
                ok = err <= TOLERANCE[torch.bfloat16]
                all_ok &= ok
                record(out_file, args.peak_gbps, args.peak_tflops, op="tree_sparse_attention", backend=backend,
                       source_b=source_b, dtype="bf16", batch=batch, draft_tokens=draft, nodes=n, heads=HEADS,
                       head_dim=HEAD_DIM, t_a=WINDOW, t_b=t_b, rel_err=err, ok=ok, median_ms=median_ms(fn),
                       bytes=bytes_moved, flops=flops)
    return all_ok


def bench_compress(out_file, sizes, args) -> bool:
    from sgl_kernel_ext import ops
    from sgl_kernel_ext.cases import compress_case, rel_err
    from sgl_kernel_ext.reference import compress_entries_ref

    all_ok = True
    kinds = (("csa_main", "csa", HEAD_DIM, 4), ("csa_indexer", "csa", INDEX_DIM, 4), ("hca", "hca", HEAD_DIM, 128))
    for name, kind, width, ratio in kinds:
        for batch, draft in sizes:
            entries = batch * draft  # worst case: every node of the tree closes a block
            case = compress_case(entries, kind, width, ratio, ROPE_DIMS, dtype=torch.float32, device=DEVICE,
                                 n_store=max(4 * entries * ratio, 64))
            ref = compress_entries_ref(**case)
            slots = case["idx"].shape[1]
            bytes_moved = entries * slots * (2 * width * 4 + 4) + entries * width * 4
            flops = entries * width * (slots * 6 + 10)
            for backend in ("triton", "torch"):
                fn = lambda case=case, backend=backend: ops.compress_entries(**case, backend=backend)  # noqa: E731
                err = rel_err(fn(), ref)
                ok = err <= TOLERANCE[torch.float32]
                all_ok &= ok
                record(out_file, args.peak_gbps, args.peak_tflops, op="compress_entries", backend=backend,
                       kind=name, dtype="fp32", batch=batch, draft_tokens=draft, entries=entries, slots=slots,
                       width=width, rel_err=err, ok=ok, median_ms=median_ms(fn), bytes=bytes_moved, flops=flops)
    return all_ok


def bench_window(out_file, sizes, args) -> bool:
    from sgl_kernel_ext import ops
    from sgl_kernel_ext.cases import rel_err, window_case
    from sgl_kernel_ext.flashinfer_tree import tree_window_attention_flashinfer
    from sgl_kernel_ext.reference import tree_window_attention_ref

    all_ok = True
    for batch, draft in sizes:
        case = window_case(batch, draft, HEADS, HEAD_DIM, WINDOW, dtype=torch.bfloat16, device=DEVICE)
        ref = tree_window_attention_ref(**fp32_copy(case))
        n = batch * draft
        valid = int(case["mask"].sum())
        keys = int(case["kv_indices"].numel())
        bytes_moved = 2 * (2 * n * HEADS * HEAD_DIM + keys * HEAD_DIM) + case["mask"].numel() // 8
        flops = 4 * HEADS * HEAD_DIM * valid
        for backend in ("flashinfer", "triton", "torch"):
            if backend == "flashinfer":
                fn = lambda case=case: tree_window_attention_flashinfer(**case)  # noqa: E731
            else:
                fn = lambda case=case, backend=backend: ops.tree_window_attention(**case, backend=backend)  # noqa: E731
            try:
                err = rel_err(fn(), ref)
                ms = median_ms(fn)
            except Exception as exc:  # noqa: BLE001 - record why a backend could not run, keep going
                print(f"tree_window_attention {backend} failed: {exc!r}", file=sys.stderr)
                err, ms = float("nan"), float("nan")
            ok = err <= TOLERANCE[torch.bfloat16]
            all_ok &= ok
            record(out_file, args.peak_gbps, args.peak_tflops, op="tree_window_attention", backend=backend,
                   dtype="bf16", batch=batch, draft_tokens=draft, nodes=n, heads=HEADS, head_dim=HEAD_DIM,
                   window=WINDOW, rel_err=err, ok=ok, median_ms=ms, bytes=bytes_moved, flops=flops)
    return all_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmark/results/gpu_kernels.jsonl")
    parser.add_argument("--quick", action="store_true", help="batch 1 and 64 at D = 5 and 8 only")
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM bandwidth for the bytes floor (H200)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 tensor peak for the FLOP floor")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print("gpu_kernels.py: no CUDA device here; this benchmark only runs on a GPU. Nothing was run or written.",
              file=sys.stderr)
        return 2

    torch.manual_seed(0)
    batches = (1, 64) if args.quick else (1, 4, 16, 64)
    drafts = (5, 8) if args.quick else (5, 6, 7, 8)
    sizes = [(b, d) for b in batches for d in drafts]
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with out_path.open("a") as out_file:
        meta = dict(op="meta", device=torch.cuda.get_device_name(), torch=torch.__version__, started=started,
                    commit=git_commit())
        out_file.write(json.dumps(meta) + "\n")
        ok = bench_attention(out_file, sizes, args)
        ok &= bench_compress(out_file, sizes, args)
        ok &= bench_window(out_file, sizes, args)
    print(f"wrote {out_path} in {time.time() - started:.0f} s; all checks {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
