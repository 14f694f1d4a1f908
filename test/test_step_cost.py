"""The step-cost report (``python -m sglang_tree_v4.step_cost``): the counter's rules on toy ops, the report's
invariants on the embedded model, bad flags refused naming the flag, and the published V4-Flash config at one TP4
rank (slow)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sgl_kernel_ext.traffic import Traffic, declare
from sglang_tree_v4.step_cost.counter import StepCounter, touched_bytes

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "models" / "tiny-v4"
FLASH = ROOT / "data" / "deepseek_v4_flash_config.json"


@torch.library.custom_op("step_cost_test::half_reader", mutates_args=())
def half_reader(x: torch.Tensor) -> torch.Tensor:
    return x[: x.shape[0] // 2].clone()


@half_reader.register_fake
def _(x):
    return x.new_empty(x.shape[0] // 2, *x.shape[1:])


@declare("step_cost_test::half_reader")
def _half_reader_traffic(x):
    half = touched_bytes(x) // 2
    return Traffic(read=half, written=half, launches=1)


def test_counter_rules_on_meta():
    pool = torch.empty(1 << 20, 64, device="meta")  # 256 MiB of state
    weight = torch.empty(64, 64, device="meta")
    counter = StepCounter(weights=[weight], state=[pool])
    rows = torch.empty(8, dtype=torch.long, device="meta")
    with counter:
        picked = pool[rows]  # a gather: the 8 rows, not the pool
        view = picked.t()  # a view: nothing
        y = picked @ weight  # reads both, writes the product
        z = y + torch.empty(64, device="meta").expand(8, 64)  # the broadcast input once
        pool.index_put_((rows,), z)  # a scatter: the 8 rows written
        half_reader(weight)  # declared: half the weight
    assert view.is_meta
    ops = {op.op: op for op in counter.ops}
    assert ops["aten::index.Tensor"].read == {"state": 8 * 64 * 4, "activations": 8 * 8}
    assert ops["aten::index.Tensor"].written == {"activations": 8 * 64 * 4}
    assert "aten::t" not in ops
    assert ops["aten::add.Tensor"].read == {"activations": 8 * 64 * 4 + 64 * 4}
    assert ops["aten::index_put_"].written == {"state": 8 * 64 * 4}
    assert ops["step_cost_test::half_reader"].read == {"weights": 64 * 64 * 2}
    total = counter.summary()
    assert total["bytes_total"] == sum(total["bytes_by_class"].values())
    assert total["bytes_by_class"]["state"] == 2 * 8 * 64 * 4


def test_counter_charges_whole_tensors_without_the_rules():
    """The control: an elementwise op over the pool is charged the whole pool."""
    pool = torch.empty(1 << 16, 64, device="meta")
    counter = StepCounter(state=[pool])
    with counter:
        pool.mul_(2)
    assert counter.summary()["bytes_by_class"]["state"] == 2 * pool.numel() * 4


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_tree_v4.step_cost", *args], capture_output=True, text=True,
                          timeout=1200, cwd=ROOT)


@pytest.fixture(scope="module")
def embedded_reports():
    from sglang_tree_v4.step_cost.__main__ import report

    shapes = {"tree": (8, 3, 4), "chain": (8, 1, 7), "none": (1, 1, 0)}
    return {name: report(str(EMBEDDED), batch=2, context=200, draft=d, topk=k, steps=s)
            for name, (d, k, s) in shapes.items()}


def test_report_invariants_on_the_embedded_model(embedded_reports):
    for name, r in embedded_reports.items():
        assert r["bytes_total"] == sum(r["bytes_by_class"].values()), name
        assert r["bytes_total"] == sum(r["bytes_by_phase"].values()), name
        assert 0 < r["bytes_floor"] <= r["bytes_total"], name
        assert r["launches_total"] >= r["launches_per_layer"] > 0, name
        assert r["largest_write_bytes"] > 0 and r["routed_expert_bytes"] > 0, name
    tree, chain, none = (embedded_reports[k] for k in ("tree", "chain", "none"))
    assert "draft" not in none["bytes_by_phase"] and "draft" in tree["bytes_by_phase"]
    assert none["bytes_floor"] < chain["bytes_floor"] and none["bytes_total"] < tree["bytes_total"]


def test_per_forward_metadata_is_charged_to_the_forward_not_its_first_layer():
    """What ``ForwardBatch.memo`` and ``SlotStore._per_forward`` compute once per forward is reported apart
    (``launches_metadata``); without that accounting the first layer of each kind carries it all."""
    from sglang_tree_v4.checkpoint.weights import load_model
    from sglang_tree_v4.step_cost import round as step_round
    from sglang_tree_v4.step_cost.round import run_round

    model = load_model(str(EMBEDDED)).to("meta")
    weights = list(model.parameters()) + list(model.buffers())

    def per_layer(charge_metadata: bool):
        counter = StepCounter(weights=weights)
        if charge_metadata:
            run_round(model, counter, 2, 200, 8, 3, 4)
        else:
            plain = step_round.forward_metadata
            step_round.forward_metadata = lambda c: contextlib.nullcontext()
            try:
                run_round(model, counter, 2, 200, 8, 3, 4)
            finally:
                step_round.forward_metadata = plain
        layers: dict = {}
        for op in counter.ops:
            if op.phase == "verify":
                layers[op.layer] = layers.get(op.layer, 0) + op.launches
        return layers

    charged, uncharged = per_layer(True), per_layer(False)
    assert charged["metadata"] > 0 and "metadata" not in uncharged
    assert sum(charged.values()) == sum(uncharged.values())  # the same launches, charged elsewhere
    first = min(i for i in charged if isinstance(i, int) and model.cfg.compress_ratios[i] == 4)
    later = [i for i in charged if isinstance(i, int) and i > first and model.cfg.compress_ratios[i] == 4]
    assert later and uncharged[first] > uncharged[later[0]] and charged[first] == charged[later[0]]


@pytest.mark.parametrize("args, flag", [
    (["--batch", "0"], "--batch"), (["--speculative-num-steps", "9"], "--speculative-num-steps"),
    (["--tp", "2", "--tp-rank", "2"], "--tp-rank"),
    pytest.param(["--tp", "3"], "tp", marks=pytest.mark.slow)])
def test_bad_flags_name_the_flag(args, flag, capsys):
    from sglang_tree_v4.step_cost.__main__ import main

    with pytest.raises(SystemExit) as stop:
        main([str(FLASH), *args])
    assert stop.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.slow
def test_cli_prints_one_json_line():
    done = _report(str(EMBEDDED), "--no-spec", "--context", "64")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["draft_tokens"] == 1


@pytest.mark.slow
def test_v4_flash_tp4_rank():
    done = _report(str(FLASH), "--tp", "4", "--batch", "1", "--context", "8192")
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["local_experts"] == 64 and r["bytes_floor"] <= r["bytes_total"]
    assert r["bytes_total"] == sum(r["bytes_by_class"].values())


def test_the_round_runs_the_servers_stage_functions():
    """The report's round calls the server's own draft, verify and accept stages (the worker and the adapter's
    verify graph import the same functions), each once per round."""
    from sglang_tree_v4.checkpoint.weights import load_model
    from sglang_tree_v4.serving import sglang_model
    from sglang_tree_v4.speculative import mtp_drafter, worker
    from sglang_tree_v4.step_cost import round as step_round

    assert worker.draft_tree is mtp_drafter.draft_tree is step_round.draft_tree
    assert worker.accept_index_of is sglang_model.accept_index_of is step_round.accept_index_of
    assert step_round.verify_forward is sglang_model.verify_forward
    calls: dict[str, int] = {}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return run

    model = load_model(str(EMBEDDED)).to("meta")
    names = ("draft_tree", "verify_forward", "accept_index_of")
    saved = {n: getattr(step_round, n) for n in names}
    try:
        for n in names:
            setattr(step_round, n, counted(n, saved[n]))
        step_round.run_round(model, StepCounter(), 2, 200, 8, 3, 4)
    finally:
        for n in names:
            setattr(step_round, n, saved[n])
    assert calls == {n: 1 for n in names}
