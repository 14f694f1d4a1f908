"""Which round the scheduler's time between two rounds is charged to (``TreeV4Worker._account``).

The scheduler processes a round's output (a tree round's several tokens per request) before it prepares the next
round, so the time between two rounds belongs to the first. Three rounds at batch 8 with invented clocks: a tree
round followed by a long gap (its output), then a round without speculation followed by a short one. The policy
must observe the tree round as its work plus the long gap and the plain round as its work plus the short gap;
charged to the next round instead, the plain round would carry the tree's output. A prefill or a change of batch
size between two rounds leaves the first untimed."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_tree_v4.speculative.adaptive.policy import NO_SPECULATION, AdaptivePolicy
from sglang_tree_v4.speculative.adaptive.timing import StepTimes
from sglang_tree_v4.speculative.worker import TreeV4Worker

TREE = (3, 1)


def _worker() -> TreeV4Worker:
    worker = TreeV4Worker.__new__(TreeV4Worker)  # only the bookkeeping: no model, no SGLang server
    worker.budget = SimpleNamespace(topk=3)
    worker.shape_counts, worker._last_round = {}, None
    worker.policy = AdaptivePolicy(3, 3, 1, StepTimes())
    worker.policy.learn = lambda *args: None
    return worker


def _round(worker, bs: int, shape, start: float, work: float, monkeypatch) -> None:
    monkeypatch.setattr("time.perf_counter", lambda: start + work)
    verdict = SimpleNamespace(accept_lens=torch.ones(bs, dtype=torch.int64), accepted_nodes=None)
    worker._account(bs, shape, None, verdict, (start, start + 0.2 * work, start + 0.8 * work))


def test_the_gap_after_a_round_is_that_rounds(monkeypatch):
    worker = _worker()
    _round(worker, 8, TREE, 0.0, 0.030, monkeypatch)  # 30 ms, then 10 ms processing its output
    _round(worker, 8, NO_SPECULATION, 0.040, 0.020, monkeypatch)  # 20 ms, then 2 ms
    _round(worker, 8, TREE, 0.062, 0.030, monkeypatch)
    observed = worker.policy.times.observed
    assert observed[(8, *TREE)] == pytest.approx(0.040)
    assert observed[(8, *NO_SPECULATION)] == pytest.approx(0.022)
    assert (8, *TREE) in worker.policy.times.observed_at and len(observed) == 2  # the last round: not yet
    assert worker.policy.times.rest(8) == pytest.approx(0.8 * (0.2 * 0.030 + 0.010) + 0.2 * (0.2 * 0.020 + 0.002))


def test_a_prefill_or_a_new_batch_size_leaves_the_round_before_untimed(monkeypatch):
    worker = _worker()
    _round(worker, 8, TREE, 0.0, 0.030, monkeypatch)
    _round(worker, 7, NO_SPECULATION, 0.040, 0.020, monkeypatch)  # a request finished in between
    worker._last_round = None  # what a prefill round does (``_prefill_round``)
    _round(worker, 7, TREE, 0.062, 0.030, monkeypatch)
    assert worker.policy.times.observed == {}
