"""Graphs of a round's fixed-shape forwards (``serving.step_graphs``): verify per (batch bucket, D, context
bucket), the MTP's catch-up per (batch bucket, C), its draft steps per (batch bucket, K, depth).

* Verify keys use the live context's bucket: a 1M-token model verifying at an 8K context pads to 8K, not to 1M.
* A batch padded by repeating its last request computes, stores and reads what the unpadded batch does (the
  embedded model's fixed-shape verify forward, padded and not, on fresh stores); the MTP's catch-up and draft
  steps through graphs of a padded bucket give the eager draft's tree and rows.
* The cache captures lazily, replays with new inputs, drops the least recently used beyond its bound, stops
  capturing at its memory cap (those shapes run eagerly), and logs the count and bytes.
* A real server whose forwards run through the graph path (``force``: an eager stand-in for the capture on the
  CPU) gives plain decoding's greedy tokens, batched and one by one, and its log names the graphs it made.
"""
from __future__ import annotations

import logging
import random
import re

import pytest
import torch

from sglang_tree_v4.dsv4.mtp import draft_scratch_rows, new_mtp_store, new_streams_store
from sglang_tree_v4.serving import step_graphs as sg
from sglang_tree_v4.serving.sglang_model import FIXED_SHAPES_ENV, verify_caps
from sglang_tree_v4.speculative.adaptive.measure import verify_forward
from sglang_tree_v4.speculative.mtp_drafter import MTPGraphs, MTPTreeDrafter, catch_up, catch_up_fixed
from sglang_tree_v4.testing import launcher as srv
from sglang_tree_v4.testing.runner import DSV4Runner
from sglang_tree_v4.tree import build_draft_tree
from support import serving_checks as checks
from support.served import COMMON, EMBEDDED, SLEEP, TREE


def test_buckets_and_padding_rows():
    assert [sg.batch_bucket(b) for b in (1, 3, 5, 13, 33, 64, 300)] == [1, 4, 8, 16, 48, 64, 300]
    t = torch.arange(6).view(3, 2)
    assert sg.pad_rows(t, 3, 5).tolist() == [[0, 1], [2, 3], [4, 5], [4, 5], [4, 5]]
    flat = torch.arange(6)  # 3 requests of 2 rows
    assert sg.pad_rows(flat, 3, 4, per_request=2).tolist() == [0, 1, 2, 3, 4, 5, 4, 5]
    assert sg.pad_rows(flat, 3, 3, per_request=2) is flat


def test_a_long_context_model_gets_the_live_contexts_bucket(monkeypatch):
    monkeypatch.setenv(FIXED_SHAPES_ENV, "1")
    caps = verify_caps(torch.tensor([8000, 5000]), 8, 1 << 20)
    assert caps.max_context == 8192  # the graph key's context bucket, whatever the model's 1,048,576
    assert verify_caps(torch.tensor([100]), 8, 1 << 20).max_context == 128


def _key(batch, d=8, context=128):
    return ("verify", ("batch", batch), ("D", d), ("context", context))


def test_cache_captures_lazily_replays_and_drops_the_least_recently_used(caplog):
    calls = []

    def fn(static, key):
        calls.append(key)
        return static["x"] * key[1][1]

    graphs = sg.StepGraphs({"verify": fn}, capture=sg.eager_capture, max_graphs=2)
    with caplog.at_level(logging.INFO, logger=sg.__name__):
        assert graphs.run(_key(1), {"x": torch.ones(3)}).tolist() == [1, 1, 1]
        assert graphs.run(_key(1), {"x": torch.full((3,), 2.0)}).tolist() == [2, 2, 2]  # replay, new input
        graphs.run(_key(2), {"x": torch.ones(3)})
        graphs.run(_key(1), {"x": torch.ones(3)})  # now the most recent
        graphs.run(_key(4, context=256), {"x": torch.ones(3)})  # over the bound: batch 2 goes
    assert list(graphs.graphs) == [_key(1), _key(4, context=256)] and graphs.captures == 3
    assert "dropped verify (batch 2, D 8, context 128)" in caplog.text
    assert len(re.findall(r"captured verify \(batch \d+, D 8, context \d+\); \d held", caplog.text)) == 3


