"""Compressed entries at one row per block (SGLang's paged pool) give exactly the logits of one row per token slot.

The server keeps each compressed layer's entries in a row per block of its ratio, ``slot // r``, which is right
because its pages are whole blocks (a page-aligned slot's offset is its position's). Draft-tree nodes that do not
sit in their position's own slot write their entries to tree scratch, and the accepted ones are copied to their
blocks' rows after acceptance. Here the same prefill, tree verification, accepted-path commit and decode run over
both layouts, with requests on scattered pages, trees whose nodes close CSA and HCA blocks (several siblings
closing the same block), and the one-row-per-slot store as the reference (its tree verification is the one the
tree-state tests hold against sequential decoding). A store that writes every node's entry to its slot's block row
(no scratch) must not give the reference's logits: the check can fail.
"""
import pytest
import torch

from dsv4_tiny import build_hf, hf_logits, ours_from_hf, rel_err
from sglang_tree_v4.dsv4.sglang_model import commit_accepted_entries, tree_ancestor_slots, verify_table
from sglang_tree_v4.dsv4.sglang_pool import entry_ratios, state_page_size
from sglang_tree_v4.dsv4.storage import (ForwardBatch, SlotStore, SlotTable, StepCaps, model_layouts,
                                         model_token_layouts)

torch.set_num_threads(1)
V, TOL = 512, 1e-4
# Per request: prompt length, then the tree (parents, -1 = root). Depths cross the CSA (4) and HCA (8) blocks.
REQUESTS = [(29, [-1, 0, 0, 1, 1, 2, 3, 3, 4, 6]),  # root at 29: siblings 3, 4 at 31 both close a CSA block
            (21, [-1, 0, 1, 2, 0, 4, 5, 1, 7, 8]),  # two branches reaching 24 (HCA block 2 closes at 23)
            (38, [-1, 0, 0, 0, 1, 2, 3, 4, 5, 6])]  # three siblings at 39 (closes CSA and HCA blocks)
D = max(len(p) for _, p in REQUESTS)
ACCEPT = [[0, 1, 3, 6], [0, 4, 5, 6], [0, 2, 5, 8]]  # accepted paths (node indices): most nodes not in own slot
DECODE = 6


@pytest.fixture(scope="module")
def model():
    hf = build_hf(8, seed=5)
    return hf, ours_from_hf(hf)


