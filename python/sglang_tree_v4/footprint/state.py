"""The attention state our server holds per token and per running request, and what upstream SGLang would hold.

Why: at V4-Flash shapes the state decides how many tokens a GPU can serve. Our state lives in SGLang's hybrid
sliding-window pool (``serving.sglang_pool``): per token slot, its share of the entry rows (one row per block of
``r`` slots in each compressed layer, plus SGLang's one-column V buffer per layer) -- the *token* bytes -- and a
*window row* per position of each request's last window (keys, the MTP's keys, and its share of the ring --
CSA compressor rows, HCA running states, the MTP's input streams: ``ring_period`` rows per page of window rows), plus
the draft trees' scratch (D entry rows per running request in each compressed layer, K (S - 1) rows in each MTP
layer). This module measures them the way the server allocates them -- the pool class the server builds, with the
arguments SGLang derives from the config our model override hands it (``sglang_config``), at two sizes and with
and without scratch, so the slopes are the pool's real bytes and not a formula -- and splits them into kinds from
our layouts (the split must add up to the measured bytes).

Per token: its share of the entry rows. Per running request: the window rows it holds (``window_rows_held``), plus
the verify slots the worker reserves beyond the committed length (D), its last page's unused slots (at most
``page - 1``), its D rows of entry scratch and K (S - 1) rows of MTP scratch, and one ``req_to_token`` row (int32
per position of the context length). SGLang provisions the window rows as ``--swa-full-tokens-ratio`` x the token
slots; the report gives the rows the running requests need.

Upstream's figures come from its V4 layout on a GPU, as SGLang 0.5.23's code allocates it (read, not run; its
``mem_cache/deepseek_v4_memory_pool.py``, ``deepseek_v4_compress_state.py``, ``model_executor/pool_configurator.py``):
per token fp8 entries of ``head_dim - rope`` e4m3 bytes + bf16 rope + 8 scale bytes and CSA index keys of
``index_head_dim`` e4m3 bytes + a 4-byte scale, one entry per ``r`` tokens; per running request the window in
SGLang's paged SWA pool, owned by the radix cache as ours (pages of 256 tokens, so a request holds up to 511
positions plus its draft tokens), each position one fp8 key per layer and MTP layer and, per 256-token page, the
fp32 CSA compressor state of 16 positions (main and indexer, under speculation), and a per-request fp32 HCA
compressor ring of 256 rows (under speculation), plus the ``req_to_token`` row. They are a formula, stated as such.
"""

from __future__ import annotations

import torch

from ..dsv4.config import CSA, HCA, DSV4Config
from ..dsv4.dspark import block_size_of
from ..dsv4.mtp import draft_scratch_rows
from ..dsv4.storage import model_token_layouts, mtp_layouts, paged_layouts, ring_period
from ..serving.sglang_pool import (
    TOKEN_LABEL,
    WINDOW_LABEL,
    entry_ratios,
    model_state_pool_class,
    retained_window,
    ring_layouts,
    state_page_size,
    token_layer_widths,
)
from ..speculative.model_override import sglang_config

KIND_OF_PIECE = {"k": "window_kv", "ckv": "compressor_rows", "cscore": "compressor_rows",
                 "ikv": "compressor_rows", "iscore": "compressor_rows", "cstate": "compressor_rows",
                 "h": "mtp_input_streams", "entry": "compressed_entries",
                 "ientry": "compressed_entries"}
# --kv-cache-dtype -> (the pool's dtype, None: the model's; how entries are kept, None: in the pool's dtype)
KV_CACHE_DTYPES = {"auto": (None, None), "bfloat16": (torch.bfloat16, None), "bf16": (torch.bfloat16, None),
                   "float32": (torch.float32, None), "fp8_e4m3": (None, "fp8_e4m3")}


def measured_bytes_per_row(cfg: DSV4Config, pool_config, dtype: torch.dtype,
                           entry_format: str | None = None, verify_tokens: int = 1) -> dict[str, float]:
    """Bytes of the pool the server builds (``serving.sglang_pool``, with the arguments SGLang passes from
    ``pool_config``, at its page size), from real allocations: ``{"token": per token slot, "window": per window
    row (with its share of the CSA compressor ring, sized for ``verify_tokens``), "scratch": per draft-node entry
    scratch row, "mtp_scratch": per MTP draft scratch row}``."""
    page = state_page_size(cfg)
    pattern = pool_config.hybrid_layer_pattern
    heads = pool_config.num_key_value_heads

    def total(label: str, layers: int, head_dim: int, slots: int, scratch: int = 0, mtp_scratch: int = 0) -> int:
        pool = model_state_pool_class(cfg, scratch, entry_format, mtp_scratch, verify_tokens)(
            size=slots, page_size=page, dtype=dtype, head_num=heads, head_dim=head_dim, layer_num=layers,
            device="cpu", enable_memory_saver=False, allocation_label=label)
        return sum(pool.get_kv_size_bytes())

    out = {}
    for kind, label, layers, hd in (("token", TOKEN_LABEL, pattern.count(0), pool_config.head_dim),
                                    ("window", WINDOW_LABEL, pattern.count(1), pool_config.swa_head_dim)):
        out[kind] = (total(label, layers, hd, 16 * page) - total(label, layers, hd, 8 * page)) / (8 * page)
    hd = pool_config.head_dim
    out["scratch"] = (total(TOKEN_LABEL, pattern.count(0), hd, 8 * page, 4)
                      - total(TOKEN_LABEL, pattern.count(0), hd, 8 * page)) / 4
    hd = pool_config.swa_head_dim
    out["mtp_scratch"] = (total(WINDOW_LABEL, pattern.count(1), hd, 8 * page, mtp_scratch=4)
                          - total(WINDOW_LABEL, pattern.count(1), hd, 8 * page)) / 4
    return out


