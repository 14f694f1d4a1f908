"""Write a random-weight DeepSeek-V4 checkpoint in DeepSeek's layout (config.json + safetensors, incl. ``mtp.0.*``).

Defaults are V4-Flash's per-layer dimensions (head_dim 512, 64 heads, window 128, CSA 4 / HCA 128, 64 index heads,
index_topk 512) with few layers and experts, so SGLang-side kernels see production shapes while the file stays
small. Every dimension can be overridden; ``--fp8`` stores 2-D projection weights as FP8 e4m3 with 128x128 UE8M0
block scales (``<name>.scale``), as the published checkpoints do.

    python scripts/make_random_v4.py OUT [--layers 0,4,128,4] [--experts 8] [--hidden 4096] [--dtype bf16] [--fp8]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file

from sglang_tree_v4.checkpoint.weights import deepseek_state
from sglang_tree_v4.dsv4.config import DSV4Config
from sglang_tree_v4.dsv4.model import DSV4Model


def randomize_(model: torch.nn.Module, seed: int, std: float) -> None:
    """Random values for everything, including what a zero init would leave inert (slot bias, sinks, HC base,
    hash routing), so every mechanism is exercised."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith((".ape", "attn_sink", ".base")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith(".scale"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: b.shape[1]]
                                     for _ in range(b.shape[0])]))
            elif name.endswith("gate.bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    o, i = w.shape
    po, pi = -(-o // block) * block, -(-i // block) * block
    wp = torch.zeros(po, pi, dtype=torch.float32)
    wp[:o, :i] = w.float()
    amax = wp.abs().reshape(po // block, block, pi // block, block).amax(dim=(1, 3)).clamp(min=1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (wp / scale.repeat_interleave(block, 0).repeat_interleave(block, 1))[:o, :i].to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--layers", default="0,4,128,4", help="compress ratio per main layer")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk-experts", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--moe-inter", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--hash-layers", type=int, default=1)
    ap.add_argument("--no-mtp", action="store_true")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    ratios = [int(x) for x in a.layers.split(",")]
    nextn = 0 if a.no_mtp else 1
    d = {
        "vocab_size": a.vocab, "hidden_size": a.hidden, "num_hidden_layers": len(ratios),
        "num_attention_heads": a.heads, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 448, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
        "compress_ratios": ratios + [0] * nextn, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "n_routed_experts": a.experts,
        "n_shared_experts": 1, "num_experts_per_tok": a.topk_experts, "moe_intermediate_size": a.moe_inter,
        "num_hash_layers": a.hash_layers, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0, "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                         "beta_slow": 1},
        "num_nextn_predict_layers": nextn, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6,
    }
    cfg = DSV4Config.from_dict(d)  # validates
    model = DSV4Model(cfg, with_mtp=bool(nextn))
    randomize_(model, a.seed, a.std)
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    keep32 = ("hc_", "attn_sink", ".ape", "norm.weight", "gate.bias", "tid2eid")
    out = {}
    for k, v in deepseek_state(model).items():
        if not v.is_floating_point() or any(s in k for s in keep32):
            out[k] = v.contiguous() if not v.is_floating_point() else v.float().contiguous()
        elif a.fp8 and v.dim() == 2 and k.endswith(".weight") and "compressor" not in k and "embed" not in k:
            out[k], out[k[: -len("weight")] + "scale"] = fp8_block(v)
        else:
            out[k] = v.to(dt).contiguous()
    os.makedirs(a.out, exist_ok=True)
    save_file(out, os.path.join(a.out, "model.safetensors"))
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **d}, f, indent=1)
    n = sum(v.numel() for v in out.values())
    print(f"wrote {a.out}: {n / 1e6:.1f} M values, layers {ratios}, experts {a.experts}, fp8={a.fp8}")


if __name__ == "__main__":
    main()
