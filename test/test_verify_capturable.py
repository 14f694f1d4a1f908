"""A whole TREE_V4 verify step with no host synchronisation and no data-dependent shape, proven on the CPU.

The step (``dsv4.verify_step``: target forward over trees that cross CSA and HCA block boundaries, greedy and
stochastic acceptance, accepted-path state writes; and the server's verify forward over its pool layout -- entries
a row per block, draft-tree scratch, also with the entries as fp8 bytes -- with the accepted entries' commit), one
MTP draft step and a whole EAGLE-2 draft after the root's
(``build_draft_tree``: further MTP steps and the rerank) run with every tensor on the ``meta``
device -- weights, pools, request tables, trees, coins. Meta tensors refuse ``item``, ``tolist``, ``bool``,
``nonzero``, ``unique`` and boolean-mask indexing, so a step that completes there reads nothing back to the host and
has the same shapes for any data: what a CUDA graph needs. (``torch.compile(fullgraph=True)`` is no proof: it
traces ``int(x.max())`` and ``nonzero`` without complaint.) The same step on real CPU tensors is compared with the
eager path (lists sized by the batch, ``TreeVerifier``, the data-dependent acceptance): bit for bit where the
capacities equal the batch's own widths, the same tokens and state up to float rounding where they pad.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from sglang_tree_v4.checkpoint.swap import build_model
from sglang_tree_v4.checkpoint.weights import load_model
from sglang_tree_v4.dsv4.config import DSV4Config
from sglang_tree_v4.dsv4.mtp import new_mtp_store, new_streams_store
from sglang_tree_v4.dsv4.storage import (
    ForwardBatch,
    SlotStore,
    SlotTable,
    StepCaps,
    model_token_layouts,
    paged_layouts,
)
from sglang_tree_v4.dsv4.tree_state import TreeVerifier
from sglang_tree_v4.dsv4.verify_step import verify_step
from sglang_tree_v4.serving.sglang_model import commit_accepted_entries, verify_table
from sglang_tree_v4.serving.sglang_pool import entry_ratios
from sglang_tree_v4.speculative.mtp_drafter import (
    MTPTreeDrafter,
    catch_up,
    catch_up_fixed,
)
from sglang_tree_v4.testing.runner import DSV4Runner
from sglang_tree_v4.tree import (
    DraftStep,
    DraftTree,
    SamplingParams,
    VerifyCoins,
    build_draft_tree,
    verify_greedy,
    verify_sampling,
)
from sglang_tree_v4.tree.build import top_children

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tiny-v4"
FLASH = ROOT / "data" / "deepseek_v4_flash_config.json"


# ---- the step on meta ---------------------------------------------------------------------------------------------
DRAFT_STEPS = 3  # S of the meta step's draft tree


def meta_tree(B: int, D: int) -> DraftTree:
    """A padded batch of trees as meta tensors (values unknown, only shapes)."""
    z = torch.empty(B, D, dtype=torch.long, device="meta")
    f = torch.empty(B, D, device="meta")
    return DraftTree(z, torch.empty_like(z), torch.empty_like(z), f, torch.empty_like(f),
                     torch.empty(B, dtype=torch.long, device="meta"))


def run_step_on_meta(model, B: int, D: int, K: int, caps: StepCaps, entry_format: str | None = None) -> dict:
    """One verify step (greedy and sampled acceptance, commit) and one MTP draft step, all on meta; returns the
    output shapes. ``entry_format``: how the server's pool keeps the entries and window keys (``fp8_e4m3``: as
    bytes)."""
    cfg = model.cfg
    dt = model.embed.weight.dtype
    slots = 1 << 16
    T = caps.max_context
    # window rows reached through a full-to-window mapping, as in SGLang's hybrid pool
    window_index = torch.empty(slots, dtype=torch.long, device="meta")
    store = model.new_store(slots, dt, "meta")
    mtp_store = new_mtp_store(cfg, slots, dt, "meta", B * K * (DRAFT_STEPS - 1))
    streams = new_streams_store(cfg, slots, dt, "meta")
    for s in (store, mtp_store, streams):
        s.window_index = window_index
    req_table = torch.empty(B, T, dtype=torch.long, device="meta")
    rids = torch.empty(B, dtype=torch.long, device="meta")
    lens = torch.empty(B, dtype=torch.long, device="meta")
    scratch, canonical = torch.empty(B, D, dtype=torch.long, device="meta"), torch.empty(B, D, dtype=torch.long,
                                                                                        device="meta")
    shapes = {}
    greedy = verify_step(model, store, req_table, rids, lens, meta_tree(B, D), scratch, canonical, caps)
    params = SamplingParams(*(torch.empty(B, device="meta") for _ in range(1)),
                            torch.empty(B, dtype=torch.long, device="meta"), torch.empty(B, device="meta"),
                            torch.empty(B, device="meta"))
    coins = VerifyCoins(torch.empty(B, D, dtype=torch.float64, device="meta"),
                        torch.empty(B, dtype=torch.float64, device="meta"))
    sampled = verify_step(model, store, req_table, rids, lens, meta_tree(B, D), scratch, canonical, caps, params,
                          coins)
    for name, out in (("greedy", greedy), ("sampled", sampled)):
        shapes[name] = (tuple(out.logits.shape), tuple(out.verdict.accepted_nodes.shape),
                        tuple(out.verdict.accept_lens.shape))
        assert out.logits.is_meta and out.verdict.tokens.is_meta
    # The server's verify forward over its pool layout: entries one row per block of each ratio and the tree
    # scratch (nodes out of their own slot, ``tree_entry_slots``), then the accepted entries' commit.
    paged = SlotStore(paged_layouts(cfg, entry_format)[0], slots, dt, "meta", ring_layouts=store.ring_layouts,
                      token_layouts=model_token_layouts(cfg, entry_format),
                      window_index=window_index, entry_ratios=entry_ratios(cfg), scratch_rows=B * D)
    mask = torch.empty(B * D * D, dtype=torch.bool, device="meta")
    out_slots = torch.empty(B * D, dtype=torch.long, device="meta")
    table, entry_out = verify_table(req_table, lens, mask, out_slots, D)
    fb = ForwardBatch(torch.empty(B * D, dtype=torch.long, device="meta"), torch.empty_like(out_slots), out_slots,
                      table, caps, entry_out)
    logits = model(fb, paged).logits
    commit_accepted_entries(paged, torch.empty(B, D, dtype=torch.long, device="meta"), req_table[:, :D], lens, D)
    assert logits.is_meta and all(b.is_meta for b in paged.token_buffers)
    assert (entry_format is None) != any(b.dtype == torch.uint8 for b in paged.token_buffers)
    assert (entry_format is None) != all(b.dtype == torch.uint8 for b in paged.buffers)  # fp8 window keys
    shapes["server_verify"] = tuple(logits.shape)
    # One MTP draft step: K frontier nodes per request at depth 1, reading the committed rows and their ancestors.
    drafter = MTPTreeDrafter(model, mtp_store, req_table, lens, K, DRAFT_STEPS)
    step = DraftStep(step=1, tokens=torch.empty(B, K, dtype=torch.long, device="meta"),
                     positions=torch.empty(B, K, dtype=torch.long, device="meta"),
                     slots=torch.empty(B, K, dtype=torch.long, device="meta"),
                     parent_slots=torch.empty(B, K, dtype=torch.long, device="meta"),
                     ancestors=torch.empty(B, K, 1 + K, dtype=torch.bool, device="meta"),
                     parent_hidden=torch.empty(B, K, cfg.hc_mult, cfg.hidden_size, dtype=dt, device="meta"))
    logits, hidden = drafter(step)
    logprobs, children = top_children(logits, K)
    assert children.is_meta and hidden.is_meta
    shapes["draft"] = (tuple(logits.shape), tuple(children.shape))
    # The MTP catch-up of a usual round (the last D committed positions of every request), which drafts the root.
    root_logits, root_hidden = catch_up_fixed(model, mtp_store, streams, req_table, lens,
                                              torch.empty(B, D, dtype=torch.long, device="meta"))
    assert root_logits.is_meta and tuple(root_hidden.shape) == (B, 1, cfg.hc_mult, cfg.hidden_size)
    # The whole EAGLE-2 draft after the root's: S - 1 = 2 more MTP steps, then the rerank to D nodes, with
    # per-request score temperatures (as the worker passes them).
    V = cfg.vocab_size
    root_draft = (torch.empty(B, 1, V, dtype=dt, device="meta"),
                  torch.empty(B, 1, cfg.hc_mult, cfg.hidden_size, dtype=dt, device="meta"))
    tree = build_draft_tree(torch.empty(B, dtype=torch.long, device="meta"), lens, drafter, DRAFT_STEPS, K, D,
                            root_draft=root_draft, score_temperature=torch.empty(B, device="meta"))
    assert tree.tokens.is_meta
    shapes["tree"] = tuple(tree.tokens.shape)
    return shapes


def embedded_on_meta():
    raw = json.loads((MODEL / "config.json").read_text())
    # bf16, the serving dtype on a GPU (the grouped matmul's meta kernel also asks for it)
    return build_model(DSV4Config.from_dict(raw), raw, dtype=torch.bfloat16, device="meta")


@pytest.mark.parametrize("bucket", [(2, 4, 2, None), (16, 8, 3, None), (2, 4, 2, "fp8_e4m3")],
                         ids=["B2-D4-K2", "B16-D8-K3", "B2-D4-K2-fp8-entries"])
def test_step_runs_on_meta_embedded_config(bucket):
    B, D, K, entry_format = bucket
    model = embedded_on_meta()
    caps = StepCaps(model.cfg.max_position_embeddings)
    shapes = run_step_on_meta(model, B, D, K, caps, entry_format)
    V = model.cfg.vocab_size
    assert shapes["greedy"] == shapes["sampled"] == ((B, D, V), (B, D), (B,))
    assert shapes["server_verify"] == (B * D, V)
    assert shapes["draft"] == ((B, K, V), (B, K, K))
    assert shapes["tree"] == (B, D)


@pytest.mark.slow
def test_step_runs_on_meta_v4_flash_config():
    """The published V4-Flash config: FP8 block-scaled linears and FP4 experts kept quantized, 1M-token context
    capacity (8,192 HCA entries and 262,144 CSA index keys visible per query), 43 layers + MTP."""
    raw = json.loads(FLASH.read_text())
    cfg = DSV4Config.from_dict(raw)
    model = build_model(cfg, raw, dtype=torch.bfloat16, device="meta")
    shapes = run_step_on_meta(model, 2, 8, 4, StepCaps(cfg.max_position_embeddings))
    assert shapes["greedy"] == ((2, 8, 129280), (2, 8), (2,))
    assert shapes["server_verify"] == (16, 129280)
    assert shapes["draft"] == ((2, 4, 129280), (2, 4, 4))
    assert shapes["tree"] == (2, 8)


def test_eager_path_is_refused_on_meta():
    """The negative control: the same forward sized by the batch (no caps) needs the host, and meta says so."""
    model = embedded_on_meta()
    n = 4
    store = model.new_store(64, torch.bfloat16, "meta")
    pos = torch.empty(n, dtype=torch.long, device="meta")
    table = SlotTable.for_requests(torch.empty(1, 64, dtype=torch.long, device="meta"),
                                   torch.empty(n, dtype=torch.long, device="meta"), pos)
    fb = ForwardBatch(torch.empty(n, dtype=torch.long, device="meta"), pos, torch.empty_like(pos), table)
    with pytest.raises((RuntimeError, NotImplementedError)):
        model(fb, store)


# ---- the same step on real tensors vs the eager path --------------------------------------------------------------
@pytest.fixture(scope="module")
def embedded():
    torch.manual_seed(0)
    return load_model(str(MODEL))


def greedy_continuation(runner: DSV4Runner, rid: int, first: int, n: int) -> list[int]:
    """``first`` then n - 1 greedy tokens after the request's committed prefix (on a fork, released after)."""
    f = runner.fork(rid)
    out, tok = [first], first
    for _ in range(n - 1):
        tok = int(runner.decode([f], [tok])[0].logits[0].argmax())
        out.append(tok)
    runner.release(f)
    return out


