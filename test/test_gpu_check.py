"""``benchmark/gpu_check.py``, the one script a lent GPU runs, kept working on the CPU: its dry run (tiny shapes,
kernels under Triton's interpreter, SGLang / FlashInfer / sgl_kernel / triton_kernels blocked at import) writes a
record for every op and shape with positive times and floors and no error; a kernel made to fail gives a record with
the error and the script still finishes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_kernel_ext import traffic  # noqa: F401  (the script's dependencies import here too)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmark" / "gpu_check.py"
KERNELS = ("tree_sparse_attention", "compress_entries", "fp8_block_linear", "routed_experts_fp4", "hc_pre",
           "hc_post", "rms_norm", "indexer_scores")


def run(tmp_path: Path, *flags: str) -> list[dict]:
    env = dict(os.environ, OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = (tmp_path / "gpu_check.jsonl").read_text().splitlines()
    assert lines == [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]  # same records, as they come
    return [json.loads(ln) for ln in lines]


def test_a_broken_kernel_is_recorded_and_the_rest_runs(tmp_path):
    records = run(tmp_path, "--skip-layers", "--break", "rms_norm")
    by_op = {r["op"]: r for r in records}
    assert "broken on purpose" in by_op["kernel:rms_norm"]["error"]
    for name in KERNELS:
        if name != "rms_norm":
            assert by_op[f"kernel:{name}"]["error"] is None, by_op[f"kernel:{name}"]
    assert records[-1]["op"] == "done"


@pytest.mark.slow
def test_dry_run_records_every_op_and_shape(tmp_path):
    records = run(tmp_path)
    errors = [r for r in records if r["error"]]
    assert not errors, errors[:3]
    ops = {r["op"] for r in records}
    assert {f"kernel:{k}" for k in KERNELS} | {"env", "copy", "layer:csa", "layer:hca", "mtp", "done"} <= ops
    for op in ("layer:csa", "layer:hca"):
        seen = {(r["shape"], r["batch"], r["context"]) for r in records if r["op"] == op}
        assert {s for s, _, _ in seen} == {"tree", "chain", "none"} and len(seen) == 3 * 2 * 2
    timed = [r for r in records if r["op"].startswith(("kernel:", "layer:", "mtp"))]
    assert all(r["median_ms"] > 0 and r["floor_ms"] > 0 and r["ratio"] > 0 for r in timed)
    assert all("eager" in r["note"] for r in timed if r["op"].startswith("layer:") and r.get("note"))
