"""DeepSeek-V4 target model vs HF transformers' DeepseekV4ForCausalLM (tiny configs, random weights, fp32)."""
import math

import pytest
import torch

from sglang_tree_v4.testing.runner import DSV4Runner
from support.hf_reference import build_hf, hf_logits, ours_from_hf, rel_err

TOL = 1e-4


def _ids(n, seed, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=[(8, 120), (128, 300)], ids=["hca8-120", "hca128-300"])
def case(request):
    hca, n = request.param
    hf = build_hf(hca, seed=hca)
    ours = ours_from_hf(hf)
    ids = _ids(n, seed=n)
    return hf, ours, ids, hf_logits(hf, ids)


def test_one_shot(case):
    _, ours, ids, ref = case
    with torch.no_grad():
        full = ours.forward_sequences(ids[None]).logits[0]
    assert rel_err(full, ref) <= TOL
    r = DSV4Runner(ours, num_slots=512)
    rid = r.add_request()
    assert rel_err(r.extend([rid], [ids])[0].logits, ref) <= TOL


def test_irregular_chunks(case):
    _, ours, ids, ref = case
    r = DSV4Runner(ours, num_slots=512)
    rid = r.add_request()
    cuts = [0, 1, 8, 9, 22, 23, 40, 77, 78, 101, len(ids)]
    if len(ids) > 200:
        cuts = cuts[:-1] + [129, 130, 255, 256, 257, len(ids)]
    got = torch.cat([r.extend([rid], [ids[a:b]])[0].logits for a, b in zip(cuts, cuts[1:], strict=False)])
    assert rel_err(got, ref) <= TOL


def test_token_by_token_decode(case):
    _, ours, ids, ref = case
    r = DSV4Runner(ours, num_slots=512)
    rid = r.add_request()
    outs = [r.extend([rid], [ids[:5]])[0].logits]
    outs += [r.decode([rid], [int(t)])[0].logits for t in ids[5:]]
    assert rel_err(torch.cat(outs), ref) <= TOL


def test_batch_of_requests_mixing_prefill_and_decode(case):
    """One forward holding a prefill chunk of one request and decode tokens of others."""
    _, ours, ids, ref = case
    r = DSV4Runner(ours, num_slots=1024)
    a, b, c = r.add_request(), r.add_request(), r.add_request()
    r.extend([b, c], [ids[:50], ids[:17]])
    outs = r.extend([a, b, c], [ids[:33], ids[50:51], ids[17:18]])
    assert rel_err(outs[0].logits, ref[:33]) <= TOL
    assert rel_err(outs[1].logits, ref[50:51]) <= TOL
    assert rel_err(outs[2].logits, ref[17:18]) <= TOL


