"""Tree verification over DeepSeek-V4 compressed attention: branch-aware verify, isolation, accepted-path commit.

Ground truth for a node = sequentially decoding prefix + path(node), one token per forward, each token forked
from its parent's state (the decode path that test_dsv4_model holds against HF transformers); a few nodes are
also checked against HF's full forward directly.
"""
import random

import pytest
import torch

from sglang_tree_v4.dsv4.tree_state import (
    TreeVerifier,
    committed_checksum,
    greedy_accept,
    tree_paths,
)
from sglang_tree_v4.testing.runner import DSV4Runner
from support.hf_reference import build_hf, hf_logits, ours_from_hf, rel_err

TOL = 1e-4
V = 512


# ---- trees ------------------------------------------------------------------------------------------------------
def chain(n):
    return [-1] + list(range(n - 1))


def star(n):
    return [-1] + [0] * (n - 1)


def kary(k, depth, cap=16):
    par, frontier = [-1], [0]
    for _ in range(depth):
        nxt = []
        for p in frontier:
            for _ in range(k):
                if len(par) < cap:
                    par.append(p)
                    nxt.append(len(par) - 1)
        frontier = nxt
    return par


def rand_tree(n, max_depth, rng):
    par, depth = [-1], [0]
    for i in range(1, n):
        cands = [j for j in range(i) if depth[j] < max_depth]
        p = rng.choice(cands)
        par.append(p)
        depth.append(depth[p] + 1)
    return par


def pack(parents_list, rng, token_fn=None):
    B, D = len(parents_list), max(len(p) for p in parents_list)
    toks = torch.zeros(B, D, dtype=torch.long)
    par = torch.full((B, D), -1, dtype=torch.long)
    for b, p in enumerate(parents_list):
        par[b, :len(p)] = torch.tensor(p)
        toks[b, :len(p)] = torch.tensor([rng.randrange(V) for _ in p] if token_fn is None else token_fn(b, p))
    return toks, par, torch.tensor([len(p) for p in parents_list])


# ---- sequential oracle ------------------------------------------------------------------------------------------
def sequential(runner, rid, tokens, parents, n):
    """Per-node logits by forking the parent's state and decoding the node's token; returns (logits, node rids)."""
    rid_of, out = {}, []
    for i in range(n):
        src = rid if parents[i] < 0 else rid_of[int(parents[i])]
        r = runner.fork(src)
        out.append(runner.decode([r], [int(tokens[i])])[0].logits[0])
        rid_of[i] = r
    return torch.stack(out), rid_of


def release_all(runner, rids):
    for r in sorted(rids, reverse=True):
        runner.release(r)


PIECES_ALWAYS = ("k", "ckv", "cscore", "ikv", "iscore", "cstate")


def assert_rows_match(runner, slots_a, slots_b, positions):
    """Rows of two slot lists agree piece by piece (entries only where a block closes)."""
    store = runner.store
    for layer, lay in enumerate(store.layouts):
        ratio = runner.model.layers[layer].ratio
        for piece in [*lay.pieces, *store.ring_layouts[layer].pieces, *store.token_layouts[layer].pieces]:
            if piece in ("entry", "ientry"):
                r = 4 if piece == "ientry" else ratio
                keep = [(p + 1) % r == 0 for p in positions]
                if not any(keep):
                    continue
                ia = slots_a[torch.tensor(keep)]
                ib = slots_b[torch.tensor(keep)]
            else:
                ia, ib = slots_a, slots_b
            a = runner.store.view(layer, piece)[ia]
            b = runner.store.view(layer, piece)[ib]
            assert rel_err(a, b) <= TOL, (layer, piece)


