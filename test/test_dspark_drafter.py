"""The DSpark drafter's math (``dsv4.dspark``) on the embedded target with a seeded drafter.

* Row j's draft logits given any parent token are the backbone's ``U_j`` plus the Markov head's bias of that token,
  and the greedy chain follows them.
* The block is bidirectional (row 0 changes when later rows' inputs do) and its context is exactly the last
  ``window`` committed positions (a key just outside changes nothing, the oldest one inside does).
* Confidence lies in [0, 1]; the target's taps are the mean over streams after each tapped layer.
* Configs: none without ``dspark_*`` keys; the unsupported Markov type, V4.1, missing keys and bad ids are refused
  naming the key.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_tree_v4.checkpoint.weights import load_model
from sglang_tree_v4.dsv4 import dspark as ds
from sglang_tree_v4.dsv4.storage import SlotTable
from support.served import EMBEDDED

GAMMA, RANK, TAPS = 4, 16, (1, 3)


def seeded(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(".fn") or p.dim() >= 2:
                p.copy_(p.shape[-1] ** -0.5 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def model():
    m = load_model(str(EMBEDDED))
    dcfg = ds.DSparkConfig(GAMMA, RANK, noise_token_id=5, target_layer_ids=TAPS)
    m.dspark = ds.DSparkDrafter(m.cfg, dcfg)
    seeded(m.dspark, 0)
    return m.eval()


def context(model, L: int, seed: int = 1):
    """A store whose stage keys hold positions 0 .. L - 1 (slots = positions) from random features."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    store = ds.new_dspark_store(cfg, model.dspark.dcfg, 256)
    feats = torch.randn(L, len(TAPS) * cfg.hidden_size, generator=g)
    with torch.no_grad():
        ds.write_context(model, feats, torch.arange(L), torch.arange(L), store)
    return store


def run_block(model, store, L: int, anchor: int = 7) -> ds.BlockOutput:
    table = SlotTable.for_requests(torch.arange(256)[None], torch.zeros(1, dtype=torch.long), torch.tensor([L - 1]))
    block = torch.arange(200, 200 + GAMMA)[None]
    keys = ds.block_key_slots(table, torch.tensor([L]), block, model.cfg.window)
    with torch.no_grad():
        return ds.block_logits(model, torch.tensor([anchor]), torch.tensor([L]), keys, block, store)


def test_conditionals_are_the_backbone_plus_the_markov_bias_and_the_chain_follows_them(model):
    out = run_block(model, context(model, 50), 50)
    assert out.logits.shape == (1, GAMMA, model.cfg.vocab_size) and out.hidden.shape == (1, GAMMA, 128)
    parents = torch.tensor([3, 99, 1000])
    head = model.dspark.last.markov_head
    with torch.no_grad():
        got = ds.conditional_logits(model, out.logits[0, 2].expand(3, -1), parents)
        want = out.logits[0, 2].float()[None] + (head.head.weight.float() @ head.embed.weight[parents].float().t()).t()
        chain = ds.greedy_chain(model, out, torch.tensor([7]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[0], got[1])  # the parent shapes the conditional
    prev = 7
    for j in range(GAMMA):
        with torch.no_grad():
            prev = int(ds.conditional_logits(model, out.logits[0, j], torch.tensor(prev)).argmax())
        assert int(chain[0, j]) == prev


def test_the_servers_k1_tree_is_the_greedy_chain_and_k3_branches_on_exact_conditionals(model):
    """``dspark_drafter.draft_tree`` (what the worker runs): K = 1, S = γ gives ``greedy_chain`` from the same block
    pass; with K = 3 every child's token is among the top 3 of its own parent's conditional."""
    from sglang_tree_v4.speculative.dspark_drafter import draft_tree

    L = torch.tensor([50, 37])
    store = ds.new_dspark_store(model.cfg, model.dspark.dcfg, 256, block_rows=2 * GAMMA)
    for mine, theirs in zip(store.buffers, context(model, 60).buffers, strict=True):
        mine[:256].copy_(theirs[:256])
    table = torch.arange(256).expand(2, 256)
    roots = torch.tensor([7, 9])
    with torch.no_grad():
        chain = draft_tree(model, store, table, L, roots, GAMMA, 1, GAMMA + 1)
        block = ds.block_logits(model, roots, L, ds.block_key_slots(
            SlotTable.for_requests(table, torch.arange(2), L - 1), L, -2 - torch.arange(2 * GAMMA).view(2, GAMMA),
            model.cfg.window), -2 - torch.arange(2 * GAMMA).view(2, GAMMA), store)
        want = ds.greedy_chain(model, block, roots)
        tree = draft_tree(model, store, table, L, roots, 3, 3, 8)
    assert torch.equal(chain.tokens[:, 1:], want) and chain.parents[0].tolist() == [-1, 0, 1, 2, 3]
    for b in range(2):
        for i in range(1, 8):
            p, d = int(tree.parents[b, i]), int(tree.depths[b, i])
            cond = ds.conditional_logits(model, block.logits[b, d - 1], tree.tokens[b, p])
            assert int(tree.tokens[b, i]) in cond.topk(3).indices.tolist()


def test_markov_bias_in_a_bf16_drafter_is_the_fp32_one_rounded():
    """A server in bf16 holds the Markov head in bf16: the bias is computed there, returned in fp32."""
    head = ds.MarkovHead(100, 16)
    seeded(head, 2)
    prev = torch.tensor([3, 50, 99])
    with torch.no_grad():
        want, got = head(prev), head.to(torch.bfloat16)(prev)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)