def test_indexer_topk_is_selective():
    """With more candidates than index_topk the selection must matter: a model that keeps every entry differs
    (and HF agrees with the selective one, as the other tests show)."""
    hf = build_hf(8, seed=3)
    ours = ours_from_hf(hf)
    ids = _ids(80, seed=9)
    with torch.no_grad():
        sel = ours.forward_sequences(ids[None]).logits[0]
        for blk in ours.layers:
            if blk.attn.indexer is not None:
                blk.attn.indexer.topk = 10 ** 6
        dense = ours.forward_sequences(ids[None]).logits[0]
    assert (80 // 4) > 4 * 4  # candidates exceed 4 x index_topk for the last queries
    assert rel_err(sel, hf_logits(hf, ids)) <= TOL
    assert (sel[20:] - dense[20:]).abs().max() > 1e-2


def test_full_sequence_forward_is_differentiable_and_batched():
    hf = build_hf(8, seed=5)
    ours = ours_from_hf(hf).train()
    ids = torch.stack([_ids(40, 1), _ids(40, 2)])
    out = ours.forward_sequences(ids).logits
    loss = torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    for blk in ours.layers:
        if blk.attn.compressor is not None:
            assert blk.attn.compressor.ape.grad is not None and blk.attn.compressor.ape.grad.abs().sum() > 0
    assert ours.layers[0].attn.wkv.weight.grad.abs().sum() > 0
    with torch.no_grad():
        assert rel_err(out[1].detach(), hf_logits(hf, ids[1])) <= TOL


def test_store_over_external_per_layer_buffers(case):
    """The store can wrap caller-owned [num_slots, width] buffers (an SGLang KV pool: window rows, token rows): all
    state lands in them, and copying whole rows between slots moves every piece of every layer."""
    from sglang_tree_v4.dsv4.storage import (
        ForwardBatch,
        SlotStore,
        SlotTable,
        model_layouts,
        model_token_layouts,
    )
    _, ours, ids, ref = case
    n = 64
    lays, token_lays = model_layouts(ours.cfg), model_token_layouts(ours.cfg)
    assert [lay.width for lay in lays] == [sum(w for _, w in lay.pieces.values()) for lay in lays]
    assert any(lay.width for lay in token_lays)
    # garbage-initialised, like a pool
    pool = [torch.full((2 * n + 1, lay.width), float("nan")) for lay in lays]
    token_pool = [torch.full((2 * n + 1, lay.width), float("nan")) for lay in token_lays]
    store = SlotStore(lays, 2 * n + 1, buffers=pool, token_layouts=token_lays, token_buffers=token_pool)
    slots = torch.arange(n) * 2 + 1  # non-contiguous slots
    pos = torch.arange(n)
    fb = ForwardBatch(ids[:n], pos, slots, SlotTable.for_requests(slots[None], torch.zeros(n, dtype=torch.long), pos))
    with torch.no_grad():
        got = ours(fb, store).logits
    assert rel_err(got, ref[:n]) <= TOL
    assert store.all_buffers() == pool + token_pool and all(a is b for a, b in zip(store.all_buffers(),
                                                                                    pool + token_pool, strict=False))
    assert torch.isfinite(pool[0][slots]).all() and torch.isnan(pool[0][0]).all()
    # whole-row move to even slots, then continue decoding through the moved rows
    store.copy_rows(slots, slots - 1)
    nxt = ForwardBatch(ids[n:n + 1], torch.tensor([n]), torch.tensor([2 * n]),
                       SlotTable.for_requests(torch.cat([slots - 1, torch.tensor([2 * n])])[None],
                                              torch.zeros(1, dtype=torch.long), torch.tensor([n])))
    with torch.no_grad():
        assert rel_err(ours(nxt, store).logits, ref[n:n + 1]) <= TOL


def test_empty_batch():
    from sglang_tree_v4.dsv4.storage import ForwardBatch, SlotTable
    ours = ours_from_hf(build_hf(8, seed=1))
    e = torch.zeros(0, dtype=torch.long)
    table = SlotTable(torch.zeros(1, 4, dtype=torch.long), e, e, torch.zeros(0, 0, dtype=torch.long))
    fb = ForwardBatch(e, e, e, table)
    with torch.no_grad():
        out = ours(fb, ours.new_store(4))
    assert out.logits.shape == (0, ours.cfg.vocab_size) and out.streams.shape == (0, 4, ours.cfg.hidden_size)


def test_bf16_runs_and_mostly_agrees():
    """Low precision is not tuned (HF keeps HC/norms/sinks in fp32), but it must run end to end with a bf16 store."""
    hf = build_hf(8, seed=2)
    ids = _ids(40, seed=3)
    ref = hf_logits(hf, ids)
    ours = ours_from_hf(hf, with_mtp=True).to(torch.bfloat16)
    r = DSV4Runner(ours, num_slots=128)
    rid = r.add_request()
    out = r.extend([rid], [ids[:39]])[0]
    dec = r.decode([rid], [int(ids[39])])[0]
    got = torch.cat([out.logits, dec.logits]).float()
    assert got.dtype == torch.float32 and r.store.buffers[0].dtype == torch.bfloat16
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.7
    assert r.mtp_extend([rid], [ids[1:40]], [out.streams])[0].logits.shape == (39, ours.cfg.vocab_size)


NESTED_YARN = {"main": {"rope_type": "default", "rope_theta": 10000.0},
               "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16,
                            "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1}}


@pytest.mark.parametrize("attention_factor", [1.3, None], ids=["explicit-1.3", "absent-inferred"])
def test_yarn_attention_factor_matches_transformers(tmp_path, attention_factor):
    """A nested ``rope_parameters`` config whose compress YaRN carries ``attention_factor`` (or leaves it to be
    inferred, 0.1 ln 16 + 1 = 1.277): transformers scales cos/sin by it, and so must we. The config travels through
    ``save_pretrained``'s config.json; a model that ignores the factor is shown to disagree (the check has power)."""
    import copy

    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from sglang_tree_v4.checkpoint.weights import load_state
    from sglang_tree_v4.dsv4.config import DSV4Config
    from sglang_tree_v4.dsv4.model import DSV4Model

    rp = copy.deepcopy(NESTED_YARN)
    if attention_factor is not None:
        rp["compress"]["attention_factor"] = attention_factor
    d = build_hf(8, seed=11).config.to_dict()
    d["rope_parameters"] = rp
    torch.manual_seed(11)
    cfg = DeepseekV4Config(**{k: v for k, v in d.items() if k != "transformers_version"})
    cfg._experts_implementation = "eager"
    hf = DeepseekV4ForCausalLM(cfg).eval().float()
    from support.hf_reference import randomize_zero_inits
    randomize_zero_inits(hf, cfg.vocab_size, cfg.n_routed_experts, 11)
    expected = 1.3 if attention_factor else 0.1 * math.log(16) + 1
    assert hf.model.rotary_emb.compress_attention_scaling == pytest.approx(expected)
    cfg.save_pretrained(tmp_path)
    ours_cfg = DSV4Config.from_pretrained(str(tmp_path))
    assert ours_cfg.rope_scaling["attention_factor"] == pytest.approx(expected)
    ids = _ids(120, seed=12)
    ref = hf_logits(hf, ids)

    def logits(c):
        m = DSV4Model(c, with_mtp=False).eval()
        load_state(m, hf.state_dict())
        with torch.no_grad():
            return m.forward_sequences(ids[None]).logits[0]

    assert rel_err(logits(ours_cfg), ref) <= TOL
    ignoring = DSV4Config.from_dict({**ours_cfg.to_deepseek_dict(),
                                     "rope_scaling": {**ours_cfg.rope_scaling, "attention_factor": 1.0}})
    assert rel_err(logits(ignoring), ref) > 100 * TOL


def test_indexer_in_chunks_selects_as_one_pass(monkeypatch):
    """The indexer scores entries in chunks with a running top-k; forcing 64-entry chunks (two chunks at 75 visible
    entries, top-k 4) gives the logits of scoring all entries at once, and both match HF."""
    from sglang_tree_v4.dsv4 import compressor
    hf = build_hf(128, seed=128)
    ours = ours_from_hf(hf)
    ids = _ids(300, seed=300)
    ref = hf_logits(hf, ids)
    one_pass = DSV4Runner(ours, num_slots=512)
    rid = one_pass.add_request()
    whole = one_pass.extend([rid], [ids])[0].logits
    monkeypatch.setattr(compressor, "INDEXER_CHUNK_ELEMENTS", 1)
    assert ours.layers[1].attn.indexer.chunk_entries(len(ids)) == 64
    chunked = DSV4Runner(ours, num_slots=512)
    rid = chunked.add_request()
    got = chunked.extend([rid], [ids])[0].logits
    assert torch.equal(got, whole)
    assert rel_err(got, ref) <= TOL


def test_window_rows_through_a_mapping(case):
    """In SGLang's hybrid pool a token slot's window row (keys, compressor rows) sits elsewhere, reached through the
    full-to-SWA mapping, while its token row (entries) is at the slot itself. A store whose window rows are a
    scattered mapping into a larger buffer must give exactly the identity store's logits (prefill, then decode
    steps reading the window, compressor rows and entries through it), and write window state only at mapped rows;
    a mapping that sends every slot to one row must not (the check can fail)."""
    from sglang_tree_v4.dsv4.storage import (
        ForwardBatch,
        SlotStore,
        SlotTable,
        model_layouts,
        model_token_layouts,
    )
    _, ours, ids, ref = case
    n, cfg = 48, ours.cfg
    slots = torch.arange(n)

    def run(window_index: torch.Tensor | None, window_rows: int) -> torch.Tensor:
        lays = model_layouts(cfg)
        store = SlotStore(lays, n, buffers=[torch.zeros(window_rows, lay.width) for lay in lays],
                          token_layouts=model_token_layouts(cfg), window_index=window_index)
        table = SlotTable.for_requests(slots[None], torch.zeros(n - 4, dtype=torch.long), slots[:n - 4])
        with torch.no_grad():
            out = [ours(ForwardBatch(ids[:n - 4], slots[:n - 4], slots[:n - 4], table), store).logits]
            for p in range(n - 4, n):  # decode steps
                one = torch.tensor([p])
                t = SlotTable.for_requests(slots[None], torch.zeros(1, dtype=torch.long), one)
                out.append(ours(ForwardBatch(ids[p:p + 1], one, one, t), store).logits)
        if window_index is not None:
            untouched = torch.ones(window_rows, dtype=torch.bool)
            untouched[window_index] = False
            assert all(not b[untouched].any() for b in store.buffers)
        return torch.cat(out)

    plain = run(None, n)
    assert rel_err(plain, ref[:n]) <= TOL
    scattered = torch.randperm(5 * n, generator=torch.Generator().manual_seed(3))[:n]
    assert torch.equal(run(scattered, 5 * n), plain)
    collapsed = run(torch.full((n,), 7), 5 * n)
    assert rel_err(collapsed, ref[:n]) > 10 * TOL
