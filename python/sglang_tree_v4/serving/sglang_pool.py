"""Our state in SGLang's hybrid sliding-window KV pool: window rows for the last window of positions, one entry row
per compression block of every committed token range, each layer as wide as its own pieces.

Why: most per-token state is needed only for a window -- window keys (``window`` positions back), compressor rows
and states (a few positions back), the MTP's window keys (a window back) and input streams (D back). Only the
compressed entries are read for ever, one per ``r`` tokens. SGLang's hybrid SWA pool has the two lifetimes: every
token slot has a "full" slot, and an "SWA" row (a second index space reached through ``full_to_swa_index_mapping``)
that its scheduler frees once the position falls out of the window, while its radix cache keeps a cached prefix's
last window (and matches a prefix only where that window is still there). Allocation, eviction and the radix cache
are SGLang's; this module only names the layers and carves the buffers.

Compressor rows and states, streams: a CSA block-closing query reads its layer's compressor rows ``2r - 1 = 7``
positions back, an HCA query its layer's running state one position back (``hca_compressor``; fp32 whatever the
pool's dtype), the MTP's catch-up the target's streams at most D positions back (``mtp_drafter``: a prefill round
runs the MTP over its own streams), so the window sub-pool keeps them in ring buffers of ``ring_period`` rows per
page (16 of 128 at V4-Flash with D = 8, ``storage.ring_period``) beside the window layers: a page's ring rows
live and die with the page (radix cache and eviction included), its
last positions' rows stay for the next page and a radix match at its end, and the accepted-token move carries them.
At V4-Flash they were 107,520 (CSA), 40,960 (HCA rows) and 32,768 (streams) of a window row's 226,394 bytes.

Entries: SGLang's pages are whole blocks of every ratio (``state_page_size``), and a paged allocator puts position
``p`` of a request at an offset ``p mod page`` of one of its pages, so the block of a slot is ``slot // r`` and the
"full" half of the pool needs no per-token row at all: each compressed layer keeps one row per block of the slot
range -- a page of 128 tokens holds 32 CSA and one HCA entry at V4-Flash -- and, after them, the draft trees'
scratch rows (``scratch_rows``: running requests x D), where a draft node's entry goes unless the node sits in its
position's own slot (``sglang_model.tree_entry_slots``). SGLang's ``move_kv_cache`` moves window rows only; the
worker copies accepted entries out of the scratch. The MTP layers' window buffers likewise end in the draft trees'
MTP scratch (running requests x K (S - 1) rows, ``mtp_drafter``), so a round reserves only its D verify slots.

Pool layers (SGLang layer ids): first the window layers -- the target layers' window rows, the MTP layers' rows --
then one entry layer per compressed target layer (the ring buffers are the window sub-pool's own tensors). SGLang
gives every layer of a sub-pool the
same ``head_dim``; our pool class instead gives layer ``i`` its own width and rows (K buffers ``[rows, 1, width]``,
one-column V buffers per slot, which SGLang insists on and nothing uses). SGLang sizes the pool before building it,
from the config our override hands it: ``head_dim`` (full) is the entry columns per token (``sum width / r``) and
``swa_head_dim`` (window) the mean window width, each per layer and rounded up (``pool_head_dim``), so the tokens it
fits into a memory budget follow the real bytes. Window moves use SGLang's per-buffer native copy (its tiled GPU
copy takes the first buffer's row width for all of them). With ``--kv-cache-dtype fp8_e4m3`` the entry layers and
the target layers' window layers (their keys) are uint8 rows of upstream's fp8 bytes (``entry_codec``), counted in
those widths in columns of the model's dtype.
"""
from __future__ import annotations

import logging
import math

import torch

from ..dsv4.config import DSV4Config
from ..dsv4.mtp import draft_scratch_rows
from ..dsv4.storage import (
    entry_layer_rows,
    model_token_layouts,
    mtp_layouts,
    paged_layouts,
    ring_period,
    ring_rows,
    streams_layouts,
)

logger = logging.getLogger(__name__)
V_COLUMNS = 1  # the V buffer SGLang always allocates; nothing is stored in it
WINDOW_LABEL, TOKEN_LABEL = "SWA", "Full"  # SGLang's allocation labels of the two sub-pools


def window_layouts(cfg: DSV4Config, entry_format: str | None = None) -> list:
    """Window-row layers: the target layers (without their ring pieces; with an ``entry_format`` their keys as its
    bytes), the MTP layers (its keys in the pool's dtype: it only drafts)."""
    return paged_layouts(cfg, entry_format)[0] + mtp_layouts(cfg)


def window_layer_widths(cfg: DSV4Config) -> list[int]:
    """Width of each ``window_layouts`` layer in full precision."""
    return [lay.width for lay in window_layouts(cfg)]


