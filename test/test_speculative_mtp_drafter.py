"""The MTP tree drafter (the one the SGLang worker and the offline loop use) drafts every node exactly as running
the MTP layer sequentially down that node's path alone would, and leaves the committed MTP rows untouched.

The oracle is the plainest possible MTP chain: a fork of the request gets fresh slots for positions L, L+1, ... and
the MTP runs one query at a time with the ordinary causal slot table (no tree tables, no ancestor lists). Checked on
a random tiny V4 with a prompt longer than the sliding window."""

from __future__ import annotations

import pytest
import torch

from sglang_tree_v4.dsv4.config import DSV4Config
from sglang_tree_v4.dsv4.model import DSV4Model
from sglang_tree_v4.dsv4.mtp import mtp_forward, new_mtp_store, new_streams_store
from sglang_tree_v4.dsv4.storage import ForwardBatch, SlotTable
from sglang_tree_v4.speculative.mtp_drafter import (
    MTPTreeDrafter,
    catch_up,
    catch_up_prefill,
    catch_up_start,
    deferred_start,
    mtp_window_from,
    prefill_span,
)
from sglang_tree_v4.testing.runner import DSV4Runner
from sglang_tree_v4.tree import build_draft_tree
from support.tiny_v4 import randomize, tiny_config

D, K, S = 8, 3, 4


def _model() -> DSV4Model:
    model = DSV4Model(DSV4Config.from_dict(tiny_config(96, hca_ratio=8, window=16)), with_mtp=True).eval()
    randomize(model, seed=5)
    return model


def _prefilled(model, prompt):
    """A runner with the prompt prefilled and the MTP caught up; returns the root draft (logits, streams)."""
    runner = DSV4Runner(model, num_slots=512, max_len=128, max_reqs=4)
    rid = runner.add_request()
    out = runner.extend([rid], [prompt])[0]
    bonus = int(out.logits[-1].argmax())
    root = runner.mtp_extend([rid], [prompt[1:] + [bonus]], [out.streams])[0]
    return runner, rid, bonus, root.logits[-1], root.streams[-1]


@torch.no_grad()
def _chain_alone(runner, rid, root_streams, path):
    """MTP logits of the last node of ``path`` (tokens from depth 1), drafted one node at a time on a fork."""
    L = runner.lens[rid]
    fork = runner.fork(rid)
    fresh = runner.alloc.alloc(len(path))
    runner.req_table[fork, L:L + len(path)] = torch.tensor(fresh)
    hidden = root_streams[None]
    for depth, tok in enumerate(path, start=1):
        pos = torch.tensor([L + depth - 1])
        req = torch.tensor([fork])
        fb = ForwardBatch(torch.tensor([tok]), pos, runner.req_table[fork, pos],
                          SlotTable.for_requests(runner.req_table, req, pos))
        out = mtp_forward(runner.model, fb, hidden, runner.mtp_store)
        hidden = out.streams
    runner.req_table[fork, L:L + len(path)] = -1
    runner.alloc.release(fresh)
    runner.release(fork)
    return out.logits[0]


