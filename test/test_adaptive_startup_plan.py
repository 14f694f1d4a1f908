"""The adaptive budget's startup measurement plan: the full grid on a CPU, a small one on a GPU (under a minute),
draft times of the S not timed interpolated, and the planning CLI's estimate (``step_cost.startup_plan``)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from sglang_tree_v4.speculative.adaptive import measure
from sglang_tree_v4.speculative.adaptive.config import DEFAULT
from sglang_tree_v4.speculative.adaptive.timing import StepTimes
from sglang_tree_v4.step_cost.startup_plan import measured_seconds

ROOT = Path(__file__).resolve().parent.parent


def test_cpu_plan_is_the_full_grid_and_gpu_plan_a_few_shapes():
    cpu = measure.startup_plan(16, 4, 8, 64, torch.device("cpu"))
    assert cpu.batches == (1, 4, 16, 64) and cpu.draft_steps == tuple(range(1, 9))
    assert cpu.verify_widths == tuple(measure.verify_widths(16)) and cpu.passes == DEFAULT.MEASURE_PASSES
    gpu = measure.startup_plan(16, 4, 8, 64, torch.device("cuda"))
    assert gpu.batches == cpu.batches and gpu.draft_steps == (1, 4, 8) and gpu.verify_widths == (1, 2, 4, 8, 16)
    assert gpu.passes == DEFAULT.MEASURE_PASSES_GPU < cpu.passes
    assert gpu.points == 4 * (3 + 5) and cpu.points == 4 * (8 + 10)
    odd = measure.startup_plan(11, 3, 5, 40, torch.device("cuda"))
    assert odd.batches == (1, 4, 16, 40) and odd.draft_steps == (1, 3, 5) and odd.verify_widths == (1, 2, 4, 8, 11)
    # the estimate is passes x the points' seconds, plus one warm-up point of each kind
    assert gpu.estimate(lambda kind, b, n: 1.0) == 2 + gpu.passes * gpu.points


def test_draft_times_of_untimed_steps_are_interpolated(target_model, monkeypatch):
    """Timing S = 1 and 3 only still gives a draft time for S = 2, between its neighbours, at every batch size."""
    model = target_model
    store = model.new_store(2 * 120, torch.float32, "cpu")
    from sglang_tree_v4.dsv4.mtp import draft_scratch_rows, new_mtp_store, new_streams_store
    mtp_store = new_mtp_store(model.cfg, 2 * 120, torch.float32, "cpu", 2 * draft_scratch_rows(2, 3))
    streams = new_streams_store(model.cfg, 2 * 120, torch.float32, "cpu")
    times = StepTimes()
    with torch.no_grad():
        measure._time_batch(model, store, mtp_store, streams, [1, 2], 120, 96, 6, 2, 3, [1, 3], [1, 6],
                            torch.device("cpu"), times, passes=1)
    assert sorted(times.draft) == [1, 2, 3] and sorted(times.verify) == [1, 6]
    for b in (1, 2):
        d1, d2, d3 = (times.draft[s](b) for s in (1, 2, 3))
        assert d1 <= d2 <= d3 and d2 == (d1 + d3) / 2


def run_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_tree_v4.step_cost.startup_plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_plan_cli_prints_the_plan_and_an_estimate_for_the_embedded_model():
    gpu, cpu = run_plan("models/tiny-v4"), run_plan("models/tiny-v4", "--device", "cpu")
    assert gpu.returncode == 0 and cpu.returncode == 0, gpu.stderr[-2000:] + cpu.stderr[-2000:]
    g, c = json.loads(gpu.stdout.splitlines()[-1]), json.loads(cpu.stdout.splitlines()[-1])
    assert "32 shapes x 3 passes" in gpu.stdout and g["points"] == 32 and c["points"] == 72
    assert 0 < g["estimate_s"] < c["estimate_s"]  # fewer points, fewer passes: less time at the same speed
    bad = run_plan("models/tiny-v4", "--speculative-num-steps", "20")
    assert bad.returncode == 2 and "--speculative-num-steps" in bad.stderr


def test_estimate_from_gpu_check_records():
    """gpu_check's eager layer times (mean of CSA and HCA, times the layers) and MTP times give the point times."""
    recs = [{"op": op, "graph": False, "batch": b, "draft_tokens": d, "context": 8192, "median_ms": ms, "error": None}
            for op, ms0 in (("layer:csa", 1.0), ("layer:hca", 3.0)) for b in (1, 32) for d, ms in ((1, ms0),
                                                                                                  (8, 2 * ms0))]
    recs += [{"op": "mtp", "graph": False, "batch": b, "draft_tokens": 1, "context": 8192, "median_ms": 4.0,
              "error": None} for b in (1, 32)]
    recs.append({"op": "layer:csa", "graph": True, "batch": 1, "draft_tokens": 8, "context": 8192, "median_ms": 99.0,
                 "error": None})  # captured: not what the eager measurement runs
    seconds = measured_seconds(recs, num_layers=10)
    assert abs(seconds("verify", 1, 1) - 10 * 2.0e-3) < 1e-12
    assert abs(seconds("verify", 1, 8) - 10 * 4.0e-3) < 1e-12
    assert abs(seconds("draft", 16, 3) - 3 * 4.0e-3) < 1e-12