def make_trees(runner, rids, roots, D: int, num_nodes: list[int], rng: random.Random) -> DraftTree:
    """Random trees whose first-child chain follows the target's greedy tokens for a few levels (so acceptance goes
    deep), the other nodes random tokens."""
    V = runner.model.cfg.vocab_size
    toks = torch.zeros(len(rids), D, dtype=torch.long)
    par = torch.full((len(rids), D), -1, dtype=torch.long)
    for b, (rid, n) in enumerate(zip(rids, num_nodes, strict=False)):
        greedy = greedy_continuation(runner, rid, roots[b], D)
        depth, first_child = [0], {}
        par_b, tok_b = [-1], [roots[b]]
        agree = rng.randrange(1, D)  # how deep the greedy chain goes
        for i in range(1, n):
            p = rng.randrange(i) if i > agree else i - 1
            par_b.append(p)
            depth.append(depth[p] + 1)
            on_chain = p not in first_child and (p == 0 or first_child.get(par_b[p]) == p) and i <= agree
            first_child.setdefault(p, i)
            tok_b.append(greedy[depth[i]] if on_chain else rng.randrange(V))
        par[b, :n], toks[b, :n] = torch.tensor(par_b), torch.tensor(tok_b)
    return DraftTree.from_parents(toks, par, torch.tensor(num_nodes))


