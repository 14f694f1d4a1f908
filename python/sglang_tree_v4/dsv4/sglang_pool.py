"""SGLang's KV pool with each layer as wide as its own per-slot row (and no more).

Why: ``MHATokenToKVPool`` gives every layer the same ``head_dim``. Our per-slot rows (``storage``) differ by layer
kind -- a sliding layer needs one key, a CSA layer its key, four compressor rows and two entries, the streams layer
``hc_mult * hidden_size`` -- so one common width pads every layer to the widest (at V4-Flash the MTP's 16,384-wide
input streams: 81 % of each slot was padding). This pool keeps SGLang's allocator, radix cache, accepted-token move
and memory accounting, and only carves the buffers: layer ``i``'s K buffer is ``[slots, 1, widths[i]]``, every V
buffer one column (V4 has V = K; SGLang insists on a V buffer).

SGLang sizes the pool before building it, from the config our override hands it (``num_hidden_layers`` x
``(head_dim + v_head_dim)`` per slot). ``pool_head_dim`` picks the ``head_dim`` whose product covers these widths
with less than one column per layer to spare, so the number of tokens SGLang fits into a memory budget follows
the real bytes. Moves use SGLang's per-buffer native copy (its tiled GPU copy takes the first buffer's row width
for all of them).
"""
from __future__ import annotations

import math

import torch

from .config import DSV4Config
from .storage import model_layouts, mtp_layouts

V_COLUMNS = 1  # the V buffer SGLang always allocates; nothing is stored in it


def pool_layer_widths(cfg: DSV4Config) -> list[int]:
    """Per pool layer (SGLang's layer ids): the target layers' rows, the streams layer (the last block's streams,
    the MTP's input), then the MTP layers' rows."""
    return ([lay.width for lay in model_layouts(cfg)] + [cfg.hc_mult * cfg.hidden_size]
            + [lay.width for lay in mtp_layouts(cfg)])


def pool_head_dim(widths: list[int]) -> int:
    """The common ``head_dim`` SGLang sizes the pool with: the mean width, rounded up."""
    return math.ceil(sum(widths) / len(widths))


def state_pool_class(widths: list[int]) -> type:
    """A subclass of SGLang's ``MHATokenToKVPool`` whose layer ``i`` is ``widths[i]`` wide (SGLang builds it with
    the same arguments as its own pool)."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
    from sglang.srt.mem_cache.memory_pool import KvBufferDesc, MHATokenToKVPool

    class TreeV4StatePool(MHATokenToKVPool):
        layer_widths = tuple(widths)

        def _create_buffers(self):
            if self.is_quantized_kv_cache or self.post_capture_active or self.kv_cache_layout != "nhd":
                raise ValueError("TREE_V4's DeepSeek-V4 state pool supports an unquantized, token-major KV cache "
                                 "only (--kv-cache-dtype auto/bfloat16/float32, no post-capture backing)")
            if self.layer_num != len(self.layer_widths) or self.head_num != 1:
                raise ValueError(f"the pool was asked for {self.layer_num} layers x {self.head_num} heads; our model "
                                 f"needs {len(self.layer_widths)} layers x 1 head")
            for name in ("k_scale_buffer", "v_scale_buffer", "native_k_scale_buffer", "native_v_scale_buffer",
                         "dq_k_buffer", "dq_v_buffer"):
                setattr(self, name, None)
            rows = self.size + self.page_size  # slot 0 absorbs padded writes, as in SGLang's pool
            with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
                self.k_buffer = [torch.zeros((rows, 1, w), dtype=self.store_dtype, device=self.device)
                                 for w in self.layer_widths]
                self.v_buffer = [torch.zeros((rows, 1, self.v_head_dim), dtype=self.store_dtype, device=self.device)
                                 for _ in self.layer_widths]
            self.use_native_move_kv_cache = True
            self._kv_buffer_descs = self._build_kv_buffer_descs()
            self._init_data_ptrs_and_strides()

        def _build_kv_buffer_descs(self):
            size = self.store_dtype.itemsize
            return [KvBufferDesc(f"{prefix}{i}", tuple(b.shape), row_bytes=b[0].numel() * size, tokens_per_row=1)
                    for prefix, bufs in (("k", self.k_buffer), ("v", self.v_buffer)) for i, b in enumerate(bufs)]

    return TreeV4StatePool
