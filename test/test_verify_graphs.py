"""Verify graphs per (batch bucket, D, context bucket) (``serving.verify_graphs``).

* Keys use the live context's bucket: a 1M-token model verifying at an 8K context pads to 8K, not to 1M.
* A batch padded by repeating its last request computes, stores and reads what the unpadded batch does (the
  embedded model's fixed-shape verify forward, padded and not, on fresh stores).
* The cache captures lazily, replays with new inputs, drops the least recently used beyond its bound, and logs
  the count.
* A real server whose verify forwards run through the graph path (``force``: an eager stand-in for the capture on
  the CPU) gives plain decoding's greedy tokens, batched and one by one, and its log names the graphs it made.
"""
from __future__ import annotations

import logging
import re

import pytest
import torch

from sglang_tree_v4.serving import verify_graphs as vg
from sglang_tree_v4.serving.sglang_model import FIXED_SHAPES_ENV, verify_caps
from sglang_tree_v4.speculative.adaptive.measure import verify_forward
from sglang_tree_v4.testing import launcher as srv
from support import serving_checks as checks
from support.served import COMMON, EMBEDDED, SLEEP, TREE


def test_buckets_and_padding_rows():
    assert [vg.batch_bucket(b) for b in (1, 3, 5, 13, 33, 64, 300)] == [1, 4, 8, 16, 48, 64, 300]
    t = torch.arange(6).view(3, 2)
    assert vg.pad_rows(t, 3, 5).tolist() == [[0, 1], [2, 3], [4, 5], [4, 5], [4, 5]]
    flat = torch.arange(6)  # 3 requests of 2 rows
    assert vg.pad_rows(flat, 3, 4, per_request=2).tolist() == [0, 1, 2, 3, 4, 5, 4, 5]
    assert vg.pad_rows(flat, 3, 3, per_request=2) is flat


def test_a_long_context_model_gets_the_live_contexts_bucket(monkeypatch):
    monkeypatch.setenv(FIXED_SHAPES_ENV, "1")
    caps = verify_caps(torch.tensor([8000, 5000]), 8, 1 << 20)
    assert caps.max_context == 8192  # the graph key's context bucket, whatever the model's 1,048,576
    assert verify_caps(torch.tensor([100]), 8, 1 << 20).max_context == 128


def test_cache_captures_lazily_replays_and_drops_the_least_recently_used(caplog):
    calls = []

    def fn(static, key):
        calls.append(key)
        return static["x"] * key[0]

    graphs = vg.VerifyGraphs(fn, capture=vg.eager_capture, max_graphs=2)
    with caplog.at_level(logging.INFO, logger=vg.__name__):
        assert graphs.run((1, 8, 128), {"x": torch.ones(3)}).tolist() == [1, 1, 1]
        assert graphs.run((1, 8, 128), {"x": torch.full((3,), 2.0)}).tolist() == [2, 2, 2]  # replay, new input
        graphs.run((2, 8, 128), {"x": torch.ones(3)})
        graphs.run((1, 8, 128), {"x": torch.ones(3)})  # now the most recent
        graphs.run((4, 8, 256), {"x": torch.ones(3)})  # over the bound: (2, 8, 128) goes
    assert list(graphs.graphs) == [(1, 8, 128), (4, 8, 256)] and graphs.captures == 3
    assert "dropped (2, 8, 128)" in caplog.text
    assert len(re.findall(r"captured \(batch \d+, D 8, context \d+\); \d held", caplog.text)) == 3


def test_padding_by_repetition_changes_nothing_stored_or_read(target_model, monkeypatch):
    """The verify forward of 3 requests, and of the same 3 plus the last repeated: the real rows' outputs and every
    stored row are the same."""
    monkeypatch.setenv(FIXED_SHAPES_ENV, "1")
    model, d, context = target_model, 6, 150
    width = context + d
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.vocab_size, (3, d), generator=g)
    prefix = torch.tensor([context, context - 37, context - 70])
    table = torch.arange(3 * width).view(3, width)
    runs = []
    for bs in (3, 4):
        store = model.new_store(4 * width, torch.float32, "cpu")
        for buf in list(store.buffers) + list(store.token_buffers) + list(store.ring_buffers):
            buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(1)))
        with torch.no_grad():
            out = verify_forward(model, store, vg.pad_rows(table, 3, bs), vg.pad_rows(prefix, 3, bs),
                                 vg.pad_rows(tokens, 3, bs), d)
        runs.append((out.logits[:3 * d], [b.clone() for b in list(store.buffers) + list(store.token_buffers)
                                           + list(store.ring_buffers)]))
    (lg3, st3), (lg4, st4) = runs
    torch.testing.assert_close(lg4, lg3, rtol=1e-5, atol=1e-5)
    assert torch.equal(lg4.argmax(-1), lg3.argmax(-1))
    for a, b in zip(st3, st4, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---- a real server through the graph path ----------------------------------------------------------------------

GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    cache = str(tmp_path_factory.mktemp("cache"))
    env = {FIXED_SHAPES_ENV: "1", vg.GRAPHS_ENV: "force"}
    started = {"plain": srv.launch(EMBEDDED, COMMON + SLEEP, logs / "plain.log",
                                   env=srv.clean_env(XDG_CACHE_HOME=cache)),
               "graphs": srv.launch(EMBEDDED, COMMON + SLEEP + TREE, logs / "graphs.log",
                                    env=srv.clean_env(XDG_CACHE_HOME=cache, **env))}
    with checks.healthy(started) as up:
        yield up


@pytest.mark.server
def test_served_through_verify_graphs_greedy_identical(servers):
    items = checks.eval_prompts(servers["plain"])[:14] + checks.eval_prompts(servers["plain"])[-3:]
    want = checks.run_all(servers["plain"], items, GREEDY)
    got = checks.run_all(servers["graphs"], items, GREEDY)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    checks.assert_speculation_exercised(got)
    for item, ref in list(zip(items, want, strict=True))[:4]:  # one by one: batch bucket 1
        assert servers["graphs"].generate({**item, "sampling_params": GREEDY})["output_ids"] == ref["output_ids"]
    log = servers["graphs"].log.read_text()
    keys = [tuple(map(int, k)) for k in re.findall(r"captured \(batch (\d+), D (\d+), context (\d+)\)", log)]
    assert keys and len(keys) == len(set(keys)), log[-3000:]
    assert all(b in vg.BATCH_BUCKETS and d == 6 and c & (c - 1) == 0 for b, d, c in keys)
    assert (1, 6, 64) in keys or (1, 6, 128) in keys  # the one-by-one requests ran at batch bucket 1
    held = [int(h) for h in re.findall(r"; (\d+) held", log)]
    assert held == list(range(1, len(keys) + 1))  # what the log says is the set of graphs made