def test_block_is_bidirectional_and_sees_exactly_the_last_window(model):
    L, W = 60, model.cfg.window
    store = context(model, L)
    base = run_block(model, store, L).logits
    noisy = dataclasses.replace(model.dspark.dcfg, noise_token_id=11)
    saved, model.dspark.dcfg = model.dspark.dcfg, noisy
    try:
        other_noise = run_block(model, store, L).logits
    finally:
        model.dspark.dcfg = saved
    assert not torch.allclose(other_noise[:, 0], base[:, 0])  # row 0 (the anchor's) sees the later rows
    for pos, changes in ((L - W - 1, False), (L - W, True), (L - 1, True)):
        poked = context(model, L)
        for s in range(len(TAPS)):
            poked.buffers[s][pos] += 3.0
        got = run_block(model, poked, L).logits
        assert torch.equal(got, base) != changes, pos


def test_confidence_in_unit_interval(model):
    out = run_block(model, context(model, 40), 40)
    with torch.no_grad():
        c = ds.confidence(model, out.hidden[0], torch.tensor([7, 8, 9, 10]))
    assert c.shape == (GAMMA,) and bool(((c >= 0) & (c <= 1)).all())


def test_target_taps_are_the_stream_means_after_the_layers(model):
    ids = torch.randint(0, model.cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.forward_sequences(ids, taps=TAPS)
    H = model.cfg.hidden_size
    assert out.features.shape == (2, 20, len(TAPS) * H)
    torch.testing.assert_close(out.features[..., H:], out.streams.mean(2))  # layer 3 is the last


def test_configs():
    base = {"model_type": "deepseek_v4", "dspark_block_size": 5, "dspark_markov_rank": 32,
            "dspark_noise_token_id": 9, "dspark_target_layer_ids": [1, 2, 3]}
    assert ds.DSparkConfig.from_dict({"model_type": "deepseek_v4"}, 4, 100) is None
    got = ds.DSparkConfig.from_dict(base, 4, 100)
    assert got.block_size == 5 and got.num_stages == 3 and got.target_layer_ids == (1, 2, 3)
    for change, named in (({"dspark_markov_head_type": "gated"}, "dspark_markov_head_type"),
                          ({"model_type": "deepseek_v41"}, "deepseek_v41"),
                          ({"dspark_target_layer_ids": [1, 4]}, "dspark_target_layer_ids"),
                          ({"dspark_noise_token_id": 100}, "dspark_noise_token_id")):
        with pytest.raises(ds.DSparkConfigError, match=named):
            ds.DSparkConfig.from_dict({**base, **change}, 4, 100)
    with pytest.raises(ds.DSparkConfigError, match="dspark_markov_rank"):
        ds.DSparkConfig.from_dict({k: v for k, v in base.items() if k != "dspark_markov_rank"}, 4, 100)


def test_context_after_rounds_with_rejections_equals_a_prefill(model):
    """Prefill a prompt, then verify rounds of D = 5 chains whose drafts are the target's greedy tokens with one
    corrupted at a random depth (or none): after the accepted-path commits (the target's rows and the stage keys
    from the verify forward's taps, ``dspark_drafter.commit_context``) the stage keys of every committed position
    equal those a prefill of the committed sequence writes. Position p sits in slot p + 1 (slot 0 is SGLang's padding
slot, where unaccepted columns write). Negative control: keys taken from the next node's taps."""
    from sglang_tree_v4.dsv4.storage import ForwardBatch
    from sglang_tree_v4.dsv4.tree_state import build_verify_batch, commit
    from sglang_tree_v4.speculative.dspark_drafter import commit_context

    cfg, g = model.cfg, torch.Generator().manual_seed(3)
    prompt = torch.randint(3, cfg.vocab_size, (20,), generator=g).tolist()
    with torch.no_grad():
        greedy = list(prompt)
        for _ in range(40):
            greedy.append(int(model.forward_sequences(torch.tensor([greedy])).logits[0, -1].argmax()))

    def run(shift: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        store, dstore = model.new_store(512), ds.new_dspark_store(cfg, model.dspark.dcfg, 512)
        table = torch.full((1, 256), -1, dtype=torch.long)
        table[0, :20] = torch.arange(20) + 1
        rid = torch.zeros(1, dtype=torch.long)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            out = model(ForwardBatch(torch.tensor(prompt), torch.arange(20), torch.arange(20) + 1,
                                     SlotTable.for_requests(table, torch.zeros(20, dtype=torch.long),
                                                            torch.arange(20))), store, taps=TAPS)
            ds.write_context(model, out.features, torch.arange(20), torch.arange(20) + 1, dstore)
            L, rejected = 20, 0
            for r in range(8):
                drafts = greedy[L:L + 5]
                bad = int(torch.randint(1, 6, (1,), generator=gen))  # depth 1-4 corrupted, 5: none
                if bad < 5:
                    drafts[bad] = (drafts[bad] + 1) % cfg.vocab_size
                    rejected += 1
                tokens = torch.tensor([drafts])
                scratch = 300 + 5 * r + torch.arange(5)[None]
                vb = build_verify_batch(table, rid, torch.tensor([L]), tokens, torch.tensor([[-1, 0, 1, 2, 3]]),
                                        torch.tensor([5]), scratch)
                out = model(vb.fb, store, taps=TAPS)
                k = 0
                while k < 4 and int(out.logits[k].argmax()) == drafts[k + 1]:
                    k += 1
                accepted = torch.tensor([[j if j <= k else -1 for j in range(5)]])
                canonical = L + 1 + torch.arange(5)[None]
                commit([store], table, rid, torch.tensor([L]), accepted, scratch, canonical)
                index = torch.where(accepted >= 0, (accepted + shift).clamp(max=4), -1)
                commit_context(model, dstore, out.features, index, table[:, L:L + 5], torch.tensor([L]))
                L += k + 1
        return torch.stack([b[1:L + 1] for b in dstore.buffers]), table, rejected

    got, table, rejected = run(0)
    L = got.shape[1]
    assert rejected >= 3 and L > 30 and table[0, :L].tolist() == list(range(1, L + 1))
    fresh = ds.new_dspark_store(cfg, model.dspark.dcfg, 512)
    with torch.no_grad():
        feats = model.forward_sequences(torch.tensor([greedy[:L]]), taps=TAPS).features[0]
        ds.write_context(model, feats, torch.arange(L), torch.arange(L) + 1, fresh)
    want = torch.stack([b[1:L + 1] for b in fresh.buffers])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    wrong, _, _ = run(1)
    assert wrong.shape == got.shape and not torch.allclose(wrong, want, rtol=1e-3, atol=1e-3)
