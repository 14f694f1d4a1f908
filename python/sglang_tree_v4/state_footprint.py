"""The attention state our server holds per token and per running request, and what upstream SGLang would hold.

Why: the per-slot layout (``dsv4.storage``) gives every token one row per pool layer (each layer as wide as its own
pieces, ``dsv4.sglang_pool``); at V4-Flash shapes that is the state that decides how many tokens a GPU can serve.
This module measures it the way the server allocates it -- the pool class the server builds, with the arguments
SGLang derives from the config our model override hands it (``sglang_config``), at two small sizes, so the slope
is the pool's real bytes per slot and not a formula -- and splits the slot into kinds from our row layout (the
split must add up to the measured slope).

Per running request the server also holds the draft-tree slots the worker reserves beyond the committed length
(``D + K (S - 1)``: the largest tree's nodes and the draft's scratch) and one ``req_to_token`` row (int32 per
position of the context length).

Upstream's figures come from its V4 layout (``notes``: fp8 entries of ``head_dim - rope`` e4m3 bytes + bf16 rope
+ 8 scale bytes, CSA index keys of ``index_head_dim`` e4m3 bytes + a 4-byte scale, one entry per ``r`` tokens;
per request the SWA ring of ``window + D - 1`` fp8 rows in every layer and the MTP layer, the fp32 compressor
rings of 16 rows (CSA, main and indexer) and 256 rows (HCA) under speculation). They are a formula, stated as such.
"""

from __future__ import annotations

import torch

from .dsv4.config import CSA, HCA, DSV4Config
from .dsv4.sglang_pool import pool_layer_widths, state_pool_class
from .dsv4.storage import model_layouts, mtp_layouts
from .speculative.mtp_drafter import round_slots
from .speculative.model_override import sglang_config

KIND_OF_PIECE = {"k": "window_kv", "ckv": "compressor_rows", "cscore": "compressor_rows",
                 "ikv": "compressor_rows", "iscore": "compressor_rows", "entry": "compressed_entries",
                 "ientry": "compressed_entries"}
KV_CACHE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32}


def measured_bytes_per_slot(cfg: DSV4Config, pool_config, dtype: torch.dtype) -> int:
    """Bytes per token slot of the pool the server builds (``dsv4.sglang_pool``, with the arguments SGLang passes
    from ``pool_config``, what our model override hands it), from two real allocations."""
    pool_class = state_pool_class(pool_layer_widths(cfg))

    def total(slots: int) -> int:
        pool = pool_class(size=slots, page_size=1, dtype=dtype, head_num=pool_config.num_key_value_heads,
                          head_dim=pool_config.head_dim, layer_num=pool_config.num_hidden_layers, device="cpu",
                          enable_memory_saver=False, v_head_dim=pool_config.v_head_dim)
        return sum(b.numel() * b.element_size() for b in pool.k_buffer + pool.v_buffer)

    return (total(16) - total(8)) // 8


def bytes_per_slot_by_kind(cfg: DSV4Config, pool_config, dtype: torch.dtype) -> dict[str, int]:
    """One slot's bytes split by what they hold (pool layer order: target layers, the streams layer, MTP layers);
    ``v_column`` is the one-column V buffer SGLang allocates per layer and nothing uses."""
    size = torch.empty((), dtype=dtype).element_size()
    kinds: dict[str, int] = {}

    def add(kind: str, cols: int) -> None:
        kinds[kind] = kinds.get(kind, 0) + cols * size

    for layout in model_layouts(cfg):
        for piece, (_, w) in layout.pieces.items():
            add(KIND_OF_PIECE[piece], w)
    add("mtp_input_streams", cfg.hc_mult * cfg.hidden_size)
    for layout in mtp_layouts(cfg):
        add("mtp_window_kv", layout.pieces["k"][1])
    add("v_column", pool_config.num_hidden_layers * pool_config.num_key_value_heads * pool_config.v_head_dim)
    return kinds


def upstream_estimate(cfg: DSV4Config, draft_tokens: int) -> dict[str, float]:
    """Upstream SGLang's V4 state with fp8 entries (see module doc): bytes per token and per running request."""
    types = [cfg.layer_type(i) for i in range(cfg.num_layers)]
    csa, hca = types.count(CSA), types.count(HCA)
    hca_ratio = max((r for r in cfg.compress_ratios if r and not cfg.is_csa_ratio(r)), default=1)
    entry = (cfg.head_dim - cfg.rope_dim) + 2 * cfg.rope_dim + 8
    index_key = cfg.index_head_dim + 4
    per_token = csa * (entry + index_key) / cfg.csa_ratio + hca * entry / hca_ratio
    swa_rows = (cfg.window + draft_tokens - 1) * entry * (cfg.num_layers + cfg.num_nextn_predict_layers)
    c4 = csa * 16 * 4 * (cfg.head_dim + cfg.index_head_dim) * 4
    c128 = hca * 256 * 2 * cfg.head_dim * 4
    return {"state_bytes_per_token": per_token, "state_bytes_per_request": swa_rows + c4 + c128}


def state_report(raw: dict, tokens: int, requests: int, draft_tokens: int, topk: int, steps: int,
                 context_len: int | None, dtype: torch.dtype) -> dict:
    """``raw``: the checkpoint's config.json; ``context_len`` None: the config's max positions."""
    cfg, pool_config = DSV4Config.from_dict(raw), sglang_config(raw)
    context_len = context_len or cfg.max_position_embeddings
    slope = measured_bytes_per_slot(cfg, pool_config, dtype)
    kinds = bytes_per_slot_by_kind(cfg, pool_config, dtype)
    if sum(kinds.values()) != slope:
        raise AssertionError(f"the split by kind ({sum(kinds.values())} B) is not the pool's slot ({slope} B)")
    scratch_slots = round_slots(draft_tokens, topk, steps)
    per_request = scratch_slots * slope + context_len * 4
    slots = tokens + requests * scratch_slots
    by_kind = {k: v * slots for k, v in kinds.items()}
    by_kind["req_to_token"] = requests * context_len * 4
    upstream = upstream_estimate(cfg, draft_tokens)
    return {
        "state_bytes_per_token": slope,
        "state_bytes_per_request": per_request,
        "state_bytes_by_kind": by_kind,
        "state_bytes": slope * tokens + per_request * requests,
        "state_tokens": tokens, "state_requests": requests, "draft_tree_slots_per_request": scratch_slots,
        "context_len": context_len, "kv_cache_dtype": str(dtype).removeprefix("torch."),
        "upstream_fp8_state_bytes_per_token": round(upstream["state_bytes_per_token"], 1),
        "upstream_fp8_state_bytes_per_request": round(upstream["state_bytes_per_request"]),
        "upstream_fp8_state_bytes": round(upstream["state_bytes_per_token"] * tokens
                                          + upstream["state_bytes_per_request"] * requests),
    }