# ---- fixtures ---------------------------------------------------------------------------------------------------
def make_case(hca, lens, prompt_len, seed, entry_format=None):
    hf = build_hf(hca, seed=seed)
    model = ours_from_hf(hf)
    runner = DSV4Runner(model, num_slots=4096, max_len=1024, max_reqs=512, entry_format=entry_format)
    prompt = torch.randint(0, V, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    base = runner.add_request()
    runner.extend([base], [prompt])
    rids = [runner.fork(base, L) for L in lens]
    return hf, model, runner, prompt, rids


HCA8_LENS = [20, 21, 22, 23, 24, 25, 26, 27]  # every offset mod 4 and mod 8; > window 16; > 4 x index_topk / 4


@pytest.fixture(scope="module")
def hca8():
    return make_case(8, HCA8_LENS, 27, seed=41)


@pytest.fixture(scope="module")
def hca8_fp8():
    """The same case with the entries kept as fp8 bytes (``--kv-cache-dtype fp8_e4m3``)."""
    return make_case(8, HCA8_LENS, 27, seed=41, entry_format="fp8_e4m3")


def SHAPES8(rng):  # a table of tree shapes, named as the constants beside it
    return [chain(9), star(16), kary(2, 3), kary(3, 2), rand_tree(16, 8, rng), rand_tree(16, 8, rng),
            rand_tree(12, 5, rng), chain(16)[:9] + [0, 9, 9, 1, 2, 3, 4]]


def run_tree_case(case, shapes, seed, hf_check=0, tol=TOL):
    hf, model, runner, prompt, rids = case
    rng = random.Random(seed)
    toks, par, nn = pack(shapes, rng)
    tv = TreeVerifier(runner)
    stores = tv.stores
    lens = torch.tensor([runner.lens[r] for r in rids])
    before = committed_checksum(stores, runner.req_table, torch.tensor(rids), lens)
    snapshot = [b.clone() for b in runner.store.all_buffers()]
    res = tv.verify(rids, toks, par, nn)
    after = committed_checksum(stores, runner.req_table, torch.tensor(rids), lens)
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=False)), "verify changed committed state"
    scratch = torch.cat([tv.scratch[r] for r in rids])
    untouched = torch.ones(runner.store.num_slots, dtype=torch.bool)
    untouched[scratch] = False
    for b0, b1 in zip(snapshot, runner.store.all_buffers(), strict=False):  # window rows and token rows
        assert torch.equal(b0[untouched], b1[untouched]), "verify wrote outside its scratch slots"
    oracle_rids = []
    for b, rid in enumerate(rids):
        n = int(nn[b])
        ref, rid_of = sequential(runner, rid, toks[b], par[b], n)
        oracle_rids += list(rid_of.values())
        assert rel_err(res.logits[b], ref) <= tol, f"request {b} (L={int(lens[b])})"
    for b in range(hf_check):  # deepest node of request b against HF's full forward of prefix + path
        depth, path = tree_paths(par[b:b + 1], nn[b:b + 1])
        node = int(depth[0, : int(nn[b])].argmax())
        p = [int(toks[b, path[0, node, j]]) for j in range(int(depth[0, node]) + 1)]
        full = torch.cat([prompt[: int(lens[b])], torch.tensor(p)])
        assert rel_err(res.logits[b][node], hf_logits(hf, full)[-1]) <= TOL
    return tv, toks, par, nn, res, oracle_rids


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_verify_matches_sequential_and_is_isolated(hca8, seed):
    rng = random.Random(seed)
    shapes = SHAPES8(rng)
    rng.shuffle(shapes)  # a different tree per prefix length each time
    tv, toks, par, nn, res, oracle = run_tree_case(hca8, shapes, seed=seed + 10, hf_check=2 if seed == 1 else 0)
    runner, rids = hca8[2], hca8[4]
    for r in rids:
        tv.rollback(r)
    release_all(runner, oracle)


# fp8 entries and window keys: a key or entry the tree's batch computes a float rounding apart from the one
# sequential decoding computes (a matmul over D rows against one) can round to the neighbouring e4m3 value, which
# moves a node's logits by up to about 1.4e-4 here (2e-6 in full precision). Sharing state between siblings, the
# error verification exists to prevent, moves them by more than 1e-2 (the ablations).
TOL_FP8 = 1e-3


