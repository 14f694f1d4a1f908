"""``benchmark/round_accounting.py`` splits a run's log into what the adaptive budget observes (back-to-back decode
rounds at the run's batch size) and the rest: rounds at other batch sizes, rounds after a prefill ("nan" gap) and
prefill rounds count in the decode and wall columns only."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
from round_accounting import account  # noqa: E402

LINE = ("[2026-12-06 00:55:39] TREE_V4 step: batch {b}, shape D2_K1_S1, accepted {a}, draft 5.00 ms, verify 18.00 ms, "
        "accept+commit 2.00 ms, scheduler since the last round {g} ms")
PREFILL = ("[2026-12-06 00:55:38] Prefill batch, #new-seq: 1, #new-token: 76, #cached-token: 0, "
           "full token usage: 0.05, #running-req: 31, #queue-req: 0")


def test_account_separates_observed_rounds_from_the_rest():
    lines = [LINE.format(b=32, a=54, g="nan"),  # after a prefill: no gap to measure, not observed
             LINE.format(b=32, a=54, g="2.00"),
             LINE.format(b=32, a=54, g="3.00"),
             PREFILL,
             LINE.format(b=31, a=50, g="2.00"),  # a part-full batch: not observed
             "[2026-12-06 00:55:39] some other line"]
    shapes = {}
    got = account(lines, batch=32, tokens=212, wall_s=0.2, shapes=shapes)
    assert got["observed_ms_per_token"] == pytest.approx((27.0 + 28.0) / 108)
    assert got["decode_ms_per_token"] == pytest.approx((25.0 + 27.0 + 28.0 + 27.0) / 212)
    assert got["wall_ms_per_token"] == pytest.approx(200.0 / 212)
    assert (got["decode_rounds"], got["partial_batch_rounds"], got["prefill_rounds"]) == (4, 1, 1)
    assert shapes == {"D2_K1_S1": [2, pytest.approx(55.0), 108]}  # the observed rounds only, per shape
