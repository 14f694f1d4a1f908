"""MTP drafting over a tree: per-node draft logits equal drafting each path alone, committed MTP state untouched,
and a full draft -> verify -> commit -> refresh loop reproduces greedy decoding."""

import torch

from dsv4_tiny import build_hf, ours_from_hf, rel_err
from sglang_tree_v4.dsv4.mtp_draft import MTPTreeDrafter
from sglang_tree_v4.dsv4.runner import DSV4Runner
from sglang_tree_v4.dsv4.tree_state import TreeVerifier, greedy_accept

V = 512


def _setup(seed=51):
    model = ours_from_hf(build_hf(8, seed=seed), with_mtp=True)
    return model, DSV4Runner(model, num_slots=4096, max_len=1024, max_reqs=64)


def _prefill_with_mtp(runner, drafter, prompts):
    rids = [runner.add_request() for _ in prompts]
    outs = runner.extend(rids, prompts)
    roots, bonus = [], []
    for rid, p, o in zip(rids, prompts, outs):
        b = int(o.logits[-1].argmax())
        roots.append(drafter.refresh(rid, o.streams, p[1:].tolist() + [b]))
        bonus.append(b)
    return rids, roots, bonus


def test_tree_draft_equals_per_path_draft_and_is_isolated():
    model, runner = _setup()
    drafter = MTPTreeDrafter(runner)
    prompts = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)) for n in (21, 26, 30)]
    rids, roots, bonus = _prefill_with_mtp(runner, drafter, prompts)
    committed = torch.cat([runner.slots_of(r) for r in rids])
    before = runner.mtp_store.checksum(committed)
    states = [drafter.start(r, b, root, 16) for r, b, root in zip(rids, bonus, roots)]
    drafter.expand_topk(states, k=2, steps=4)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.mtp_store.checksum(committed)))
    assert max(max(st.depths) for st in states) == 4 and all(len(st.tokens) == 16 for st in states)
    for st, r, b, root in zip(states, rids, bonus, roots):
        for n in range(1, len(st.tokens)):
            alone = drafter.start(r, b, root, 8)
            for node in st.path(n)[1:]:
                drafter.draft_step([alone], [[(len(alone.tokens) - 1, st.tokens[node])]])
            assert rel_err(alone.logits[-1], st.logits[n]) <= 1e-4
            runner.alloc.release(alone.slots.tolist())


def test_draft_verify_commit_refresh_loop_is_greedy():
    model, runner = _setup(seed=52)
    drafter = MTPTreeDrafter(runner)
    tv = TreeVerifier(runner)
    prompts = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)) for n in (19, 28)]
    rids, roots, bonus = _prefill_with_mtp(runner, drafter, prompts)
    emitted = [[b] for b in bonus]
    for _ in range(20):
        states = [drafter.start(r, b, root, 10) for r, b, root in zip(rids, bonus, roots)]
        drafter.expand_topk(states, k=2, steps=3)
        toks, par, nn = MTPTreeDrafter.as_tensors(states)
        res = tv.verify(rids, toks, par, nn, scratch=[st.slots for st in states])
        roots, bonus = [], []
        for b, rid in enumerate(rids):
            acc, bon = greedy_accept(res.logits[b], toks[b], par[b], int(nn[b]))
            tv.commit(rid, acc)
            nxt = [int(toks[b, i]) for i in acc[1:]] + [bon]
            roots.append(drafter.refresh(rid, res.streams[b][acc], nxt))
            bonus.append(bon)
            emitted[b] += nxt
    # plain greedy decoding
    ref = DSV4Runner(model, num_slots=1024, max_len=1024)
    for b, p in enumerate(prompts):
        rid = ref.add_request()
        tok = int(ref.extend([rid], [p])[0].logits[-1].argmax())
        want = [tok]
        while len(want) < len(emitted[b]):
            tok = int(ref.decode([rid], [tok])[0].logits[0].argmax())
            want.append(tok)
        assert emitted[b] == want
        # refreshed MTP state == MTP run straight over the whole committed sequence
        seq = torch.cat([p, torch.tensor(emitted[b][:-1])])
        r2 = ref.add_request()
        out = ref.extend([r2], [seq])[0]
        straight = ref.mtp_extend([r2], [seq[1:].tolist() + [emitted[b][-1]]], [out.streams])[0]
        assert rel_err(roots[b].logits[0], straight.logits[-1]) <= 1e-4