def test_verify_with_fp8_entries_matches_sequential(hca8_fp8):
    """With the entries and window keys kept as fp8 bytes, a tree node sees what sequential decoding of its path
    writes, up to the rounding of ``TOL_FP8``; verification leaves committed bytes and everything outside its
    scratch untouched; and a verify that shares state between siblings is still caught at this tolerance."""
    store = hca8_fp8[2].store
    kept = [b for b in store.token_buffers if b.shape[1]]
    assert kept and all(b.dtype == torch.uint8 for b in kept + store.buffers)
    tv, toks, par, nn, res, oracle = run_tree_case(hca8_fp8, SHAPES8(random.Random(1)), seed=11, tol=TOL_FP8)
    for r in hca8_fp8[4]:
        tv.rollback(r)
    release_all(hca8_fp8[2], oracle)
    assert shared_state_error(hca8_fp8) > 10 * TOL_FP8


def test_commit_equals_sequential_decoding(hca8):
    _, model, runner, _, rids = hca8
    rng = random.Random(5)
    tv, toks, par, nn, res, oracle = run_tree_case(hca8, SHAPES8(rng), seed=6)
    release_all(runner, oracle)
    depth, path = tree_paths(par, nn)
    for b, rid in enumerate(rids):
        L = runner.lens[rid]
        node = rng.randrange(int(nn[b]))  # accept root .. node
        acc = [int(path[b, node, j]) for j in range(int(depth[b, node]) + 1)]
        # sequential reference request: decode the accepted tokens one by one on a fork of the prefix
        ref = runner.fork(rid)
        for i in acc:
            runner.decode([ref], [int(toks[b, i])])
        tv.commit(rid, acc)
        k1 = len(acc)
        assert runner.lens[rid] == L + k1
        assert_rows_match(runner, runner.req_table[rid, L:L + k1], runner.req_table[ref, L:L + k1],
                          list(range(L, L + k1)))
        nxt = rng.randrange(V)
        a = runner.decode([rid], [nxt])[0].logits
        c = runner.decode([ref], [nxt])[0].logits
        assert rel_err(a, c) <= TOL
        runner.release(ref)


def shared_state_error(case) -> float:
    """The largest per-node logit error against sequential decoding of a verify whose siblings share a
    position-indexed slot (no isolation)."""
    hf, model, runner, prompt, rids = case
    rng = random.Random(9)
    shapes = [star(16), kary(2, 3), rand_tree(16, 8, rng)]
    toks, par, nn = pack(shapes, rng)
    sub = rids[:3]
    tv = TreeVerifier(runner)
    bad = tv.verify(sub, toks, par, nn, isolation=False)
    for r in sub:
        tv.rollback(r)
    worst, oracle = 0.0, []
    for b, rid in enumerate(sub):
        ref, rid_of = sequential(runner, rid, toks[b], par[b], int(nn[b]))
        oracle += list(rid_of.values())
        worst = max(worst, rel_err(bad.logits[b], ref))
    release_all(runner, oracle)
    return worst


def test_ablation_shared_state_breaks_siblings(hca8):
    """Same trees, but siblings share a position-indexed slot: some node's logits must differ."""
    assert shared_state_error(hca8) > 1e-2