def window_layer_columns(cfg: DSV4Config, entry_format: str | None, itemsize: int) -> list[float]:
    """``window_layer_widths`` in columns of a pool whose dtype has ``itemsize`` bytes."""
    return [lay.width / (itemsize if lay.codecs else 1) for lay in window_layouts(cfg, entry_format)]


def ring_layouts(cfg: DSV4Config) -> list:
    """Ring-row layouts: every target layer's (a CSA layer's compressor rows, an HCA layer's running state; empty
    for a sliding-window layer), then the MTP's input streams."""
    return paged_layouts(cfg)[1] + streams_layouts(cfg)


def ring_layer_widths(cfg: DSV4Config) -> list[int]:
    """Width of each ``ring_layouts`` buffer."""
    return [lay.width for lay in ring_layouts(cfg)]


def ring_layer_dtypes(cfg: DSV4Config) -> list[torch.dtype | None]:
    """Each ring buffer's own dtype (an HCA layer's state: fp32), None where it is the pool's."""
    return [lay.dtype for lay in ring_layouts(cfg)]


def ring_layer_columns(cfg: DSV4Config, itemsize: int) -> list[float]:
    """``ring_layer_widths`` in columns of a pool whose dtype has ``itemsize`` bytes."""
    return [w * (dt.itemsize / itemsize if dt is not None else 1)
            for w, dt in zip(ring_layer_widths(cfg), ring_layer_dtypes(cfg), strict=False)]


def swa_head_dim(cfg: DSV4Config, page: int, draft_tokens: int, itemsize: int,
                 entry_format: str | None = None) -> int:
    """The window sub-pool's ``head_dim`` SGLang sizes it with (``pool_head_dim``) for a pool dtype of ``itemsize``
    bytes: the window layers' mean width plus the ring rows' columns per window row (``ring_period / page`` of a
    row per ring buffer)."""
    window, ring = window_layer_columns(cfg, entry_format, itemsize), ring_layer_columns(cfg, itemsize)
    period = ring_period(cfg, page, draft_tokens)
    return pool_head_dim([w + (sum(ring) * period / page if i == 0 else 0) for i, w in enumerate(window)])


def token_layer_widths(cfg: DSV4Config, entry_format: str | None = None) -> list[int]:
    """Entry layers: one per compressed target layer (a model without any gets one 1-column layer, since
    SGLang's hybrid pool needs a full layer); with an ``entry_format`` in bytes."""
    return [lay.width for lay in model_token_layouts(cfg, entry_format) if lay.width] or [1]


def entry_ratios(cfg: DSV4Config) -> list[int]:
    """Compression ratio of every target layer (0: sliding window only), the ``SlotStore``'s ``entry_ratios``."""
    return [cfg.compress_ratios[i] or 0 for i in range(cfg.num_layers)]


def token_layer_ratios(cfg: DSV4Config) -> list[int]:
    """Ratio of each entry layer (the placeholder layer: 1, one row per slot)."""
    return [r for r, lay in zip(entry_ratios(cfg), model_token_layouts(cfg), strict=False) if lay.width] or [1]


def state_page_size(cfg: DSV4Config) -> int:
    """The smallest page that holds whole blocks of every ratio (SGLang's ``--page-size`` default for our model)."""
    return math.lcm(*[r for r in cfg.compress_ratios if r], 1)


def check_page_size(cfg: DSV4Config, page_size: int | None) -> int:
    """The page size to serve with: ``state_page_size`` if none was asked for, the asked one if it is a multiple."""
    need = state_page_size(cfg)
    if page_size is None:
        return need
    if page_size % need:
        raise ValueError(f"--page-size {page_size}: DeepSeek-V4's compressed entries need pages of whole blocks "
                         f"of every compression ratio ({sorted(set(r for r in cfg.compress_ratios if r))}), "
                         f"i.e. a multiple of {need}")
    return page_size


def token_columns_per_slot(cfg: DSV4Config, entry_format: str | None = None, itemsize: int = 1) -> list[float]:
    """Entry columns per token slot of each entry layer (width / ratio); with an ``entry_format`` its bytes in
    columns of a pool dtype of ``itemsize`` bytes (what SGLang sizes the pool in)."""
    size = itemsize if entry_format else 1
    return [w / r / size for w, r in zip(token_layer_widths(cfg, entry_format), token_layer_ratios(cfg), strict=False)]


def pool_head_dim(widths: list[float]) -> int:
    """The common ``head_dim`` SGLang sizes a sub-pool with: the mean columns per slot, rounded up."""
    return math.ceil(sum(widths) / len(widths))


TREE_V4 = "TREE_V4"  # the --speculative-algorithm our worker registers (``speculative.algorithm``)


def is_tree_v4(algorithm) -> bool:
    """Whether ``algorithm`` -- the flag as given (any case), or SGLang's algorithm object -- is TREE_V4."""
    return TREE_V4 in str(getattr(algorithm, "name", None) or algorithm or "").upper()


