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
from sglang_tree_v4.dsv4.runner import DSV4Runner
from sglang_tree_v4.dsv4.storage import ForwardBatch, SlotTable
from sglang_tree_v4.speculative.mtp_drafter import MTPTreeDrafter, catch_up, catch_up_start, mtp_window_from
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
    assert all(torch.equal(a, b) for a, b in zip(before, runner.mtp_store.checksum(committed)))
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