@pytest.mark.parametrize("prompt_len", [37, 13])  # longer than the window (16) and shorter
@torch.no_grad()
def test_tree_drafts_equal_sequential_chain_and_leave_committed_rows(prompt_len):
    model = _model()
    prompt = torch.randint(0, 96, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    runner, rid, bonus, root_logits, root_streams = _prefilled(model, prompt)
    L = runner.lens[rid]
    committed = runner.slots_of(rid)
    before = runner.mtp_store.checksum(committed)
    drafter = MTPTreeDrafter(model, runner.mtp_store, runner.req_table[rid:rid + 1], torch.tensor([L]), K, S)
    fed = []

    def recording(step):
        logits, hidden = drafter(step)
        fed.append((step, logits))
        return logits, hidden

    build_draft_tree(torch.tensor([bonus]), torch.tensor([L]), recording, S, K, D,
                     root_draft=(root_logits[None, None], root_streams[None, None]))
    assert all(torch.equal(a, b) for a, b in zip(before, runner.mtp_store.checksum(committed), strict=False))
    token_parent = {0: (bonus, -1)}
    for step, _ in fed:
        for i in range(step.tokens.shape[1]):
            token_parent[int(step.slots[0, i])] = (int(step.tokens[0, i]), int(step.parent_slots[0, i]))
    checked = 0
    for step, logits in fed:
        for i in range(step.tokens.shape[1]):
            path, slot = [], int(step.slots[0, i])
            while slot != 0:
                path.append(token_parent[slot][0])
                slot = token_parent[slot][1]
            path.reverse()
            torch.testing.assert_close(logits[0, i], _chain_alone(runner, rid, root_streams, path),
                                       rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked == K * (S - 1)
    assert max(step.step for step, _ in fed) == S - 1  # draft steps 1 .. S-1 were all fed and checked


def test_drafter_refuses_a_store_without_room_for_its_scratch():
    """Each request's K (S - 1) draft nodes need their own MTP scratch rows; too few is a clear error, not a
    silent write into another request's rows."""
    model = _model()
    store = new_mtp_store(model.cfg, 64, scratch_rows=2 * K * (S - 1) - 1)
    table = torch.zeros(2, 64, dtype=torch.long)
    with pytest.raises(ValueError, match="draft scratch rows"):
        MTPTreeDrafter(model, store, table, torch.tensor([3, 3]), K, S)
    MTPTreeDrafter(model, new_mtp_store(model.cfg, 64, scratch_rows=2 * K * (S - 1)), table, torch.tensor([3, 3]),
                   K, S)


def test_where_a_catch_up_starts():
    """Right after a prefill the MTP catches up on the prompt's last window (16 here); after a round, on what it
    accepted; after more than D steps without speculation (or none since the prefill), on the last D only."""
    assert catch_up_start(0, 37, 37, 16, 8) == (21, False)
    assert catch_up_start(0, 37, 38, 16, 8) == (22, False)
    assert catch_up_start(40, 37, 45, 16, 8) == (40, False)
    assert catch_up_start(40, 37, 48, 16, 8) == (40, False)
    assert catch_up_start(40, 37, 60, 16, 8) == (52, True)
    assert catch_up_start(0, 37, 60, 16, 8) == (52, True)
    table = torch.arange(12).view(2, 6)
    assert torch.equal(mtp_window_from(table, [0, 0]), table)
    assert mtp_window_from(table, [2, 0]).tolist() == [[-1, -1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]


@torch.no_grad()
def test_a_catch_up_after_a_gap_reads_no_row_of_the_gap():
    """After steps without speculation the MTP catches up on the last D positions only, and its window starts there:
    whatever the MTP rows of the positions before hold (stale rows of an earlier owner of the slots, here two
    different fillings), the root draft is the same. Control: with the request's whole table the fillings show."""
    model = _model()
    prompt = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    runner = DSV4Runner(model, num_slots=512, max_len=128, max_reqs=4)
    rid = runner.add_request()
    out = runner.extend([rid], [prompt])[0]
    streams = new_streams_store(model.cfg, 512)
    slots = runner.slots_of(rid)
    streams.write(0, "h", slots, out.streams.flatten(1))
    L, bonus = len(prompt), int(out.logits[-1].argmax())
    start, gap = catch_up_start(0, 20, L, model.cfg.window, D)  # 20 steps without speculation since the prefill
    assert gap and start == L - D

    def root(table, seed):
        g = torch.Generator().manual_seed(seed)
        for layer, buf in enumerate(runner.mtp_store.buffers):
            rows = runner.mtp_store.index(layer, "k", slots[:start])
            buf[rows] = torch.randn(len(rows), buf.shape[1], generator=g) * 3
        return catch_up(model, runner.mtp_store, streams, table, [start], [L], [prompt[start + 1:] + [bonus]])[0]

    masked = mtp_window_from(runner.req_table[rid:rid + 1], [start])
    assert torch.equal(root(masked, 1), root(masked, 2))
    whole = runner.req_table[rid:rid + 1]
    assert not torch.allclose(root(whole, 1), root(whole, 2))


@torch.no_grad()
@pytest.mark.parametrize("later", [0, 5])
def test_a_deferred_prefill_drafts_from_the_last_streams_alone(later):
    """A prefill that joined a batch not speculating skipped the MTP (``deferred_start``). The first draft, right
    after the prefill or ``later`` steps without speculation on, catches up on the last D positions from their
    streams alone: with every older stream NaN (what the ring no longer holds) and every MTP row below stale
    (random), the root draft is finite and the same for two fillings of the stale rows. Control: the whole table
    reads the stale rows."""
    model = _model()
    prompt = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    runner = DSV4Runner(model, num_slots=512, max_len=128, max_reqs=4)
    rid = runner.add_request()
    out = runner.extend([rid], [prompt])[0]
    tokens, target_streams = prompt + [int(out.logits[-1].argmax())], [out.streams]
    for _ in range(later):  # plain decoding: the target alone
        out = runner.extend([rid], [tokens[-1:]])[0]
        tokens.append(int(out.logits[-1].argmax()))
        target_streams.append(out.streams)
    slots, L, b = runner.slots_of(rid), len(tokens) - 1, len(prompt)
    start0 = deferred_start(0, b, D)
    start, gap = catch_up_start(start0, b, L, model.cfg.window, D)
    assert start == L - D and start0 == b - D and gap == (later > 0)
    streams = new_streams_store(model.cfg, 512)
    width = streams.layouts[0].width
    kept = L - D  # the ring holds at least the last D positions' streams (``storage.ring_period``)
    streams.write(0, "h", slots[:kept], torch.full((kept, width), float("nan")))
    streams.write(0, "h", slots[kept:L], torch.cat(target_streams)[kept:L].flatten(1))

    def root(table, seed):
        g = torch.Generator().manual_seed(seed)
        for buf in runner.mtp_store.buffers:
            rows = runner.mtp_store.index(0, "k", slots[:start])
            buf[rows] = torch.randn(len(rows), buf.shape[1], generator=g) * 3
        return catch_up(model, runner.mtp_store, streams, table, [start], [L], [tokens[start + 1:L + 1]])[0]

    masked = mtp_window_from(runner.req_table[rid:rid + 1], [start])
    first = root(masked, 1)
    assert torch.isfinite(first).all() and torch.equal(first, root(masked, 2))
    whole = runner.req_table[rid:rid + 1]
    assert not torch.allclose(root(whole, 1), root(whole, 2), equal_nan=True)


PROMPT_LEN = 45


def test_prefill_span():
    """Rows a prefill chunk [a, b) computes: its last window, from the position before it, stopping before a
    final chunk's last position (its row needs the token the prefill samples)."""
    W = 16
    assert prefill_span(0, 45, 45, W) == (29, 44)  # whole prompt: its last window but the last position
    assert prefill_span(0, 20, 45, W) == (4, 20)  # a first chunk: its last window, through its end
    assert prefill_span(20, 45, 45, W) == (29, 44)
    assert prefill_span(40, 45, 45, W) == (39, 44)  # a short chunk reaches back one position
    assert prefill_span(32, 33, 33, W) == (31, 32)  # a radix hit up to the last token: the position before it
    assert prefill_span(0, 1, 1, W) == (0, 0)  # a one-token prompt: nothing before the sampled token


def _prefill_with_mtp(model, chunks, from_chunk, poison_before):
    """The server's prefill rounds on a runner: each chunk's target forward, its streams into a store in which every
    stream more than one position before the next chunk is NaN (what the pool's few ring rows per page no longer
    hold), the MTP over ``prefill_span`` from the chunk's own streams (from chunk ``from_chunk`` on: before it, as
    after a radix hit, the MTP never ran), then the decode round's catch-up of the last position. ``poison_before``
    (a control): also the stream just before a chunk is NaN. Returns the runner, request, MTP rows of the prompt
    and the root draft's logits."""
    prompt = torch.randint(0, 96, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)).tolist()
    runner = DSV4Runner(model, num_slots=512, max_len=128, max_reqs=4)
    rid = runner.add_request()
    streams = new_streams_store(model.cfg, 512)
    first = chunks[from_chunk][0] - 1 if from_chunk else 0
    for i, (a, b) in enumerate(chunks):
        out = runner.extend([rid], [prompt[a:b]])[0]
        table = mtp_window_from(runner.req_table[rid:rid + 1], [first])
        lost = a if poison_before else max(a - 1, 0)
        streams.write(0, "h", runner.req_table[rid, :lost], torch.full((lost, streams.layouts[0].width), float("nan")))
        streams.write(0, "h", runner.req_table[rid, a:b], out.streams.flatten(1))
        if i >= from_chunk:
            span = prefill_span(a, b, PROMPT_LEN, model.cfg.window)
            catch_up_prefill(model, runner.mtp_store, streams, table, [(a, b)], [span], out.streams, [prompt])
    bonus = int(out.logits[-1].argmax())
    logits, _ = catch_up(model, runner.mtp_store, streams, table, [PROMPT_LEN - 1], [PROMPT_LEN], [[bonus]])
    return prompt, bonus, runner.mtp_store.read(0, "k", runner.req_table[rid, :PROMPT_LEN]), logits[0, 0]


def _window_catch_up(model, first):
    """The reference: the whole prompt's streams stored, the MTP over its last window (from ``first``, masked
    below it) in one catch-up with the bonus."""
    prompt = torch.randint(0, 96, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)).tolist()
    runner = DSV4Runner(model, num_slots=512, max_len=128, max_reqs=4)
    rid = runner.add_request()
    out = runner.extend([rid], [prompt])[0]
    streams = new_streams_store(model.cfg, 512)
    streams.write(0, "h", runner.slots_of(rid), out.streams.flatten(1))
    bonus = int(out.logits[-1].argmax())
    start = max(first, PROMPT_LEN - model.cfg.window)
    table = mtp_window_from(runner.req_table[rid:rid + 1], [first])
    logits, _ = catch_up(model, runner.mtp_store, streams, table, [start], [PROMPT_LEN],
                         [prompt[start + 1:] + [bonus]])
    return bonus, runner.mtp_store.read(0, "k", runner.slots_of(rid)), logits[0, 0], start


@pytest.mark.parametrize("chunks, from_chunk", [([(0, 20), (20, 45)], 0), ([(0, 40), (40, 45)], 0),
                                                ([(0, 32), (32, 45)], 1)], ids=["chunked", "short-last", "cached"])
@torch.no_grad()
def test_prefill_catch_up_needs_one_stream_before_its_chunk(chunks, from_chunk):
    """The server runs the MTP in its prefill rounds over each chunk's last window from the streams the forward
    produced (``catch_up_prefill``), so the pool keeps a few streams per page: the prompt's last window of MTP rows
    and the root draft must be those of one catch-up over the window from every stream, though every stream more
    than one position before a chunk is NaN. After a radix hit (the first chunk's MTP never ran) the MTP's window
    starts at the position before the chunk, as the reference masked there. Control: that one stream NaN too."""
    model = _model()
    first = chunks[from_chunk][0] - 1 if from_chunk else 0
    bonus, ref_rows, ref_logits, start = _window_catch_up(model, first)
    prompt, got_bonus, rows, logits = _prefill_with_mtp(model, chunks, from_chunk, poison_before=False)
    assert got_bonus == bonus
    assert rel_err(rows[start:], ref_rows[start:]) < 1e-5 and rel_err(logits, ref_logits) < 1e-5
    if from_chunk:
        _, _, bad_rows, bad_logits = _prefill_with_mtp(model, chunks, from_chunk, poison_before=True)
        assert torch.isnan(bad_rows[start]).all() and torch.isnan(bad_logits).all()


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())
