"""Compressed entries at one row per block (SGLang's paged pool) give exactly the logits of one row per token slot.

The server keeps each compressed layer's entries in a row per block of its ratio, ``slot // r``, which is right
because its pages are whole blocks (a page-aligned slot's offset is its position's). Draft-tree nodes that do not
sit in their position's own slot write their entries to tree scratch, and the accepted ones are copied to their
blocks' rows after acceptance. Here the same prefill, tree verification, accepted-path commit and decode run over
both layouts, with requests on scattered pages, trees whose nodes close CSA and HCA blocks (several siblings
closing the same block), and the one-row-per-slot store as the reference (its tree verification is the one the
tree-state tests hold against sequential decoding). A store that writes every node's entry to its slot's block row
(no scratch) must not give the reference's logits: the check can fail.

The server also keeps a CSA layer's compressor rows in a ring of a few rows per page (``SlotStore``'s ring rows):
over pages of 64 and a ring of 32, a 38-token prefill writes over its own first rows, so its block-closing queries
must read the rows of their own forward from its values, and the trees' nodes must not land on the committed rows
their blocks still read. Both are checked against the same pages without a ring, with controls that break each.
"""
import pytest
import torch

from sglang_tree_v4.dsv4 import compressor
from sglang_tree_v4.dsv4.storage import (
    ForwardBatch,
    SlotStore,
    SlotTable,
    StepCaps,
    model_layouts,
    model_token_layouts,
    paged_layouts,
    ring_period,
    ring_rows,
)
from sglang_tree_v4.serving.sglang_model import (
    commit_accepted_entries,
    tree_ancestor_slots,
    verify_table,
)
from sglang_tree_v4.serving.sglang_pool import entry_ratios, state_page_size
from support.hf_reference import build_hf, hf_logits, ours_from_hf, rel_err

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


RING_PAGE, PREFIX = 64, 40


def run(model, compact: bool, scratch: bool = True, fixed: bool = False, entry_format: str | None = None,
        page: int | None = None, ring: int | None = None, prefix: int = 0):
    """Prefill, verify the trees (``fixed``: with the fixed-shape step a GPU captures), commit ``ACCEPT``,
    decode: the logits of every step (``entry_format``: entries kept as fp8 bytes; ``page``: pages of that many
    slots; ``ring``: CSA compressor rows in a ring of that period per page; ``prefix``: prompts that many tokens
    longer, a multiple of every ratio, so the trees cross the same blocks)."""
    cfg = model.cfg
    P = page or state_page_size(cfg)
    T = 64 + 2 * prefix
    requests = [(L + prefix, p) for L, p in REQUESTS]
    table = page_table(P, T, seed=9)
    num_slots = (table.max().item() // P + 2) * P
    B = len(REQUESTS)
    window_layouts, ring_layouts = paged_layouts(cfg) if ring else (model_layouts(cfg), None)
    store = SlotStore(window_layouts, num_slots, token_layouts=model_token_layouts(cfg, entry_format),
                      entry_ratios=entry_ratios(cfg) if compact else None, scratch_rows=B * D,
                      ring_layouts=ring_layouts, ring_period=ring, page=P)
    if ring:
        assert store.in_ring(1, "ckv") and sum(b.shape[0] for b in store.ring_buffers if b.shape[1]) > 0
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (L,), generator=g) for L, _ in requests]
    out = []
    with torch.no_grad():
        ids = torch.cat(prompts)
        q_req = torch.cat([torch.full((L,), b) for b, (L, _) in enumerate(requests)])
        pos = torch.cat([torch.arange(L) for L, _ in requests])
        slots = table[q_req, pos]
        out.append(model(ForwardBatch(ids, pos, slots, SlotTable.for_requests(table, q_req, pos)), store).logits)

        # One verify forward of a D-node tree per request (padded trees: unused nodes are chained leaves).
        committed = torch.tensor([L for L, _ in requests])
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
            if ring:  # the pool's move of the ring rows with their window rows
                for buf in store.ring_buffers:
                    buf[ring_rows(w_dst, P, ring)] = buf[ring_rows(w_src, P, ring)]
            block = table[torch.arange(B)[:, None], committed[:, None] + torch.arange(accept.shape[1])]
            commit_accepted_entries(store, accept, block, committed, D)
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


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "fixed-shapes"])
def test_csa_compressor_rows_in_a_ring_per_page_equal_a_row_per_slot(model, fixed):
    _, ours = model
    period = ring_period(ours.cfg, RING_PAGE, D)
    # Prompts of 61-78 tokens: a prefill wraps the ring of its first page, trees and decodes cross into the second.
    assert period == 32 and min(L for L, _ in REQUESTS) + PREFIX < RING_PAGE < max(L for L, _ in REQUESTS) + PREFIX
    reference, _ = run(ours, compact=True, fixed=fixed, page=RING_PAGE, prefix=PREFIX)
    ringed, store = run(ours, compact=True, fixed=fixed, page=RING_PAGE, ring=period, prefix=PREFIX)
    assert torch.equal(ringed, reference)
    csa = [b for b in store.ring_buffers if b.shape[1]]
    assert csa and all(b.shape[0] == store.num_slots // RING_PAGE * period for b in csa)


def test_a_ring_too_short_for_the_tree_or_without_own_rows_breaks(model, monkeypatch):
    """Controls: a ring of 8 rows (a tree's nodes write over the committed rows their blocks read), and a forward
    that reads only stored rows (the prefill's own rows are overwritten before its blocks close)."""
    _, ours = model
    reference, _ = run(ours, compact=True, page=RING_PAGE, prefix=PREFIX)
    short, _ = run(ours, compact=True, page=RING_PAGE, ring=8, prefix=PREFIX)
    assert rel_err(short, reference) > 100 * TOL
    monkeypatch.setattr(compressor, "find", lambda values, queries: (torch.zeros_like(queries, dtype=torch.bool),
                                                                     torch.zeros_like(queries)))
    stored_only, _ = run(ours, compact=True, page=RING_PAGE, ring=ring_period(ours.cfg, RING_PAGE, D), prefix=PREFIX)
    assert rel_err(stored_only, reference) > 100 * TOL


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
        slots = SlotTable.for_requests(table, torch.zeros(40, dtype=torch.long), pos)
        got = ours(ForwardBatch(ids, pos, table[0, pos], slots), store).logits
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