def test_memory_cap_stops_capturing_and_runs_new_shapes_eagerly(caplog):
    """Each stand-in capture adds its outputs' bytes (4 floats: 16); at a 40-byte cap the third shape is not
    captured but still computed (eagerly, every call), and the captured ones keep replaying."""
    runs = []

    def fn(static, key):
        runs.append(key)
        return static["x"] + key[1][1]

    graphs = sg.StepGraphs({"verify": fn}, capture=sg.eager_capture, max_bytes=40)
    x = torch.zeros(4)
    with caplog.at_level(logging.INFO, logger=sg.__name__):
        for b in (1, 2, 4, 4, 8, 1):
            assert graphs.run(_key(b), {"x": x}).tolist() == [float(b)] * 4
    assert graphs.pool_bytes == 48 and graphs.captures == 3  # 1, 2, 4 captured (the cap is checked before each)
    assert _key(8) not in graphs.graphs and graphs.eager == {_key(8)}
    assert "verify (batch 8, D 8, context 128) runs eagerly" in caplog.text
    assert re.search(r"captured verify \(batch 4, D 8, context 128\); 3 held, 0\.0 MiB in the pool", caplog.text)


def test_cap_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(sg.GRAPH_MEMORY_ENV, "512")
    assert sg.StepGraphs({}).max_bytes == 512 * 2**20
    monkeypatch.delenv(sg.GRAPH_MEMORY_ENV)
    assert sg.memory_cap_bytes() == sg.DEFAULT_GRAPH_MEMORY_MB * 2**20


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
            out = verify_forward(model, store, sg.pad_rows(table, 3, bs), sg.pad_rows(prefix, 3, bs),
                                 sg.pad_rows(tokens, 3, bs), d)
        runs.append((out.logits[:3 * d], [b.clone() for b in list(store.buffers) + list(store.token_buffers)
                                           + list(store.ring_buffers)]))
    (lg3, st3), (lg4, st4) = runs
    torch.testing.assert_close(lg4, lg3, rtol=1e-5, atol=1e-5)
    assert torch.equal(lg4.argmax(-1), lg3.argmax(-1))
    for a, b in zip(st3, st4, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_mtp_through_padded_graphs_drafts_the_eager_tree(target_model, caplog):
    """3 requests (bucket 4): the MTP catch-up and the draft steps replayed from graphs give the eager path's root
    draft, tree and MTP rows (window and draft scratch) for the real requests; the log names one graph per key.
    The eager draft reading a window-wide table drafts what it drafts reading the whole request table."""
    model, rng = target_model, random.Random(3)
    cfg = model.cfg
    lens, C, K, S, D = [30, 41, 57], 6, 3, 3, 8
    runner = DSV4Runner(model, num_slots=512, max_len=96, max_reqs=3)
    rids = [runner.add_request() for _ in lens]
    seqs = [[rng.randrange(2, cfg.vocab_size) for _ in range(L + 1)] for L in lens]  # the last one: the bonus
    streams = new_streams_store(cfg, 512)
    for rid, out in zip(rids, runner.extend(rids, [s[:-1] for s in seqs]), strict=True):
        streams.write(0, "h", runner.slots_of(rid), out.streams.flatten(1))
    table = runner.req_table[torch.tensor(rids)]
    catch_up(model, runner.mtp_store, streams, table, [0] * 3, [L - C for L in lens],
             [s[1:L - C + 1] for s, L in zip(seqs, lens, strict=True)])
    prefix, roots = torch.tensor(lens), torch.tensor([s[-1] for s in seqs])
    next_tokens = torch.tensor([s[L - C + 1:L + 1] for s, L in zip(seqs, lens, strict=True)])
    stride = draft_scratch_rows(K, S)

    def draft(graphs_of, whole_table=False):
        store = new_mtp_store(cfg, 512, scratch_rows=4 * stride)
        for mine, theirs in zip(store.buffers, runner.mtp_store.buffers, strict=True):
            mine[:512].copy_(theirs[:512])
        graphs = None if graphs_of is None else MTPGraphs(model, store, streams, graphs_of)
        with torch.no_grad():
            root = catch_up_fixed(model, store, streams, table, prefix, next_tokens, graphs)
            drafter = MTPTreeDrafter(model, store, table, prefix, K, S, graphs)
            if whole_table:  # what the draft read before window tables: every column, column = position
                drafter.table, drafter.offset = table, torch.zeros(3, dtype=torch.long)
            tree = build_draft_tree(roots, prefix, drafter, S, K, D, root_draft=root)
        return root, tree, store

    root_e, tree_e, store_e = draft(None)
    _, tree_w, store_w = draft(None, whole_table=True)
    assert torch.equal(tree_w.tokens, tree_e.tokens) and torch.equal(store_w.buffers[0], store_e.buffers[0])
    step_graphs = sg.StepGraphs({}, capture=sg.eager_capture)
    with caplog.at_level(logging.INFO, logger=sg.__name__):
        root_g, tree_g, store_g = draft(step_graphs)
        draft(step_graphs)  # a second round replays
    for a, b in zip(root_e, root_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(tree_e.tokens, tree_g.tokens) and torch.equal(tree_e.parents, tree_g.parents)
    assert tree_g.tokens.shape[0] == 3
    real = torch.cat([runner.slots_of(r) for r in rids])
    for a, b in zip(store_e.rows(real), store_g.rows(real), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    scratch_e, scratch_g = store_e.buffers[0][-4 * stride:], store_g.buffers[0][-4 * stride:]
    torch.testing.assert_close(scratch_g[: 3 * stride], scratch_e[: 3 * stride], rtol=1e-5, atol=1e-5)
    assert not torch.equal(scratch_g[3 * stride:], scratch_e[3 * stride:])  # the padded row drafted in its own rows
    keys = re.findall(r"captured (\w+ \([^)]*\))", caplog.text)
    assert keys == ["catch_up (batch 4, C 6)", "draft (batch 4, K 3, depth 1, fed 4, stride 6)",
                    "draft (batch 4, K 3, depth 2, fed 7, stride 6)"], keys
    assert step_graphs.captures == 3


# ---- a real server through the graph path ----------------------------------------------------------------------

GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    cache = str(tmp_path_factory.mktemp("cache"))
    env = {FIXED_SHAPES_ENV: "1", sg.GRAPHS_ENV: "force"}
    started = {"plain": srv.launch(EMBEDDED, COMMON + SLEEP, logs / "plain.log",
                                   env=srv.clean_env(XDG_CACHE_HOME=cache)),
               "graphs": srv.launch(EMBEDDED, COMMON + SLEEP + TREE, logs / "graphs.log",
                                    env=srv.clean_env(XDG_CACHE_HOME=cache, **env))}
    with checks.healthy(started) as up:
        yield up


@pytest.mark.server
def test_served_through_graphs_greedy_identical(servers):
    items = checks.eval_prompts(servers["plain"])[:14] + checks.eval_prompts(servers["plain"])[-3:]
    want = checks.run_all(servers["plain"], items, GREEDY)
    got = checks.run_all(servers["graphs"], items, GREEDY)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    checks.assert_speculation_exercised(got)
    for item, ref in list(zip(items, want, strict=True))[:4]:  # one by one: batch bucket 1
        assert servers["graphs"].generate({**item, "sampling_params": GREEDY})["output_ids"] == ref["output_ids"]
    log = servers["graphs"].log.read_text()
    verify = [tuple(map(int, k)) for k in re.findall(r"captured verify \(batch (\d+), D (\d+), context (\d+)\)", log)]
    assert verify and len(verify) == len(set(verify)), log[-3000:]
    assert all(b in sg.BATCH_BUCKETS and d == 6 and c & (c - 1) == 0 for b, d, c in verify)
    assert (1, 6, 64) in verify or (1, 6, 128) in verify  # the one-by-one requests ran at batch bucket 1
    # The MTP's catch-up (C = D) and its draft steps at depths 1 .. S - 1 (K = 3, S = 3) went through graphs too.
    catch = [tuple(map(int, k)) for k in re.findall(r"captured catch_up \(batch (\d+), C (\d+)\)", log)]
    drafts = [tuple(map(int, k)) for k in re.findall(r"captured draft \(batch (\d+), K (\d+), depth (\d+)", log)]
    assert catch and all(c == 6 for _, c in catch) and (1, 6) in catch, log[-3000:]
    assert {d for _, _, d in drafts} == {1, 2} and all(k == 3 for _, k, _ in drafts)
    held = [int(h) for h in re.findall(r"; (\d+) held", log)]
    assert held == list(range(1, len(verify) + len(catch) + len(drafts) + 1))  # the log's count is what was made
