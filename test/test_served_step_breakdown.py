"""``benchmark/served_step_breakdown.py`` reads the worker's per-round debug line: the medians per shape come out of
the lines of the asked batch size only, a missing scheduler gap ("nan", the first round) is left out, and the
model's columns are ``StepTimes``'."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sglang_tree_v4.speculative.adaptive.timing import Curve, StepTimes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
from served_step_breakdown import breakdown, shape_of  # noqa: E402

LINE = ("[2026-12-05 14:59:20] TREE_V4 step: batch {b}, shape {k}, accepted 30, draft {d} ms, verify {v} ms, "
        "accept+commit 2.50 ms, scheduler since the last round {g} ms")


def test_breakdown_takes_medians_per_shape_at_one_batch_size():
    lines = [LINE.format(b=16, k="D4_K3_S2", d=12.0, v=28.0, g="nan"),
             LINE.format(b=16, k="D4_K3_S2", d=11.0, v=30.0, g=3.0),
             LINE.format(b=16, k="D4_K3_S2", d=13.0, v=29.0, g=2.0),
             LINE.format(b=15, k="D4_K3_S2", d=99.0, v=99.0, g=9.0),  # another batch size: not counted
             LINE.format(b=16, k="none", d=0.1, v=20.0, g=2.5)]
    times = StepTimes({2: Curve({16: 0.010})}, {1: Curve({16: 0.015}), 4: Curve({16: 0.023})}, Curve())
    rows = {r["shape"]: r for r in breakdown(lines, 16, times)}
    assert list(rows) == ["none", "D4_K3_S2"]
    d4 = rows["D4_K3_S2"]
    assert d4["rounds"] == 3 and d4["draft_ms"] == 12.0 and d4["verify_ms"] == 29.0 and d4["scheduler_ms"] == 2.5
    assert d4["served_ms"] == pytest.approx(12.0 + 29.0 + 2.5 + 2.5)
    assert d4["model_verify_ms"] == pytest.approx(23.0) and d4["model_ms"] == pytest.approx(33.0)
    assert rows["none"]["model_ms"] == pytest.approx(15.0) and shape_of("none") == (1, 0)
