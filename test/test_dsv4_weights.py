"""Config parsing (DeepSeek and HF layouts) and checkpoint loading (DeepSeek and HF naming, FP8, errors)."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from sglang_tree_v4.checkpoint.weights import (
    CheckpointError,
    deepseek_state,
    load_model,
    load_state,
    save_checkpoint,
)
from sglang_tree_v4.dsv4.config import ConfigError, DSV4Config
from support.hf_reference import build_hf, hf_logits, ours_from_hf, rel_err

FLASH = {  # DeepSeek config.json layout, V4-Flash values
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 448,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rope_theta": 10000,
    "compress_rope_theta": 160000, "rope_scaling": {"type": "yarn", "factor": 16,
                                                     "original_max_position_embeddings": 65536,
                                                     "beta_fast": 32, "beta_slow": 1},
    "num_nextn_predict_layers": 1, "max_position_embeddings": 1048576, "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def tiny():
    hf = build_hf(8, seed=11)
    ids = torch.randint(0, 512, (50,), generator=torch.Generator().manual_seed(4))
    return hf, ids, hf_logits(hf, ids)


def test_flash_config_both_layouts_agree():
    from transformers import DeepseekV4Config
    ours = DSV4Config.from_dict(FLASH)
    assert ours.compress_ratios[:4] == (0, 0, 4, 128) and len(ours.compress_ratios) == 43
    assert ours.hash_layers[:4] == (True, True, True, False) and ours.rope_dim == 64
    assert ours.ignored_keys == ("torch_dtype",)
    via_hf = DSV4Config.from_hf(DeepseekV4Config(**{k: v for k, v in FLASH.items() if k != "torch_dtype"}))
    assert via_hf == ours
    assert DSV4Config.from_dict(ours.to_deepseek_dict()) == ours


def test_tiny_hf_config_roundtrip(tiny):
    hf, _, _ = tiny
    c = DSV4Config.from_hf(hf.config)
    assert c.compress_ratios == (0, 4, 8, 4) and c.hash_layers == (True, False, False, False)
    assert c.rope_scaling["factor"] == 16 and c.rope_dim == 16
    assert DSV4Config.from_dict(c.to_deepseek_dict()) == c


@pytest.mark.parametrize("key,value,match", [
    ("compress_ratios", [0, 0] + [4, 1] * 20 + [4, 0], "compress_ratios"),
    ("compress_ratios", [0, 0] + [4, 128] * 20 + [4, 4], "compress_ratios"),
    ("compress_ratios", [0, 4], "compress_ratios"),
    ("scoring_func", "relu", "scoring_func"),
    ("num_key_value_heads", 8, "num_key_value_heads"),
    ("hidden_size", None, "hidden_size"),
    ("hidden_size", "4096", "hidden_size"),
    ("qk_nope_head_dim", 400, "qk_nope_head_dim"),
    ("o_groups", 7, "o_groups"),
    ("rope_scaling", {"type": "linear", "factor": 2}, "rope_scaling"),
    ("num_hash_layers", 50, "num_hash_layers"),
])
def test_bad_deepseek_config_names_the_key(key, value, match):
    d = dict(FLASH)
    d[key] = value
    with pytest.raises(ConfigError, match=match):
        DSV4Config.from_dict(d)


def test_bad_hf_config_names_the_key(tiny):
    hf, _, _ = tiny
    d = hf.config.to_dict()
    with pytest.raises(ConfigError, match="layer_types"):
        DSV4Config.from_dict({**d, "layer_types": ["sliding_attention", "bogus", "sliding_attention",
                                                   "sliding_attention"]})
    with pytest.raises(ConfigError, match="compress_rates"):
        DSV4Config.from_dict({**d, "compress_rates": {"compressed_sparse_attention": 8,
                                                      "heavily_compressed_attention": 8}})


def _save_hf_named(hf, path):
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf.config.to_dict(), f)


def test_deepseek_and_hf_naming_load_identically(tiny, tmp_path):
    hf, ids, ref = tiny
    _save_hf_named(hf, tmp_path / "hf")
    save_checkpoint(ours_from_hf(hf), str(tmp_path / "ds"))
    names = json.load(open(tmp_path / "ds" / "config.json"))
    assert "compress_ratios" in names and "layer_types" not in names
    a, b = load_model(str(tmp_path / "hf")), load_model(str(tmp_path / "ds"))
    with torch.no_grad():
        la, lb = a.forward_sequences(ids[None]).logits[0], b.forward_sequences(ids[None]).logits[0]
    assert torch.equal(la, lb)
    assert rel_err(la, ref) <= 1e-4
    from safetensors.torch import load_file
    ds_names = set(load_file(str(tmp_path / "ds" / "model.safetensors")))
    assert {"embed.weight", "head.weight", "hc_head_fn", "layers.1.attn.indexer.compressor.ape",
            "layers.1.ffn.experts.7.w3.weight", "layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.bias",
            "layers.2.hc_attn_fn", "layers.2.attn.attn_sink"} <= ds_names


def test_missing_and_misshaped_tensors_are_named(tiny):
    hf, _, _ = tiny
    ours = ours_from_hf(hf)
    state = deepseek_state(ours)
    bad = dict(state)
    del bad["layers.2.attn.compressor.ape"]
    with pytest.raises(CheckpointError, match=r"layers\.2\.attn\.compressor\.ape"):
        load_state(ours, bad)
    bad = dict(state)
    bad["layers.1.attn.wq_b.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wq_b\.weight.*\(3, 3\)"):
        load_state(ours, bad)
    bad = dict(state)
    del bad["layers.3.ffn.experts.5.w2.weight"]
    with pytest.raises(CheckpointError, match=r"layers\.3\.ffn\.experts\.w2.*missing experts \[5\]"):
        load_state(ours, bad)


def _fp8_quant(w, block=32, pow2=False):
    o, i = w.shape
    s = w.abs().reshape(o // block, block, i // block, block).amax(dim=(1, 3)) / 448.0
    if pow2:  # UE8M0 scales, as DeepSeek-V4 checkpoints ship them
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (w / s.repeat_interleave(block, 0).repeat_interleave(block, 1)).to(torch.float8_e4m3fn)
    return q, s


def test_fp8_block_scaled_weights_are_dequantised(tiny, tmp_path):
    hf, ids, ref = tiny
    ours = ours_from_hf(hf)
    save_checkpoint(ours, str(tmp_path))
    state = deepseek_state(ours)
    q, s = _fp8_quant(state["head.weight"])
    state["head.weight"], state["head.scale"] = q, s
    q2, s2 = _fp8_quant(state["layers.3.ffn.experts.2.w1.weight"], pow2=True)
    state["layers.3.ffn.experts.2.w1.weight"] = q2
    state["layers.3.ffn.experts.2.w1.scale"] = s2.to(torch.float8_e8m0fnu)
    save_file(state, str(tmp_path / "model.safetensors"))
    ours = load_model(str(tmp_path))
    want = q.float() * s.repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert torch.equal(ours.head.weight.data, want)
    assert torch.equal(ours.layers[3].ffn.experts.w1.data[2], q2.float() * s2.repeat_interleave(32, 0)
                       .repeat_interleave(32, 1))
    with torch.no_grad():
        got = ours.forward_sequences(ids[None]).logits[0]
    assert 0 < rel_err(got, ref) < 0.1  # quantisation noise only


def test_fp4_experts_are_dequantised_into_a_dense_model(tiny):
    """FP4 e2m1 experts (two per byte, low nibble first, per-32 e8m0 scales) fed to a dense model are dequantised."""
    from sgl_kernel_ext.weight_formats import dequantize_fp4, quantize_fp4
    hf, _, _ = tiny
    ours = ours_from_hf(hf)
    state = deepseek_state(ours)
    q, s = quantize_fp4(state["layers.1.ffn.experts.0.w1.weight"])
    state["layers.1.ffn.experts.0.w1.weight"], state["layers.1.ffn.experts.0.w1.scale"] = q, s
    load_state(ours, state)
    assert torch.equal(ours.layers[1].ffn.experts.w1.data[0], dequantize_fp4(q, s))
    state["layers.1.ffn.experts.0.w1.scale"] = s[:, :1]
    with pytest.raises(CheckpointError, match=r"layers\.1\.ffn\.experts\.0\.w1\.weight.*FP4"):
        load_state(ours, state)