def prepared(model, prompts):
    runner = DSV4Runner(model, num_slots=2048, max_len=160, max_reqs=16)
    rids = [runner.add_request() for _ in prompts]
    outs = runner.extend(rids, prompts)
    roots = [int(o.logits[-1].argmax()) for o in outs]
    return runner, rids, roots


def eager_step(runner, rids, tree, slots, params=None, coins=None):
    tv = TreeVerifier(runner)
    n = tree.num_nodes.tolist()
    res = tv.verify(rids, tree.tokens, tree.parents, tree.num_nodes, scratch=list(slots))
    B, D = tree.tokens.shape
    logits = torch.zeros(B, D, res.logits[0].shape[-1])
    for b in range(B):
        logits[b, :n[b]] = res.logits[b]
    verdict = verify_greedy(tree, logits) if params is None else verify_sampling(tree, logits, params, coins=coins)
    for b, rid in enumerate(rids):
        tv.commit(rid, verdict.accepted_nodes[b, :int(verdict.accept_lens[b])].tolist())
    return logits, verdict


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("caps_kind", ["tight", "padded"])
def test_step_on_cpu_equals_eager(embedded, mode, caps_kind):
    rng = random.Random(3 if caps_kind == "tight" else 4)
    V = embedded.cfg.vocab_size
    D = 8
    # Committed lengths just before CSA (4) and HCA (16) block ends, so trees close blocks at different depths.
    lens = [14, 29, 31, 46, 61, 77]
    prompts = [[rng.randrange(2, V) for _ in range(L)] for L in lens]
    B = len(prompts)
    full = caps_kind == "tight"  # full trees: both paths run the same queries, so shapes can match exactly
    num_nodes = [D] * B if full else [rng.randrange(2, D + 1) for _ in range(B)]
    params = coins = None
    if mode == "sampled":
        params = SamplingParams(torch.tensor([0.8, 1.0, 0.6, 1.0, 0.0, 1.2]), torch.tensor([20, -1, 50, 1, -1, 8]),
                                torch.tensor([0.9, 1.0, 0.95, 1.0, 1.0, 0.8]),
                                torch.tensor([0.0, 0.05, 0.0, 0.0, 0.0, 0.1]))
        coins = VerifyCoins.draw(B, D, torch.Generator().manual_seed(11))

    eager_runner, rids, roots = prepared(embedded, prompts)
    tree = make_trees(eager_runner, rids, roots, D, num_nodes, rng)
    slots = [torch.tensor(eager_runner.alloc.alloc(D)) for _ in rids]
    e_logits, e_verdict = eager_step(eager_runner, rids, tree, slots, params, coins)

    runner, rids2, roots2 = prepared(embedded, prompts)
    assert rids2 == rids and roots2 == roots
    scratch = torch.stack([torch.tensor(runner.alloc.alloc(D)) for _ in rids])
    assert torch.equal(scratch, torch.stack(slots))  # the same slots on both sides
    longest = max(L + D for L in lens)
    caps = StepCaps(longest) if caps_kind == "tight" else StepCaps(160)
    out = verify_step(embedded, runner.store, runner.req_table, torch.tensor(rids), torch.tensor(lens), tree,
                      scratch, scratch, caps, params, coins)

    for name in ("accepted_nodes", "tokens", "accept_lens"):
        assert torch.equal(getattr(out.verdict, name), getattr(e_verdict, name)), name
    assert int(out.verdict.accept_lens.sum()) > 2 * B  # drafts were accepted, the commit moved rows
    valid = tree.valid_mask()
    new_lens = [L + int(k) for L, k in zip(lens, out.verdict.accept_lens, strict=False)]
    committed = torch.cat([runner.req_table[r, :n] for r, n in zip(rids, new_lens, strict=False)])
    rows = [eager_runner.req_table[r, :n] for r, n in zip(rids, new_lens, strict=True)]
    assert torch.equal(committed, torch.cat(rows))
    positions = torch.cat([torch.arange(n) for n in new_lens])
    ours, theirs = meaningful_rows(runner, committed, positions), meaningful_rows(eager_runner, committed, positions)
    if full:
        assert torch.equal(out.logits, e_logits)
        for a, b in zip(ours, theirs, strict=False):
            assert torch.equal(a, b)
    else:
        torch.testing.assert_close(out.logits[valid], e_logits[valid], rtol=1e-5, atol=1e-5)
        for a, b in zip(ours, theirs, strict=False):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def meaningful_rows(runner, slots, positions):
    """Every layer's window and token rows at ``slots``, with the token rows (entries) of positions that close no
    block zeroed: nothing reads them, so each path may leave whatever the slot held before."""
    rows = runner.store.rows(slots)
    first_token_row = len(runner.store.layouts)
    for layer in range(len(runner.store.token_layouts)):
        r = runner.model.cfg.compress_ratios[layer]
        if r:
            rows[first_token_row + layer][(positions + 1) % r != 0] = 0
    return rows


