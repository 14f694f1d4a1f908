"""What every benchmark script shares: the grid's shape rule, the JSONL record contract and run provenance.

Why one place: the sweep writes records, the plots, the cost model and the schema test read them; the tree shape
chosen for each budget and the meaning of each field must not drift between them.
"""
from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATASETS = ("gsm8k", "mbpp", "sharegpt")
BUDGETS = (5, 6, 7, 8)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
SHAPES = ("tree", "chain", "none", "adaptive")  # adaptive: TREE_V4 without shape flags (budget = its largest D)

# Record fields and their JSON types. budget = tokens verified per request per target pass (root included), so
# "no speculation" is budget 1 with topk 0 and num_steps 0.
RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "dataset": (str,), "budget": (int,), "batch_size": (int,), "shape": (str,), "topk": (int,),
    "num_steps": (int,), "accept_length": (float, int), "output_throughput": (float, int),
    "mean_step_ms": (float, int), "num_requests": (int,), "output_tokens": (int,), "model": (str,),
    "device": (str,), "sglang_version": (str,), "git_commit": (str,),
}


def tree_shape(budget: int) -> tuple[int, int]:
    """(topk K, depth S) of the grid's tree at budget D: K = min(4, D-1), S = ceil(D/2).

    The dynamic tree drafts S levels keeping the K best nodes per level, then keeps the D-1 most probable nodes.
    S = ceil(D/2) leaves about half the budget for side branches while still letting one path reach depth S; K = 4
    gives the rerank enough siblings to pick from at these budgets (EAGLE-2's rerank rarely keeps a 5th sibling
    of a low-entropy draft). D=8 gives K=4, S=4; the D=8 shape table in RESULTS.md compares it with the others.
    """
    return min(4, budget - 1), math.ceil(budget / 2)


def chain_shape(budget: int) -> tuple[int, int]:
    """The matched linear chain: one branch, depth D-1 (same number of verified tokens as the tree)."""
    return 1, budget - 1


def git_commit() -> str:
    """HEAD, with ``-dirty`` when the benchmark scripts themselves differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "benchmark"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout
        return head + ("-dirty" if any(line[:2].strip() and not line.startswith("??") for line in
                                       dirty.splitlines()) else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def sglang_version() -> str:
    try:
        from importlib.metadata import version
        return version("sglang")
    except Exception:  # noqa: BLE001 - provenance only
        return "unknown"


def weights_digest(model_path: str | Path) -> str:
    """First 12 hex digits of the SHA-256 of the checkpoint's safetensors files (which weights were measured)."""
    import hashlib
    h = hashlib.sha256()
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:12]


def write_records(path: Path | str | None, records: list[dict]) -> None:
    """Records as JSONL at ``path`` (folders created; nothing when ``path`` is None)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))


def load_records(path: Path | str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def throughput_runs(r: dict) -> list[float]:
    """A sweep record's output tokens/s per measured run (one run where the record predates repeats)."""
    return list(r.get("output_throughput_runs") or [r["output_throughput"]])


def record_key(r: dict) -> tuple:
    """Identity of one grid point (used to resume a sweep and to pair tree with chain)."""
    return (r["dataset"], r["budget"], r["batch_size"], r["shape"], r["topk"], r["num_steps"])