def tree_shape_of(server_args) -> dict[str, int] | None:
    """TREE_V4's resolved (D, K, S) as SGLang's flag names, None without TREE_V4. They come from SGLang's runtime
    context where it has them (its server arguments can still hold the user's unset values, e.g. no D for the
    adaptive budget)."""
    spec = server_args
    try:
        from sglang.srt.runtime_context import get_spec

        spec = get_spec()
    except Exception:  # no runtime context (a pool built outside a server)
        pass
    algorithm = getattr(spec, "speculative_algorithm", None) or getattr(server_args, "speculative_algorithm", None)
    if not is_tree_v4(algorithm):
        return None
    shape = {}
    for name in ("speculative_num_draft_tokens", "speculative_eagle_topk", "speculative_num_steps"):
        shape[name] = getattr(spec, name, None) or getattr(server_args, name, None)
        if not shape[name]:
            raise ValueError(f"TREE_V4's pool needs the resolved --{name.replace('_', '-')} to size its scratch")
    return shape


def verify_tokens_of(server_args) -> int:
    """Tokens a request's forward writes beyond its committed length: TREE_V4's D, else 1."""
    shape = tree_shape_of(server_args)
    return shape["speculative_num_draft_tokens"] if shape else 1


def scratch_rows_of(server_args, max_requests: int | None, dspark_block: int = 0) -> tuple[int, int]:
    """Tree scratch rows: per entry layer every running request's D draft nodes, per drafter layer its K (S - 1)
    MTP draft nodes past the root (``mtp_drafter``) or, with a DSpark drafter of block size ``dspark_block``, its
    block's rows (``speculative.dspark_drafter``); none without TREE_V4."""
    shape = tree_shape_of(server_args)
    if shape is None:
        return 0, 0
    requests = max_requests or server_args.max_running_requests or 0
    per_request = (dspark_block if dspark_block else
                   draft_scratch_rows(shape["speculative_eagle_topk"], shape["speculative_num_steps"]))
    return requests * shape["speculative_num_draft_tokens"], requests * per_request


def retained_window(cfg: DSV4Config) -> int:
    """Positions SGLang must keep in window rows (its ``sliding_window``), counted back from the newest committed
    position ``L`` (SGLang frees positions below ``L - sliding_window``, in whole pages): what a step reads below its
    first query. The target's window (a query at ``p >= L`` reads keys from ``p - window + 1``), a block-closing
    query's rows (from ``p - r + 1``), and the MTP's root draft (the query at ``L - 1`` reads its keys from
    ``L - window``; the catch-up queries before it are run for the rows they write, which depend on their own token
    and stream only, and their outputs are dropped). ``test_window_retention`` serves past freed rows against the
    model that frees nothing."""
    return max([cfg.window] + [r for r in cfg.compress_ratios if r])