def test_sglang_tree_mask_ancestry_matches_tree_paths():
    """The adapter reads each node's ancestry from SGLang's tree mask by a scatter (no ``nonzero``); on random
    padded trees it must give, per node and depth, the slot of the ancestor that ``tree_paths`` names."""
    from sglang_tree_v4.dsv4.tree_state import tree_paths
    from sglang_tree_v4.serving.sglang_model import tree_ancestor_slots

    rng = random.Random(9)
    B, D = 5, 8
    par = torch.full((B, D), -1, dtype=torch.long)
    n = torch.tensor([rng.randrange(1, D + 1) for _ in range(B)])
    for b in range(B):
        for i in range(1, int(n[b])):
            par[b, i] = rng.randrange(i)
    tree = DraftTree.from_parents(torch.zeros(B, D, dtype=torch.long), par, n)
    slots = torch.randperm(1000)[: B * D]
    got = tree_ancestor_slots(tree.ancestor_mask().flatten(), slots, B, D).view(B, D, D)
    _, path = tree_paths(par, n)
    want = torch.where(path >= 0, slots.view(B, 1, D).expand(B, D, D).gather(2, path.clamp(min=0)), -1)
    valid = tree.valid_mask()
    assert torch.equal(got[valid], want[valid])
    # a padding node sees itself only (SGLang's mask), at depth 0
    pad = ~valid
    assert torch.equal(got[pad][:, 0], slots.view(B, D)[pad]) and bool((got[pad][:, 1:] == -1).all())