def test_hca128_boundary_inside_tree():
    """HCA ratio 128 with prompts > 256: the block closed by position 383 is closed inside the trees, at every
    depth 0..3 across requests, by siblings with different paths."""
    case = make_case(128, [380, 381, 382, 383], 383, seed=43)
    rng = random.Random(3)
    shapes = [rand_tree(16, 8, rng), kary(2, 3), chain(9), rand_tree(14, 6, rng)]
    tv, toks, par, nn, res, oracle = run_tree_case(case, shapes, seed=4)
    runner, rids = case[2], case[4]
    depth, path = tree_paths(par, nn)
    for b, rid in enumerate(rids):
        node = int(depth[b, : int(nn[b])].argmax())
        tv.commit(rid, [int(path[b, node, j]) for j in range(int(depth[b, node]) + 1)])
    # after commit, continuing sequentially equals HF on the full accepted sequence
    hf, _, _, prompt, _ = case
    for b, rid in enumerate(rids[:2]):
        L0 = [380, 381][b]
        node = int(depth[b, : int(nn[b])].argmax())
        acc = [int(toks[b, path[b, node, j]]) for j in range(int(depth[b, node]) + 1)]
        nxt = 7
        got = runner.decode([rid], [nxt])[0].logits[0]
        full = torch.cat([prompt[:L0], torch.tensor(acc + [nxt])])
        assert rel_err(got, hf_logits(hf, full)[-1]) <= TOL


def test_fifty_rounds_of_greedy_speculation_reproduce_greedy_decoding(hca8):
    """Draft (a noisy oracle drafter) -> verify -> greedy accept -> commit, 50 rounds, three requests in one
    batch: the emitted tokens equal plain greedy decoding token for token."""
    _, model, _, _, _ = hca8
    rng = random.Random(11)
    prompts = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)) for n in (17, 22, 31)]
    # plain greedy reference (lazy)
    ref_runner = DSV4Runner(model, num_slots=2048, max_len=1024)
    ref_rids = [ref_runner.add_request() for _ in prompts]
    outs = ref_runner.extend(ref_rids, prompts)
    greedy = [[int(o.logits[-1].argmax())] for o in outs]

    def greedy_at(b, i):
        while len(greedy[b]) <= i:
            greedy[b].append(int(ref_runner.decode([ref_rids[b]], [greedy[b][-1]])[0].logits[0].argmax()))
        return greedy[b][i]

    runner = DSV4Runner(model, num_slots=2048, max_len=1024)
    rids = [runner.add_request() for _ in prompts]
    outs = runner.extend(rids, prompts)
    emitted = [[int(o.logits[-1].argmax())] for o in outs]  # bonus token = tree root of round 1
    tv = TreeVerifier(runner)
    accepted_total = 0
    for _ in range(50):
        shapes = [rand_tree(rng.randint(1, 12), 4, rng) for _ in rids]

        def tokens_for(b, par):
            depth = [0] * len(par)
            toks = [emitted[b][-1]]
            for i in range(1, len(par)):
                depth[i] = depth[par[i]] + 1
                good = greedy_at(b, len(emitted[b]) - 1 + depth[i])
                toks.append(good if rng.random() < 0.6 else rng.randrange(V))
            return toks

        toks, par, nn = pack(shapes, rng, tokens_for)
        res = tv.verify(rids, toks, par, nn)
        for b, rid in enumerate(rids):
            acc, bonus = greedy_accept(res.logits[b], toks[b], par[b], int(nn[b]))
            tv.commit(rid, acc)
            emitted[b] += [int(toks[b, i]) for i in acc[1:]] + [bonus]
            accepted_total += len(acc) - 1
    for b in range(len(rids)):
        want = [greedy_at(b, i) for i in range(len(emitted[b]))]
        assert emitted[b] == want, f"request {b} diverged"
    assert accepted_total > 50  # the drafter's tokens were actually accepted along tree paths


def test_parents_from_ancestor_mask_roundtrip():
    from sglang_tree_v4.dsv4.tree_state import parents_from_ancestor_mask
    rng = random.Random(0)
    shapes = [chain(9), star(16), kary(2, 3), rand_tree(16, 8, rng), rand_tree(5, 2, rng)]
    _, par, nn = pack(shapes, rng)
    depth, path = tree_paths(par, nn)
    D = par.shape[1]
    mask = torch.zeros(len(shapes), D, D, dtype=torch.bool)
    for b in range(len(shapes)):
        for n in range(int(nn[b])):
            for j in range(int(depth[b, n]) + 1):
                mask[b, n, path[b, n, j]] = True
    assert torch.equal(parents_from_ancestor_mask(mask), par)
