"""Shape, initialisation and joint target + MTP loss of the embedded tiny DeepSeek-V4.

The config is written in HF transformers' layout (``layer_types``, ``compress_rates``, ``rope_parameters``) because
transformers' ``DeepseekV4Config`` -- which SGLang's tokenizer loader parses -- only accepts DeepSeek's own layout
with an HCA ratio of 128, and this model uses a much smaller one so that a few-hundred-token chat crosses many HCA
block boundaries (and therefore draft trees do too).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_tree_v4.dsv4.config import DSV4Config
from sglang_tree_v4.dsv4.model import DSV4Model
from sglang_tree_v4.dsv4.mtp import mtp_forward
from sglang_tree_v4.dsv4.storage import ForwardBatch, SlotTable

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def hf_config(vocab: int, bos: int, eos: int, hidden: int = 128, hca_ratio: int = 16, window: int = 32) -> dict:
    """Every V4 mechanism: a sliding-only layer, two CSA layers (ratio 4; the indexer keeps 8 of the visible
    entries, so it selects from 36 tokens on), one HCA layer, 2 hyper-connection streams, MoE with 4 routed + 1
    shared expert and a hash-routed first layer, one MTP layer."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": vocab,
        "hidden_size": hidden, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 64, "partial_rotary_factor": 0.25, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32,
        "sliding_window": window, "layer_types": [SWA, CSA, HCA, CSA], "compress_rates": {CSA: 4, HCA: hca_ratio},
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"], "index_n_heads": 8, "index_head_dim": 32,
        "index_topk": 8, "hc_mult": 2, "hc_sinkhorn_iters": 8, "hc_eps": 1e-6, "n_routed_experts": 4,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0},
                            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 4,
                                         "original_max_position_embeddings": 1024, "beta_fast": 32,
                                         "beta_slow": 1, "attention_factor": 1.0}},
        "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32",
    }


def init_weights(model: DSV4Model, seed: int) -> None:
    """Seeded init. The module constructors zero several tensors on purpose (they are loaded from checkpoints);
    for training from scratch zeros would be fatal: zero routed experts never receive a gradient, zero
    hyper-connection projections keep the identical initial streams identical forever, and an all-zero hash
    table sends every token to expert 0."""
    g = torch.Generator().manual_seed(seed)
    n_layers = model.cfg.num_layers + len(model.mtp)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "embed.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(".fn") or name.endswith("gate.weight"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                std = p.shape[-1] ** -0.5
                if any(name.endswith(s) for s in ("wo_b.weight", ".w2", "w2.weight")):
                    std /= (2 * n_layers) ** 0.5  # residual-branch outputs start small
                p.copy_(std * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                E = model.cfg.n_routed_experts
                b.copy_(torch.stack([torch.randperm(E, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]))


def mtp_batch(B: int, T: int, device) -> ForwardBatch:
    """Slot layout for the MTP over B full sequences: query (b, p) for p < T-1 at position p, slot b*(T-1)+p."""
    n = T - 1
    pos = torch.arange(n, device=device).repeat(B)
    req = torch.arange(B, device=device).repeat_interleave(n)
    slots = torch.arange(B * n, device=device)
    return pos, req, slots.view(B, n)


def joint_loss(model: DSV4Model, ids: torch.Tensor, mtp_weight: float, detach_streams: bool = False,
               mtp_distill: float = 0.0):
    """ids [B, T] -> (total, target CE, MTP CE, target logits, MTP logits).

    Target: position p predicts token p+1. MTP: the query at position p takes the target's last-block streams at p
    and the token at p+1 (teacher forcing) and predicts the token at p+2 -- exactly what it is asked at drafting time,
    where the token at p+1 is the target's own choice.

    ``mtp_distill`` = a in [0, 1] trains the MTP on a mix of the data's token (weight 1 - a) and the target's own
    (detached) next-token distribution at p+2 (weight a): a draft is paid for agreeing with the target, not with the
    data, and the target's soft distribution is a denser signal than one sampled token. The returned MTP CE is
    always the data CE, so logs stay comparable."""
    B, T = ids.shape
    out = model.forward_sequences(ids)
    tgt_ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), ids[:, 1:].reshape(-1))
    streams = out.streams[:, :-1]
    if detach_streams:
        streams = streams.detach()
    pos, req, table = mtp_batch(B, T, ids.device)
    store = model_mtp_store(model, B * (T - 1), ids.device)
    fb = ForwardBatch(ids[:, 1:].reshape(-1), pos, table.reshape(-1), SlotTable.for_requests(table, req, pos))
    mo = mtp_forward(model, fb, streams.reshape(-1, *streams.shape[2:]), store)
    mlog = mo.logits.view(B, T - 1, -1)
    V = mlog.shape[-1]
    mtp_ce = F.cross_entropy(mlog[:, :-1].reshape(-1, V), ids[:, 2:].reshape(-1))
    mtp_loss = mtp_ce
    if mtp_distill > 0:
        teacher = out.logits[:, 1:-1].detach().float().softmax(-1).reshape(-1, V)
        soft_ce = -(teacher * mlog[:, :-1].float().log_softmax(-1).reshape(-1, V)).sum(-1).mean()
        mtp_loss = (1 - mtp_distill) * mtp_ce + mtp_distill * soft_ce
    return tgt_ce + mtp_weight * mtp_loss, tgt_ce, mtp_ce, out.logits, mlog


def model_mtp_store(model: DSV4Model, n: int, device):
    from sglang_tree_v4.dsv4.mtp import new_mtp_store
    return new_mtp_store(model.cfg, n, model.embed.weight.dtype, device)


def build_model(cfg_dict: dict, seed: int) -> DSV4Model:
    model = DSV4Model(DSV4Config.from_dict(cfg_dict), with_mtp=True)
    init_weights(model, seed)
    return model
