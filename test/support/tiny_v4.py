"""A tiny DeepSeek-V4 checkpoint with an MTP layer and random weights, plus a BPE tokenizer, written offline.

Every mechanism is present (sliding-only, CSA with a selecting indexer, HCA, hyper-connections, MoE with a hash
layer, MTP). Random weights accept few drafts, but they exercise every code path, and losslessness does not depend
on the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sglang_tree_v4.checkpoint.weights import save_checkpoint
from sglang_tree_v4.dsv4.config import DSV4Config
from sglang_tree_v4.dsv4.model import DSV4Model
from sglang_tree_v4.testing import prompts

from .tiny_llama import train_tokenizer


def tiny_config(vocab: int, hca_ratio: int = 8, window: int = 16) -> dict:
    """HF transformers' layout (``layer_types``, ``compress_rates``): it allows any HCA ratio, and transformers
    (which SGLang's tokenizer loader consults) can parse it."""
    s, c, h = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": vocab,
        "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "partial_rotary_factor": 0.25, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
        "sliding_window": window, "layer_types": [s, c, h, c], "compress_rates": {c: 4, h: hca_ratio},
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"], "index_n_heads": 16, "index_head_dim": 16,
        "index_topk": 4, "hc_mult": 2, "hc_sinkhorn_iters": 5, "hc_eps": 1e-6, "n_routed_experts": 4,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0},
                            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16,
                                         "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
                                         "attention_factor": 1.0}},
        "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1, "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }


def randomize(model: DSV4Model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(model.cfg.n_routed_experts, generator=g)[: b.shape[1]]
                                     for _ in range(b.shape[0])]))


def prefill_decode_logits(model: DSV4Model, prompt: torch.Tensor, prefill: int = 20) -> torch.Tensor:
    """Logits of one request: a prefill of the prompt's first ``prefill`` tokens, then one decode per remaining
    token (the runner's slots reach across the tiny model's CSA and HCA blocks)."""
    from sglang_tree_v4.testing.runner import DSV4Runner
    runner = DSV4Runner(model, num_slots=64, max_len=64, max_reqs=1)
    rid = runner.add_request()
    out = [runner.extend([rid], [prompt[:prefill]])[0].logits]
    for t in prompt[prefill:]:
        out.append(runner.decode([rid], [int(t)])[0].logits)
    return torch.cat(out)


def build(out: Path, seed: int = 0, hca_ratio: int = 8) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer([r["question"] for r in prompts.gsm8k("train")[:400]], vocab_size=512)
    tokenizer.save_pretrained(out)
    cfg = DSV4Config.from_dict(tiny_config(len(tokenizer), hca_ratio))
    model = DSV4Model(cfg, with_mtp=True)
    randomize(model, seed)
    save_checkpoint(model, str(out))  # weights in DeepSeek naming; the config keeps HF's layout
    raw = tiny_config(len(tokenizer), hca_ratio)
    raw.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    return out