def page_table(P: int, lens: int, seed: int) -> torch.Tensor:
    """``req_to_token`` of a paged allocator: each request's pages scattered over the pool, slot % P = pos % P."""
    pages_per_req = -(-lens // P)
    pages = torch.randperm(len(REQUESTS) * pages_per_req + 4, generator=torch.Generator().manual_seed(seed))
    pages = pages[pages > 0][:len(REQUESTS) * pages_per_req].view(len(REQUESTS), pages_per_req)  # page 0: padding
    pos = torch.arange(pages_per_req * P)
    return pages[:, pos // P] * P + pos % P


def run(model, compact: bool, scratch: bool = True, fixed: bool = False, entry_format: str | None = None):
    """Prefill, verify the trees (``fixed``: with the fixed-shape step a GPU captures), commit ``ACCEPT``,
    decode: the logits of every step (``entry_format``: entries kept as fp8 bytes)."""
    cfg = model.cfg
    P = state_page_size(cfg)
    T = 64
    table = page_table(P, T, seed=9)
    num_slots = (table.max().item() // P + 2) * P
    B = len(REQUESTS)
    store = SlotStore(model_layouts(cfg), num_slots, token_layouts=model_token_layouts(cfg, entry_format),
                      entry_ratios=entry_ratios(cfg) if compact else None, scratch_rows=B * D)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (L,), generator=g) for L, _ in REQUESTS]
    out = []
    with torch.no_grad():
        ids = torch.cat(prompts)
        q_req = torch.cat([torch.full((L,), b) for b, (L, _) in enumerate(REQUESTS)])
        pos = torch.cat([torch.arange(L) for L, _ in REQUESTS])
        slots = table[q_req, pos]
        out.append(model(ForwardBatch(ids, pos, slots, SlotTable.for_requests(table, q_req, pos)), store).logits)

        # One verify forward of a D-node tree per request (padded trees: unused nodes are chained leaves).
        committed = torch.tensor([L for L, _ in REQUESTS])
        parents = torch.tensor([p + [len(p) - 1 + k for k in range(D - len(p))] for _, p in REQUESTS])
        depth = torch.zeros(B, D, dtype=torch.long)
        mask = torch.zeros(B, D, D, dtype=torch.bool)
        for b in range(B):
            for i in range(D):
                mask[b, i, i] = True
                j = int(parents[b, i])
                if j >= 0:
                    depth[b, i] = depth[b, j] + 1
                    mask[b, i] |= mask[b, j]
        tokens = torch.randint(0, V, (B, D), generator=g)
        out_slots = table[torch.arange(B)[:, None], committed[:, None] + torch.arange(D)].flatten()
        positions = (committed[:, None] + depth).flatten()
        if compact and scratch:
            vt, entry_out = verify_table(table, committed, mask.flatten(), out_slots, D)
        else:  # every node's entry at its own slot (a slot row per token; without scratch: its slot's block row)
            vt = SlotTable(table, torch.arange(B).repeat_interleave(D), committed.repeat_interleave(D),
                           tree_ancestor_slots(mask.flatten(), out_slots, B, D))
            entry_out = None
        caps = StepCaps(T) if fixed else None
        out.append(model(ForwardBatch(tokens.flatten(), positions, out_slots, vt, caps, entry_out), store).logits)

        # Accept a path per request: window rows move to the canonical slots (SGLang's move), entries from scratch.
        accept = torch.tensor(ACCEPT) + torch.arange(B)[:, None] * D
        src, dst = out_slots[accept.flatten()], table[torch.arange(B)[:, None],
                                                      committed[:, None] + torch.arange(len(ACCEPT[0]))].flatten()
        if compact:
            w_src, w_dst = store._window_rows(src), store._window_rows(dst)
            for buf in store.buffers:
                buf[w_dst] = buf[w_src]
            commit_accepted_entries(store, accept, table, committed, D)
        else:
            store.copy_rows(src, dst)
        lens = committed + len(ACCEPT[0])
        for t in range(DECODE):
            nxt = torch.randint(0, V, (B,), generator=g)
            p = lens + t
            out.append(model(ForwardBatch(nxt, p, table[torch.arange(B), p],
                                          SlotTable.for_requests(table, torch.arange(B), p)), store).logits)
    return torch.cat(out), store


@pytest.mark.parametrize("entry_format", [None, "fp8_e4m3"], ids=["full-precision", "fp8"])
@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "fixed-shapes"])
def test_entries_per_block_with_tree_scratch_equal_entries_per_slot(model, fixed, entry_format):
    hf, ours = model
    reference, _ = run(ours, compact=False, fixed=fixed, entry_format=entry_format)
    compact, store = run(ours, compact=True, fixed=fixed, entry_format=entry_format)
    assert torch.equal(compact, reference)
    if entry_format:  # the fp8 bytes are really what is kept, and they change the logits a little
        assert all(b.dtype == torch.uint8 for b in store.token_buffers if b.shape[1])
        assert 0 < rel_err(compact, run(ours, compact=True, fixed=fixed)[0]) < 1
    # Rows per entry layer: one per block of the slot range and the scratch, not one per slot.
    for layer, buf in enumerate(store.token_buffers):
        r = entry_ratios(ours.cfg)[layer]
        if r:
            assert buf.shape[0] == -(-store.num_slots // r) + len(REQUESTS) * D


def test_without_scratch_siblings_overwrite_each_other(model):
    """Control: nodes writing their entries to their slot's block row collide (siblings closing one block, a node
    overwriting another position's block), and the logits differ."""
    _, ours = model
    reference, _ = run(ours, compact=False)
    broken, _ = run(ours, compact=True, scratch=False)
    assert rel_err(broken, reference) > 100 * TOL


def test_prefill_and_decode_logits_match_transformers(model):
    """The reference layout itself is the model: a paged prefill equals transformers' logits."""
    hf, ours = model
    cfg = ours.cfg
    P = state_page_size(cfg)
    table = page_table(P, 48, seed=4)[:1]
    ids = torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(8))
    num_slots = (table.max().item() // P + 2) * P
    store = SlotStore(model_layouts(cfg), num_slots, token_layouts=model_token_layouts(cfg),
                      entry_ratios=entry_ratios(cfg))
    pos = torch.arange(40)
    with torch.no_grad():
        got = ours(ForwardBatch(ids, pos, table[0, pos], SlotTable.for_requests(table, torch.zeros(40, dtype=torch.long),
                                                                                pos)), store).logits
    assert rel_err(got, hf_logits(hf, ids)) <= TOL


def test_a_verify_table_of_the_root_alone_reads_what_a_tree_table_reads():
    """``verify_table`` with one node per request (a step without speculation) skips the tree-mask bookkeeping and
    reads like a decode query; every position it can look up, window and entries, resolves to the slot the general
    table (the root as its own only ancestor) gives, and its entries go to its own slot."""
    bs, T = 3, 40
    req_table = torch.arange(bs * T).view(bs, T)
    committed = torch.tensor([5, 17, 33])
    out_slots = req_table.gather(1, committed[:, None]).squeeze(1)
    table, entry_out = verify_table(req_table, committed, torch.ones(bs, dtype=torch.bool), out_slots, 1)
    general = SlotTable(req_table, torch.arange(bs), committed, out_slots[:, None], out_slots[:, None])
    pos = committed[:, None] - torch.arange(T)
    for entries in (False, True):
        assert torch.equal(table.lookup(pos, entries), general.lookup(pos, entries))
    assert torch.equal(entry_out, out_slots)
