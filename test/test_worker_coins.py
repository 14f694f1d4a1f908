"""Seeded verification coins: the same (seed, committed length) gives the same coins, different seeds differ,
and without seeds the worker's shared generator is used (SGLang honours seeds only in deterministic mode)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_tree_v4.speculative.worker import TreeV4Worker, request_score_temperatures


def _batch(seeds, lens):
    info = SimpleNamespace(sampling_seed=None if seeds is None else torch.tensor(seeds))
    return SimpleNamespace(sampling_info=info, seq_lens=torch.tensor(lens), reqs=[None] * len(lens))


def _worker(seed: int = 0):
    worker = TreeV4Worker.__new__(TreeV4Worker)  # only the coin source is exercised
    worker.device = torch.device("cpu")
    worker.generator = torch.Generator().manual_seed(seed)
    return worker


def test_seeded_coins_reproduce_per_request():
    a = _worker(1)._coins(_batch([5, 6, 5], [10, 10, 10]), 4)
    b = _worker(2)._coins(_batch([5, 6, 5], [10, 10, 10]), 4)
    assert torch.equal(a.accept, b.accept) and torch.equal(a.bonus, b.bonus)
    assert torch.equal(a.accept[0], a.accept[2]) and not torch.equal(a.accept[0], a.accept[1])
    c = _worker(1)._coins(_batch([5, 6, 5], [11, 10, 10]), 4)
    assert not torch.equal(a.accept[0], c.accept[0])  # the next step draws fresh coins


def test_unseeded_coins_come_from_the_worker_generator():
    a = _worker(7)._coins(_batch(None, [3, 4]), 5)
    b = _worker(7)._coins(_batch(None, [3, 4]), 5)
    c = _worker(8)._coins(_batch(None, [3, 4]), 5)
    assert torch.equal(a.accept, b.accept) and not torch.equal(a.accept, c.accept)


def test_score_temperature_per_request():
    """Greedy requests (top_k = 1) use the checkpoint's fitted temperature; sampled ones their own, never sharper."""
    temps = torch.tensor([[1.0], [1.0], [0.2], [0.7]])
    top_ks = torch.tensor([1, 40, 40, 1 << 30])
    got = request_score_temperatures(0.4, temps, top_ks)
    torch.testing.assert_close(got, torch.tensor([0.4, 1.0, 0.4, 0.7]))