@torch.no_grad()
def test_fixed_catch_up_equals_the_eager_one(embedded):
    """The MTP catch-up over the last C positions of every request (fixed shapes) leaves the same MTP rows and drafts
    the same root as the eager catch-up over just the missing positions."""
    from sglang_tree_v4.dsv4.storage import SlotStore

    rng = random.Random(8)
    cfg = embedded.cfg
    lens, behind, C = [23, 40, 57], [3, 1, 8], 8
    runner = DSV4Runner(embedded, num_slots=512, max_len=96, max_reqs=3)
    rids = [runner.add_request() for _ in lens]
    seqs = [[rng.randrange(2, cfg.vocab_size) for _ in range(L + 1)] for L in lens]  # the last one: the bonus
    streams = new_streams_store(cfg, 512)
    for rid, out, _seq in zip(rids, runner.extend(rids, [s[:-1] for s in seqs]), seqs, strict=False):
        streams.write(0, "h", runner.slots_of(rid), out.streams.flatten(1))
    table = runner.req_table[torch.tensor(rids)]
    # both stores start with the MTP rows of every position but the last ``behind`` of each request
    done = [L - k for L, k in zip(lens, behind, strict=False)]
    catch_up(embedded, runner.mtp_store, streams, table, [0] * 3, done,
             [s[1:d + 1] for s, d in zip(seqs, done, strict=True)])
    fixed_store = SlotStore(runner.mtp_store.layouts, 512, buffers=[b.clone() for b in runner.mtp_store.buffers])
    eager_root = catch_up(embedded, runner.mtp_store, streams, table, done, lens,
                          [s[d + 1:L + 1] for s, d, L in zip(seqs, done, lens, strict=False)])
    fixed_root = catch_up_fixed(embedded, fixed_store, streams, table, torch.tensor(lens),
                                torch.tensor([s[L - C + 1:L + 1] for s, L in zip(seqs, lens, strict=False)]))
    for a, b in zip(eager_root, fixed_root, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    committed = torch.cat([runner.slots_of(r) for r in rids])
    for a, b in zip(runner.mtp_store.rows(committed), fixed_store.rows(committed), strict=False):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