def test_a_dspark_drafter_is_timed_as_one_block_pass_and_a_search_per_width(monkeypatch):
    """DSpark drafts every depth in one block pass: ``draft(S)`` is that pass, the same at every S, timed once per
    batch size; the best-first search of D nodes is timed with the verify forward of D (its cost grows with D)."""
    from dataclasses import replace

    from sglang_tree_v4.checkpoint.weights import load_model
    from sglang_tree_v4.speculative import dspark_drafter
    from sglang_tree_v4.speculative.server_args import dspark_adaptive_budget

    assert dspark_adaptive_budget(4) == (16, 4, 4) and dspark_adaptive_budget(1) == (5, 4, 1)
    model = load_model(str(ROOT / "models" / "tiny-v4-dspark"))
    calls = {"block": 0, "search": []}
    block_pass, search = dspark_drafter.block_pass, dspark_drafter.search

    def counted_block(*args, **kwargs):
        calls["block"] += 1
        return block_pass(*args, **kwargs)

    def counted_search(model, out, roots, steps, topk, draft_tokens, *args, **kwargs):
        calls["search"].append((roots.shape[0], steps, topk, draft_tokens))
        return search(model, out, roots, steps, topk, draft_tokens, *args, **kwargs)

    monkeypatch.setattr(dspark_drafter, "block_pass", counted_block)
    monkeypatch.setattr(dspark_drafter, "search", counted_search)
    config = replace(DEFAULT, MEASURE_PASSES=2, MEASURE_BATCHES=(1,))
    times = measure.measure(model, 6, 4, 4, 2, torch.device("cpu"), config)
    plan = measure.startup_plan(6, 4, 4, 2, torch.device("cpu"), config, block_drafter=True)
    assert plan.draft_steps == (4,) and plan.batches == (1, 2)
    assert sorted(times.draft) == [1, 2, 3, 4] and sorted(times.verify) == list(plan.verify_widths)
    for b in (1, 2):
        assert len({times.draft[s](b) for s in range(1, 5)}) == 1
        widths = [times.verify[d](b) for d in plan.verify_widths]
        assert widths == sorted(widths) and all(t > 0 for t in widths)
    # one warm-up pass (batch 1, D = 1 and 2), then two passes over both batch sizes and every D > 1
    assert calls["block"] == 1 + 2 * 2
    wide = [d for d in plan.verify_widths if d > 1]
    assert sorted(calls["search"]) == sorted([(1, 4, 4, 2)] + [(b, 4, 4, d) for _ in range(2) for b in (1, 2)
                                                                for d in wide])
