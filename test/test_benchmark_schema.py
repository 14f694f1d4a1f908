"""``benchmark/sweep.py --quick`` end to end on a random tiny DeepSeek-V4: every JSONL record has the fields the
plots, the cost model and RESULTS.md rely on, with the right types and sane values.

Two of the quick grid's three server configurations (tree and no speculation) keep it near three minutes on a small
CPU; the chain is the same code path with other flags. No timing is asserted.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from support.tiny_v4 import build

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {
    "dataset": str, "budget": int, "batch_size": int, "shape": str, "topk": int, "num_steps": int,
    "accept_length": float, "output_throughput": float, "mean_step_ms": float, "num_requests": int,
    "output_tokens": int, "model": str, "device": str, "sglang_version": str, "git_commit": str,
    "draft_score_temperature": float,
}


@pytest.mark.server
def test_quick_sweep_records(tmp_path: Path) -> None:
    model = build(tmp_path / "tiny_v4")
    out = tmp_path / "quick.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark" / "sweep.py"), "--quick", "--shapes", "tree",
                           "none", "--model-path", str(model), "--device", "cpu", "--out", str(out),
                           "--log-dir", str(tmp_path / "logs")], capture_output=True, text=True, timeout=900)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in (tmp_path / "logs").glob("*.log"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert {(r["shape"], r["batch_size"]) for r in records} == {(s, b) for s in ("tree", "none") for b in (1, 4)}
    for r in records:
        for name, typ in FIELDS.items():
            assert name in r, (name, r)
            value = r[name]
            if typ is float:
                assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            else:
                assert isinstance(value, typ) and not isinstance(value, bool), (name, value)
        assert r["dataset"] == "gsm8k" and r["device"] == "cpu" and r["model"] == "tiny_v4"
        assert r["num_requests"] == 4 and r["output_tokens"] == 4 * 16  # EOS ignored: fixed length
        assert r["output_throughput"] > 0 and r["mean_step_ms"] > 0
        if r["shape"] == "tree":
            assert (r["budget"], r["topk"], r["num_steps"]) == (6, 4, 3)
            assert 1.0 <= r["accept_length"] <= r["num_steps"] + 1
        else:
            assert (r["budget"], r["topk"], r["num_steps"], r["accept_length"]) == (1, 0, 0, 1.0)