def bytes_per_row_by_kind(cfg: DSV4Config, pool_config, dtype: torch.dtype, entry_format: str | None = None,
                          verify_tokens: int = 1) -> dict[str, dict[str, float]]:
    """A token slot's and a window row's bytes split by what they hold; ``v_column`` is the one-column V buffer
    SGLang allocates per layer and nothing uses. Coded (fp8) entries count their bytes; the CSA compressor ring
    counts ``ring_period / page`` of a row per window row."""
    size = torch.empty((), dtype=dtype).element_size()
    kinds: dict[str, dict[str, int]] = {"token": {}, "window": {}}

    def add(row: str, kind: str, cols: float, itemsize: int | None = None) -> None:
        kinds[row][kind] = kinds[row].get(kind, 0) + cols * (itemsize or size)

    page = state_page_size(cfg)
    for layout in paged_layouts(cfg, entry_format)[0]:
        for piece, (_, w) in layout.pieces.items():
            add("window", KIND_OF_PIECE[piece], w, 1 if piece in layout.codecs else None)
    share = ring_period(cfg, page, verify_tokens) / page
    for layout in ring_layouts(cfg):  # the pool's ring buffers: compressor rows and states, the MTP's streams
        for piece, (_, w) in layout.pieces.items():
            add("window", KIND_OF_PIECE[piece], w * share, layout.dtype.itemsize if layout.dtype else None)
    for layout, r in zip(model_token_layouts(cfg, entry_format), entry_ratios(cfg), strict=False):
        for piece, (_, w) in layout.pieces.items():  # only compressed layers (ratio > 1) have pieces
            add("token", KIND_OF_PIECE[piece], w / r / (size if piece in layout.codecs else 1))
    for layout in mtp_layouts(cfg):
        add("window", "mtp_window_kv", layout.pieces["k"][1])
    pattern = pool_config.hybrid_layer_pattern
    add("window", "v_column", pattern.count(1) * pool_config.num_key_value_heads * pool_config.swa_v_head_dim)
    add("token", "v_column", pattern.count(0) * pool_config.num_key_value_heads * pool_config.v_head_dim)
    pieces = sum(lay.width for lay in model_token_layouts(cfg, entry_format))
    if sum(token_layer_widths(cfg, entry_format)) > pieces:  # the placeholder layer of a model without any
        add("token", "placeholder", sum(token_layer_widths(cfg, entry_format)) - pieces)
    return kinds


def window_rows_held(cfg: DSV4Config) -> int:
    """Most committed positions whose window rows a running request of our pool holds (``swa_positions_held``)."""
    return swa_positions_held(retained_window(cfg), state_page_size(cfg))