def state_pool_class(window_widths: list[int], token_widths: list[int], token_ratios: list[int],
                     scratch_rows: int, entry_format: str | None = None,
                     window_scratch_rows: list[int] | None = None, ring_widths: list[int] | None = None,
                     ring_period_of=None, ring_dtypes: list[torch.dtype | None] | None = None,
                     window_coded: list[bool] | None = None) -> type:
    """A subclass of SGLang's ``MHATokenToKVPool`` (built with the same arguments as its own, once per sub-pool)
    whose layer ``i`` is ``widths[i]`` wide, the widths chosen by the sub-pool's allocation label; entry layer ``i``
    has a row per block of ``token_ratios[i]`` slots and then ``scratch_rows`` rows, window layer ``i`` a row per
    slot and then ``window_scratch_rows[i]`` (the MTP's draft scratch). The window sub-pool also keeps
    ``ring_buffers``, one per ``ring_layouts`` entry ``ring_widths[i]`` wide (of ``ring_dtypes[i]``, None: the
    pool's), of ``ring_period_of(page)`` rows per page (``ring_period``; ``storage.SlotStore``'s ring rows), moved
    with their window rows. With an ``entry_format``
    (fp8) the entry layers, and the window layers marked ``window_coded`` (the target layers' keys), are uint8 rows
    of the codec's bytes (their widths in bytes); the other window layers and the ring keep their dtypes."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
    from sglang.srt.mem_cache.memory_pool import KvBufferDesc, MHATokenToKVPool

    widths_of = {WINDOW_LABEL: tuple(window_widths), TOKEN_LABEL: tuple(token_widths)}

    class TreeV4StatePool(MHATokenToKVPool):
        def _create_buffers(self):
            if self.is_quantized_kv_cache or self.post_capture_active or self.kv_cache_layout != "nhd":
                raise ValueError("TREE_V4's DeepSeek-V4 state pool supports an unquantized, token-major KV cache "
                                 "only (--kv-cache-dtype auto/bfloat16/float32, or fp8_e4m3 for the entries; no "
                                 "post-capture backing)")
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
            slots = self.size + self.page_size  # slot 0 absorbs padded writes, as in SGLang's pool
            entries = self.allocation_label == TOKEN_LABEL
            if entries and any(self.page_size % r for r in token_ratios if r > 1):
                raise ValueError(f"--page-size {self.page_size} is not a multiple of every compression ratio "
                                 f"({sorted(set(token_ratios))})")
            rows = [entry_layer_rows(slots, r, scratch_rows) for r in token_ratios] if entries else (
                [slots + extra for extra in window_scratch_rows or [0] * len(widths)])
            if entries:
                logger.info("TREE_V4 entry rows: one per block of ratios %s over %d slots (pages of %d), plus %d "
                            "draft-tree scratch rows per layer; entries kept as %s", sorted(set(token_ratios)),
                            slots, self.page_size, scratch_rows, entry_format or self.store_dtype)
            elif any(window_scratch_rows or []):
                logger.info("TREE_V4 MTP draft scratch: %d window rows per MTP layer", max(window_scratch_rows))
            self.entry_format = entry_format
            coded = [bool(entry_format)] * len(widths) if entries else list(window_coded or [False] * len(widths))
            if not entries and any(coded):
                logger.info("TREE_V4 window keys kept as %s in %d of %d window layers", entry_format, sum(coded),
                            len(coded))
            ring = [] if entries else list(ring_widths or [])
            self.ring_period = ring_period_of(self.page_size) if any(ring) else None
            ring_rows = slots // self.page_size * self.ring_period if self.ring_period else 0
            if any(ring):
                logger.info("TREE_V4 ring rows (compressor rows and states, MTP input streams): %d per page of %d "
                            "window rows", self.ring_period, self.page_size)
            with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
                self.k_buffer = [torch.zeros((n, 1, w), dtype=torch.uint8 if c else self.store_dtype,
                                             device=self.device) for n, w, c in zip(rows, widths, coded, strict=False)]
                self.v_buffer = [torch.zeros((slots, 1, V_COLUMNS), dtype=self.store_dtype, device=self.device)
                                 for _ in widths]
                ring_dt = list(ring_dtypes or [None] * len(ring))
                self.ring_buffers = [torch.zeros((ring_rows, w), dtype=dt or self.store_dtype, device=self.device)
                                     for w, dt in zip(ring, ring_dt, strict=False)]
            self.use_native_move_kv_cache = True
            self._kv_buffer_descs = self._build_kv_buffer_descs()
            self._init_data_ptrs_and_strides()

        def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
            """Window rows (``tgt_loc``, ``src_loc``: window rows here) and their ring rows move with their slots;
            entry rows are per block, and the worker copies accepted entries out of the tree scratch itself
            (``commit_tree_entries``)."""
            if self.allocation_label == TOKEN_LABEL:
                return
            super().move_kv_cache(tgt_loc, src_loc)
            if self.ring_period:
                tgt, src = (ring_rows(loc.long(), self.page_size, self.ring_period) for loc in (tgt_loc, src_loc))
                for b in self.ring_buffers:
                    b[tgt] = b[src]

        def get_kv_size_bytes(self):
            k, v = super().get_kv_size_bytes()
            return k + sum(b.numel() * b.element_size() for b in getattr(self, "ring_buffers", [])), v

        def _build_kv_buffer_descs(self):
            return [KvBufferDesc(f"{prefix}{i}", tuple(b.shape), row_bytes=b[0].numel() * b.element_size(),
                                 tokens_per_row=1)
                    for prefix, bufs in (("k", self.k_buffer), ("v", self.v_buffer)) for i, b in enumerate(bufs)]

    return TreeV4StatePool


def model_state_pool_class(cfg: DSV4Config, scratch_rows: int = 0, entry_format: str | None = None,
                           mtp_scratch_rows: int = 0, verify_tokens: int = 1) -> type:
    """``scratch_rows`` per entry layer, ``mtp_scratch_rows`` per MTP layer (``scratch_rows_of``); ``verify_tokens``
    a request's forward writes past its committed length (``verify_tokens_of``) sizes the CSA ring."""
    mtp, window = len(mtp_layouts(cfg)), window_layouts(cfg, entry_format)
    scratch = [0] * (len(window) - mtp) + [mtp_scratch_rows] * mtp
    return state_pool_class([lay.width for lay in window], token_layer_widths(cfg, entry_format),
                            token_layer_ratios(cfg), scratch_rows, entry_format, scratch, ring_layer_widths(cfg),
                            lambda page: ring_period(cfg, page, verify_tokens), ring_layer_dtypes(cfg),
                            [bool(lay.codecs) for lay in window])
