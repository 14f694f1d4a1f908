"""The MTP (next-n) layer: shape, agreement with a reference assembled from HF transformers' V4 modules,
chunked vs one-shot, and loading from DeepSeek-named ``mtp.*`` tensors."""
import pytest
import torch

from sglang_tree_v4.checkpoint.weights import load_model, save_checkpoint, to_internal
from sglang_tree_v4.testing.runner import DSV4Runner
from support.hf_reference import build_hf, ours_from_hf, rel_err

N = 60


@pytest.fixture(scope="module")
def setup():
    hf = build_hf(8, seed=21)
    ours = ours_from_hf(hf, with_mtp=True)
    ids = torch.randint(0, 512, (N + 1,), generator=torch.Generator().manual_seed(8))
    r = DSV4Runner(ours, num_slots=256)
    rid = r.add_request()
    tgt = r.extend([rid], [ids[:N]])[0]
    return hf, ours, ids, tgt.streams


def _mtp_run(ours, ids, streams, cuts):
    r = DSV4Runner(ours, num_slots=256)
    rid = r.add_request()
    r.extend([rid], [ids[:N]])
    outs = [r.mtp_extend([rid], [ids[a + 1:b + 1]], [streams[a:b]])[0] for a, b in zip(cuts, cuts[1:], strict=False)]
    return torch.cat([o.logits for o in outs]), torch.cat([o.streams for o in outs])


def test_shapes(setup):
    _, ours, ids, streams = setup
    cfg = ours.cfg
    assert streams.shape == (N, cfg.hc_mult, cfg.hidden_size)
    lg, st = _mtp_run(ours, ids, streams, [0, N])
    assert lg.shape == (N, cfg.vocab_size) and st.shape == (N, cfg.hc_mult, cfg.hidden_size)


def test_chunked_and_decode_equal_one_shot(setup):
    _, ours, ids, streams = setup
    ref, ref_st = _mtp_run(ours, ids, streams, [0, N])
    chunked, ch_st = _mtp_run(ours, ids, streams, [0, 3, 4, 17, 33, 34, N])
    stepwise, _ = _mtp_run(ours, ids, streams, list(range(N + 1)))
    assert rel_err(chunked, ref) <= 1e-5 and rel_err(ch_st, ref_st) <= 1e-5
    assert rel_err(stepwise, ref) <= 1e-5


def _hf_parts_mtp(hf, ours):
    """Independent MTP: HF's DeepseekV4DecoderLayer (1-layer sliding/moe config) + HF hyper head, with the
    e_proj / h_proj / enorm / hnorm wiring written out here."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M
    cfg = M.DeepseekV4Config(**{**hf.config.to_dict(), "num_hidden_layers": 1, "layer_types": ["sliding_attention"],
                                "mlp_layer_types": ["moe"]})
    cfg._experts_implementation = "eager"
    layer = M.DeepseekV4DecoderLayer(cfg, 0).eval()
    head = M.DeepseekV4HyperHead(cfg).eval()
    rot = M.DeepseekV4RotaryEmbedding(cfg)
    mine = {k: v for k, v in ours.state_dict().items() if k.startswith("mtp.0.")}
    inv = {}  # our module name -> HF layer name, by converting HF names forward
    for k in layer.state_dict():
        inv[to_internal("model.layers.0." + k)[len("layers.0."):]] = k
    lsd = layer.state_dict()
    with torch.no_grad():
        for k, v in mine.items():
            k = k[len("mtp.0."):]
            if k in inv:
                lsd[inv[k]].copy_(v)
        lsd["mlp.experts.gate_up_proj"].copy_(torch.cat([mine["mtp.0.ffn.experts.w1"],
                                                         mine["mtp.0.ffn.experts.w3"]], dim=1))
        lsd["mlp.experts.down_proj"].copy_(mine["mtp.0.ffn.experts.w2"])
        head.hc_fn.copy_(mine["mtp.0.hc_head.fn"])
        head.hc_base.copy_(mine["mtp.0.hc_head.base"])
        head.hc_scale.copy_(mine["mtp.0.hc_head.scale"])
    blk = ours.mtp[0]

    def run(ids_next, streams, positions):
        with torch.no_grad():
            e = blk.e_proj(blk.enorm(ours.embed(ids_next)))
            h = blk.h_proj(blk.hnorm(streams)) + e[:, None]
            pos = positions[None]
            pe = {"main": rot(h, pos, layer_type="main"), "compress": rot(h, pos, layer_type="compress")}
            S = len(positions)
            i = torch.arange(S)
            allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < cfg.sliding_window)
            mask = torch.zeros(S, S).masked_fill(~allowed, float("-inf"))[None, None]
            out = layer(h[None], input_ids=ids_next[None], position_embeddings=pe, position_ids=pos,
                        attention_mask=mask, past_key_values=None)
            return ours.head(blk.norm(head(out)))[0]
    return run


def test_matches_reference_built_from_hf_modules(setup):
    hf, ours, ids, streams = setup
    ref = _hf_parts_mtp(hf, ours)(ids[1:N + 1], streams, torch.arange(N))
    got, _ = _mtp_run(ours, ids, streams, [0, 7, N])
    assert rel_err(got, ref) <= 1e-4


def test_loading_deepseek_mtp_tensors(setup, tmp_path):
    _, ours, ids, streams = setup
    save_checkpoint(ours, str(tmp_path))
    from safetensors.torch import load_file, save_file
    t = load_file(str(tmp_path / "model.safetensors"))
    assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.enorm.weight", "mtp.0.hnorm.weight",
            "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.hc_attn_fn", "mtp.0.attn.wq_a.weight",
            "mtp.0.ffn.experts.3.w2.weight", "mtp.0.ffn.gate.bias"} <= set(t)
    # DeepSeek checkpoints may repeat the shared embedding/head under mtp.0: they are ignored
    t["mtp.0.emb.tok_emb.weight"] = t["embed.weight"].clone()
    t["mtp.0.head.weight"] = t["head.weight"].clone()
    save_file(t, str(tmp_path / "model.safetensors"))
    loaded = load_model(str(tmp_path))
    assert len(loaded.mtp) == 1
    a, _ = _mtp_run(ours, ids, streams, [0, N])
    b, _ = _mtp_run(loaded, ids, streams, [0, N])
    assert torch.equal(a, b)
    del t["mtp.0.h_proj.weight"]
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(Exception, match=r"mtp\.0\.h_proj\.weight"):
        load_model(str(tmp_path))