def swa_positions_held(window: int, page: int) -> int:
    """Most committed positions whose rows SGLang's paged SWA pool keeps for a running request that must keep
    ``window``. SGLang frees a request's window rows once at least ``SGLANG_SWA_EVICTION_INTERVAL`` of them are
    ``window`` behind the newest, down to whole pages and keeping ``max(window, page)`` rounded up to whole pages
    (so a radix match at a page boundary still has its window): just before a free that is ``window + interval``
    positions, just after one up to that rounded window plus a page."""
    from sglang.srt.environ import envs

    kept = -(-max(window, page) // page) * page
    return max(window + max(1, envs.SGLANG_SWA_EVICTION_INTERVAL.get()), kept + page - 1)


UPSTREAM_PAGE = 256  # upstream's V4 page size on a GPU (its paged SWA pool requires it)
UPSTREAM_SPEC_RINGS = {"csa": 16, "hca": 256}  # compressor state positions kept under speculation
UPSTREAM_FP32_STATE = 4  # bytes per compressor-state value (upstream keeps them in fp32)


def upstream_estimate(cfg: DSV4Config, draft_tokens: int, context_len: int) -> dict[str, float]:
    """Upstream SGLang's V4 state with fp8 entries (see module doc): bytes per token and per running request."""
    types = [cfg.layer_type(i) for i in range(cfg.num_layers)]
    csa, hca = types.count(CSA), types.count(HCA)
    hca_ratio = max((r for r in cfg.compress_ratios if r and not cfg.is_csa_ratio(r)), default=1)
    entry = (cfg.head_dim - cfg.rope_dim) + 2 * cfg.rope_dim + 8
    index_key = cfg.index_head_dim + 4
    per_token = csa * (entry + index_key) / cfg.csa_ratio + hca * entry / hca_ratio
    page, rings = UPSTREAM_PAGE, UPSTREAM_SPEC_RINGS
    swa_positions = swa_positions_held(cfg.window, page) + draft_tokens
    csa_state = 2 * 2 * (cfg.head_dim + cfg.index_head_dim) * UPSTREAM_FP32_STATE  # overlap: 2 halves, kv + score
    per_position = (entry * (cfg.num_layers + cfg.num_nextn_predict_layers)
                    + rings["csa"] / page * csa_state * csa)
    hca_state = hca * rings["hca"] * 2 * cfg.head_dim * UPSTREAM_FP32_STATE
    return {"state_bytes_per_token": per_token,
            "state_bytes_per_request": swa_positions * per_position + hca_state + context_len * 4}


def state_report(raw: dict, tokens: int, requests: int, draft_tokens: int, topk: int, steps: int,
                 context_len: int | None, dtype: torch.dtype, entry_format: str | None = None) -> dict:
    """``raw``: the checkpoint's config.json; ``context_len`` None: the config's max positions; ``dtype``: the
    pool's; ``entry_format``: fp8 entries (``--kv-cache-dtype fp8_e4m3``)."""
    cfg, pool_config = DSV4Config.from_dict(raw), sglang_config(raw, entry_format, dtype.itemsize)
    context_len = context_len or cfg.max_position_embeddings
    row = measured_bytes_per_row(cfg, pool_config, dtype, entry_format, draft_tokens)
    kinds = bytes_per_row_by_kind(cfg, pool_config, dtype, entry_format, draft_tokens)
    for kind in ("token", "window"):
        if abs(sum(kinds[kind].values()) - row[kind]) > 1e-6:
            raise AssertionError(f"the split of a {kind} row ({sum(kinds[kind].values())} B) is not the pool's "
                                 f"({row[kind]} B)")
    entry_row = sum(token_layer_widths(cfg, entry_format)) * (1 if entry_format else dtype.itemsize)
    if row["scratch"] != entry_row:
        raise AssertionError(f"a scratch row ({row['scratch']} B) is not one entry row of every layer ({entry_row} B)")
    page = state_page_size(cfg)
    tree_slots = draft_tokens  # the verify block (the MTP drafts into its own scratch rows)
    # The drafter's scratch: K (S - 1) MTP draft rows, or a DSpark block's rows (its stage keys take the MTP
    # layers' place, one per stage: ``DSV4Config.from_dict``).
    dspark_block = block_size_of(raw)
    mtp_scratch = (dspark_block or draft_scratch_rows(topk, steps)) * row["mtp_scratch"]
    window_rows = window_rows_held(cfg) + tree_slots
    token_slots = tree_slots + page - 1  # beyond its committed tokens: the reservation and its last page's tail
    per_request = (window_rows * row["window"] + token_slots * row["token"] + draft_tokens * row["scratch"]
                   + mtp_scratch + context_len * 4)
    by_kind: dict[str, float] = {}
    for kind, count in (("token", tokens + requests * token_slots), ("window", requests * window_rows)):
        for name, b in kinds[kind].items():
            by_kind[name] = by_kind.get(name, 0) + b * count
    by_kind["tree_scratch"] = requests * (draft_tokens * row["scratch"] + mtp_scratch)
    by_kind["req_to_token"] = requests * context_len * 4
    by_kind = {k: round(v) for k, v in by_kind.items()}
    upstream = upstream_estimate(cfg, draft_tokens, context_len)
    return {
        "state_bytes_per_token": row["token"],
        "state_bytes_per_request": round(per_request),
        "state_bytes_by_kind": by_kind,
        "state_bytes": round(row["token"] * tokens + per_request * requests),
        "state_tokens": tokens, "state_requests": requests, "draft_tree_slots_per_request": tree_slots,
        "page_size": page, "tree_scratch_bytes_per_request": draft_tokens * row["scratch"] + mtp_scratch,
        "drafter": "dspark" if dspark_block else "mtp",
        "drafter_state_bytes_per_request": round(window_rows * kinds["window"].get("mtp_window_kv", 0) + mtp_scratch),
        "window_rows_per_request": window_rows, "window_row_bytes": row["window"],
        "context_len": context_len, "kv_cache_dtype": entry_format or str(dtype).removeprefix("torch."),
        "window_dtype": str(dtype).removeprefix("torch."),
        "upstream_fp8_state_bytes_per_token": round(upstream["state_bytes_per_token"], 1),
        "upstream_fp8_state_bytes_per_request": round(upstream["state_bytes_per_request"]),
        "upstream_fp8_state_bytes": round(upstream["state_bytes_per_token"] * tokens
                                          + upstream["state_bytes_per_request"] * requests),
    }
