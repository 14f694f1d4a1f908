"""Our state in SGLang's hybrid sliding-window KV pool: window rows for the last window of positions, token rows for
every committed token, each layer as wide as its own pieces.

Why: most per-token state is needed only for a window -- window keys (``window`` positions back), compressor rows
(one block back), the MTP's window keys and input streams (its catch-up reads at most a window back). Only the
compressed entries are read for ever, and they sit in the rows of block-closing tokens. SGLang's hybrid SWA pool
has exactly these two lifetimes: every token slot has a "full" row, and an "SWA" row (a second index space reached
through ``full_to_swa_index_mapping``) that its scheduler frees once the position falls out of the window, while
its radix cache keeps a cached prefix's last window (and matches a prefix only where that window is still there).
Allocation, eviction, the radix cache and the accepted-token move (``move_kv_cache`` moves both rows) are
SGLang's; this module only names the layers and carves the buffers.

Pool layers (SGLang layer ids): first the window layers -- the target layers' window rows, the streams row, the
MTP layers' rows -- then one token layer per compressed target layer. SGLang gives every layer of a sub-pool the
same ``head_dim``; our pool class instead gives layer ``i`` its own width (``[slots, 1, width]`` K buffers,
one-column V buffers, which SGLang insists on and nothing uses). SGLang sizes the pool before building it, from
the config our override hands it: ``head_dim`` (full) and ``swa_head_dim`` (window) are the mean widths rounded up
(``pool_head_dim``), so the tokens it fits into a memory budget follow the real bytes. Moves use SGLang's
per-buffer native copy (its tiled GPU copy takes the first buffer's row width for all of them).
"""
from __future__ import annotations

import math

import torch

from .config import DSV4Config
from .storage import model_layouts, model_token_layouts, mtp_layouts, streams_layouts

V_COLUMNS = 1  # the V buffer SGLang always allocates; nothing is stored in it
WINDOW_LABEL, TOKEN_LABEL = "SWA", "Full"  # SGLang's allocation labels of the two sub-pools


def window_layer_widths(cfg: DSV4Config) -> list[int]:
    """Window-row layers: the target layers, the streams, the MTP layers."""
    return [lay.width for lay in model_layouts(cfg) + streams_layouts(cfg) + mtp_layouts(cfg)]


def token_layer_widths(cfg: DSV4Config) -> list[int]:
    """Token-row layers: one per compressed target layer (a model without any gets one 1-column layer, since
    SGLang's hybrid pool needs a full layer)."""
    return [lay.width for lay in model_token_layouts(cfg) if lay.width] or [1]


def pool_head_dim(widths: list[int]) -> int:
    """The common ``head_dim`` SGLang sizes a sub-pool with: the mean width, rounded up."""
    return math.ceil(sum(widths) / len(widths))


def retained_window(cfg: DSV4Config) -> int:
    """Positions back from the newest that SGLang must keep in window rows (its ``sliding_window``): the window,
    the longest compression block (a block-closing query pools rows ``r - 1`` back), the MTP catch-up (a window
    back), plus one for the token being decoded."""
    return max([cfg.window] + [r for r in cfg.compress_ratios if r]) + 1


def state_pool_class(window_widths: list[int], token_widths: list[int]) -> type:
    """A subclass of SGLang's ``MHATokenToKVPool`` (built with the same arguments as its own, once per sub-pool)
    whose layer ``i`` is ``widths[i]`` wide, the widths chosen by the sub-pool's allocation label."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
    from sglang.srt.mem_cache.memory_pool import KvBufferDesc, MHATokenToKVPool

    widths_of = {WINDOW_LABEL: tuple(window_widths), TOKEN_LABEL: tuple(token_widths)}

    class TreeV4StatePool(MHATokenToKVPool):
        def _create_buffers(self):
            if self.is_quantized_kv_cache or self.post_capture_active or self.kv_cache_layout != "nhd":
                raise ValueError("TREE_V4's DeepSeek-V4 state pool supports an unquantized, token-major KV cache "
                                 "only (--kv-cache-dtype auto/bfloat16/float32, no post-capture backing)")
            widths = widths_of.get(self.allocation_label)
            if widths is None:
                raise ValueError("sglang-tree-v4's DeepSeek-V4 keeps its state in SGLang's hybrid sliding-window "
                                 "KV pool, and SGLang is building a plain one: drop --disable-hybrid-swa-memory")
            if self.layer_num != len(widths) or self.head_num != 1:
                raise ValueError(f"the {self.allocation_label} pool was asked for {self.layer_num} layers x "
                                 f"{self.head_num} heads; our model needs the hybrid pool's {WINDOW_LABEL} "
                                 f"{len(window_widths)} and {TOKEN_LABEL} {len(token_widths)} layers x 1 head")
            for name in ("k_scale_buffer", "v_scale_buffer", "native_k_scale_buffer", "native_v_scale_buffer",
                         "dq_k_buffer", "dq_v_buffer"):
                setattr(self, name, None)
            rows = self.size + self.page_size  # slot 0 absorbs padded writes, as in SGLang's pool
            with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
                self.k_buffer = [torch.zeros((rows, 1, w), dtype=self.store_dtype, device=self.device)
                                 for w in widths]
                self.v_buffer = [torch.zeros((rows, 1, V_COLUMNS), dtype=self.store_dtype, device=self.device)
                                 for _ in widths]
            self.use_native_move_kv_cache = True
            self._kv_buffer_descs = self._build_kv_buffer_descs()
            self._init_data_ptrs_and_strides()

        def _build_kv_buffer_descs(self):
            size = self.store_dtype.itemsize
            return [KvBufferDesc(f"{prefix}{i}", tuple(b.shape), row_bytes=b[0].numel() * size, tokens_per_row=1)
                    for prefix, bufs in (("k", self.k_buffer), ("v", self.v_buffer)) for i, b in enumerate(bufs)]

    return TreeV4StatePool


def model_state_pool_class(cfg: DSV4Config) -> type:
    return state_pool_class(window_layer_widths(cfg), token_layer_widths(cfg))
