"""Tiny DeepSeek-V4 configs with random weights, built with HF transformers (the reference implementation) and
converted to this package's model. Shared by the dsv4 tests and the decode benchmark."""
from __future__ import annotations

import torch

from sglang_tree_v4.checkpoint.weights import load_state
from sglang_tree_v4.dsv4.config import DSV4Config
from sglang_tree_v4.dsv4.model import DSV4Model

S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def hf_config(hca: int = 8, layers: tuple[str, ...] = (S, C, H, C), topk: int = 4, window: int = 16,
              vocab: int = 512, hidden: int = 128, moe_inter: int = 64, q_lora: int = 64):
    from transformers import DeepseekV4Config
    n = len(layers)
    return DeepseekV4Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=1,
        head_dim=64, partial_rotary_factor=0.25, q_lora_rank=q_lora, o_groups=2, o_lora_rank=32,
        moe_intermediate_size=moe_inter, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        layer_types=list(layers), mlp_layer_types=["hash_moe"] + ["moe"] * (n - 1),
        compress_rates={C: 4, H: hca}, sliding_window=window, index_n_heads=16, index_head_dim=32,
        index_topk=topk, hc_mult=4, hc_sinkhorn_iters=20, max_position_embeddings=4096,
        rope_parameters={"type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
                         "beta_fast": 32, "beta_slow": 1},
        initializer_range=0.08, tie_word_embeddings=False,
    )


def randomize_zero_inits(model: torch.nn.Module, vocab: int, n_experts: int, seed: int = 0) -> None:
    """Re-randomise what HF initialises to zero/one, so ape, sinks, HC base/scale and hash routing are exercised."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("position_bias", "sinks", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith((".scale", "hc_scale")):
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith(("norm.weight", "layernorm.weight")):
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(n_experts, generator=g)[: b.shape[1]] for _ in range(vocab)]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)


def build_hf(hca: int = 8, seed: int = 0, **kw):
    from transformers import DeepseekV4ForCausalLM
    torch.manual_seed(seed)
    cfg = hf_config(hca, **kw)
    cfg._experts_implementation = "eager"
    m = DeepseekV4ForCausalLM(cfg).eval().float()
    randomize_zero_inits(m, cfg.vocab_size, cfg.n_routed_experts, seed)
    return m


def ours_from_hf(hf, with_mtp: bool = False) -> DSV4Model:
    cfg = DSV4Config.from_hf(hf.config)
    m = DSV4Model(cfg, with_mtp=with_mtp).eval()
    if with_mtp:
        g = torch.Generator().manual_seed(123)
        with torch.no_grad():
            for name, p in m.mtp.named_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.08 if p.dim() >= 2 else 0.3)
                        + (1.0 if name.endswith(("norm.weight", "scale")) else 0.0))
    state = {k: v for k, v in hf.state_dict().items()}
    own_mtp = {f"mtp.{k}": v for k, v in m.mtp.state_dict().items()} if with_mtp else {}
    load_state(m, {**state, **{_ds(k): v for k, v in own_mtp.items()}})
    return m


def _ds(k: str) -> str:
    from sglang_tree_v4.checkpoint.weights import to_deepseek
    return to_deepseek(k)


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Worst per-position relative error: max over rows of max|a - b| / max|b| (whole tensor if 1-D)."""
    a, b = a.float().reshape(-1, a.shape[-1]), b.float().reshape(-1, b.shape[-1])
    return float(((a - b).abs().amax(-1) / b.abs().amax(-1)).max()) if a.numel() else 0.0
