"""Per-slot storage of all attention state, and the per-query slot tables a forward reads it through.

Every piece of per-token state is one row per *token slot* per layer: the token's window key (V = K), for CSA its
compressor rows (kv and score, before the slot bias) and indexer-compressor rows, for HCA the running pooling
state of its block up to it (``hca_compressor``), and -- at the slot
of a token that closes a compression block, i.e. position ``t`` with ``(t + 1) % r == 0`` -- the compressed entry
it produced (for CSA also the index key). A layer's pieces are column ranges of its rows, in two kinds by how long
they are read: *window rows* (keys and compressor rows: only the last window of positions) and *token rows*
(entries: for ever). SGLang's hybrid sliding-window pool holds the two kinds (``sglang_pool``) and frees window
rows that fall out of the window; there the entries are kept one row per block instead of one per slot (pages
are whole blocks, see ``SlotStore``), with a scratch area for draft-tree nodes, and the compressor pieces read
only a few positions back (a CSA layer's rows: ``2r - 1``; an HCA layer's state: 1) in a third kind, *ring rows*:
a few per page of window rows.

Consequences (the reason for this layout):

* a forward writes only the rows of its queries' own output slots, so a draft-tree node's slot is its scratch and
  nothing committed changes during verification;
* the open compressor window of a request is just the rows at the positions of that window -- there is no
  separate per-request ring to refresh; after acceptance, copying the accepted nodes' rows into the canonical
  slots of their positions is the entire state refresh.

Slot tables: a query at position ``p`` must know the slot of every position ``<= p`` it reads (window keys,
compressor rows, entries). ``SlotTable`` expresses this as a per-request table (``req_table[b, pos]``, e.g.
SGLang's ``req_to_token``) for positions below a per-query ``base``, plus per-query ancestor slots for positions
``base .. p`` (``anc[i, pos - base]``). Prefill/decode use ``base = p + 1`` (everything from the request table);
a draft-tree node at depth ``d`` uses ``base = L`` and its path (root .. itself) as ``anc``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sgl_kernel_ext.gather_rows import gather_rows

from .config import CSA, HCA, SLIDING, DSV4Config
from .entry_codec import Fp8Codec, entry_codecs


@dataclass(frozen=True)
class LayerLayout:
    """Column layout of one layer's per-slot row: ``pieces[name] = (offset, width)``; a piece in ``codecs`` is kept
    as the codec's bytes (its width is ``nbytes``, its buffer uint8). ``dtype``: the buffer's own dtype where it
    must not follow the store's (an HCA layer's running pooling state stays fp32 in a bf16 pool)."""

    pieces: dict[str, tuple[int, int]]
    width: int
    codecs: dict[str, Fp8Codec] = field(default_factory=dict)
    dtype: torch.dtype | None = None

    @staticmethod
    def of(named_widths: list[tuple[str, int]], codecs: dict[str, Fp8Codec] | None = None,
           dtype: torch.dtype | None = None) -> "LayerLayout":
        codecs = {name: codecs[name] for name, _ in named_widths if name in (codecs or {})}
        if codecs and len(codecs) < len(named_widths):  # a coded row is a uint8 buffer: bytes only
            raise ValueError(f"pieces {[n for n, _ in named_widths]}: either all coded or none ({sorted(codecs)})")
        pieces, off = {}, 0
        for name, w in named_widths:
            w = codecs[name].nbytes if name in codecs else w
            pieces[name] = (off, w)
            off += w
        return LayerLayout(pieces, off, codecs, dtype)


def layer_layout(cfg: DSV4Config, layer_type: str) -> LayerLayout:
    """Window-row pieces (in row order), what only the last window of positions needs:

    * all layers: ``k`` (head_dim) -- normalised, rotated window key, also the value (in SGLang's pool with an
      ``entry_format`` as its bytes, ``paged_layouts``);
    * HCA: ``cstate`` (2*head_dim: ``[o | lse]``) -- the running pooling state of the position's block up to the
      position (``hca_compressor``), which is all a later position reads of it;
    * CSA: ``ckv``, ``cscore`` (2*head_dim each: ``[Ca | Cb]`` halves), ``ikv``, ``iscore`` (2*index_head_dim each).
    """
    hd, ihd = cfg.head_dim, cfg.index_head_dim
    if layer_type == SLIDING:
        return LayerLayout.of([("k", hd)])
    if layer_type == HCA:
        return LayerLayout.of([("k", hd), ("cstate", 2 * hd)])
    if layer_type == CSA:
        return LayerLayout.of([("k", hd), ("ckv", 2 * hd), ("cscore", 2 * hd), ("ikv", 2 * ihd), ("iscore", 2 * ihd)])
    raise ValueError(f"unknown layer type {layer_type!r}")


def token_layout(cfg: DSV4Config, layer_type: str, entry_format: str | None = None) -> LayerLayout:
    """Token-row pieces, what committed positions keep for ever: the entry a block-closing token computed
    (HCA, CSA: ``entry``, head_dim; CSA also ``ientry``, index_head_dim), valid only in a closing token's row;
    with an ``entry_format`` as its bytes (``entry_codecs``)."""
    codecs = entry_codecs(cfg, entry_format)
    if layer_type == SLIDING:
        return LayerLayout.of([])
    if layer_type == HCA:
        return LayerLayout.of([("entry", cfg.head_dim)], codecs)
    if layer_type == CSA:
        return LayerLayout.of([("entry", cfg.head_dim), ("ientry", cfg.index_head_dim)], codecs)
    raise ValueError(f"unknown layer type {layer_type!r}")


def model_layouts(cfg: DSV4Config) -> list[LayerLayout]:
    return [layer_layout(cfg, cfg.layer_type(i)) for i in range(cfg.num_layers)]


# Compressor pieces read only a few positions back: a CSA layer's rows (at most 2r - 1 back), an HCA layer's running
# state (1 back). Kept in ring rows (``SlotStore``).
RING_PIECES = ("ckv", "cscore", "ikv", "iscore", "cstate")
RING_READ_BACK = {CSA: lambda cfg: 2 * cfg.csa_ratio - 1, HCA: lambda cfg: 1}
STATE_DTYPE = torch.float32  # an HCA layer's running state: a log-sum-exp folded over up to 128 positions


def paged_layouts(cfg: DSV4Config, entry_format: str | None = None) -> tuple[list[LayerLayout], list[LayerLayout]]:
    """``model_layouts`` split in two: (window rows without the compressor pieces read only a few positions back,
    those pieces), the latter kept in ring rows -- a few per page in SGLang's paged pool (``SlotStore``'s
    ``ring_period``), a row per slot elsewhere -- with an HCA layer's state in ``STATE_DTYPE``. With an
    ``entry_format`` the window keys are its bytes."""
    window, ring = [], []
    codecs = entry_codecs(cfg, entry_format)
    for i, lay in enumerate(model_layouts(cfg)):
        kind = cfg.layer_type(i)
        in_ring = kind in RING_READ_BACK
        pieces = [(n, w) for n, (_, w) in lay.pieces.items()]
        window.append(LayerLayout.of([(n, w) for n, w in pieces if not (in_ring and n in RING_PIECES)], codecs))
        ring.append(LayerLayout.of([(n, w) for n, w in pieces if in_ring and n in RING_PIECES],
                                   dtype=STATE_DTYPE if kind == HCA else None))
    return window, ring


def ring_period(cfg: DSV4Config, page: int, draft_tokens: int) -> int:
    """Ring rows per page: the smallest divisor of ``page`` that holds the committed rows a query reads back (a
    CSA block-closing query: ``2r - 1`` positions; an HCA query: the previous position's state; under speculation
    the MTP's catch-up: the target's streams of at most ``draft_tokens`` positions, ``mtp_drafter``) together with
    the ``draft_tokens`` rows a verify forward writes after them, so that no node's row lands on a committed row
    still to be read. ``page`` itself (a row per slot) where nothing smaller does."""
    back = [RING_READ_BACK[t](cfg) for t in sorted({cfg.layer_type(i) for i in range(cfg.num_layers)})
            if t in RING_READ_BACK]
    need = max(back + [draft_tokens if draft_tokens > 1 else 0]) + max(draft_tokens, 1)
    return next(d for d in range(1, page + 1) if page % d == 0 and d >= min(need, page))


def model_token_layouts(cfg: DSV4Config, entry_format: str | None = None) -> list[LayerLayout]:
    return [token_layout(cfg, cfg.layer_type(i), entry_format) for i in range(cfg.num_layers)]


def mtp_layouts(cfg: DSV4Config) -> list[LayerLayout]:
    return [layer_layout(cfg, SLIDING) for _ in range(cfg.num_nextn_predict_layers)]


def streams_layouts(cfg: DSV4Config) -> list[LayerLayout]:
    """The last block's streams (before the HC head), the MTP's hidden input: a row per position (in SGLang's pool
    a ring row: the MTP reads them at most D positions back, ``ring_period``)."""
    return [LayerLayout.of([("h", cfg.hc_mult * cfg.hidden_size)])]


class SlotStore:
    """Per-layer state in two kinds of rows, both addressed by token slot; a piece lives in one of them:

    * **window rows** (``buffers``, ``layouts``): what only the last window of positions needs -- window keys and
      compressor rows (the MTP's window keys, the MTP's input streams). ``window_index`` (SGLang's full-to-SWA
      mapping) turns a token slot into its window row; None: the same index.
    * **token rows** (``token_buffers``, ``token_layouts``): what committed positions keep -- the entries, in the
      row of the token that closed their block.

    Token rows come in two layouts. Without ``entry_ratios`` one row per token slot (the entry in its block-closing
    token's row). With ``entry_ratios`` (SGLang's paged pool, page size a multiple of every ratio, so a slot's offset
    in its page is its position's): layer ``l`` of ratio ``r`` keeps one row per block, row ``slot // r`` of the
    block's closing token, followed by ``scratch_rows`` rows for the entries of draft-tree nodes that do not sit in
    their position's own slot. Such a node's entry slot is written ``-2 - q`` (``q``: its index in the verify
    forward, see ``ForwardBatch.entry_out`` and ``SlotTable.anc_entry``) and lands in scratch row ``q``; the
    accepted ones are copied to their canonical rows after acceptance (``commit_entries``).

    A piece with a codec (``LayerLayout.codecs``: fp8 entries, fp8 window keys) is kept as bytes in a uint8 buffer:
    ``write`` encodes, ``read`` decodes, ``readable`` hands the attention kernel decoded rows.

    ``window_scratch_rows`` window rows after the slots' (the MTP's draft-tree scratch, ``mtp_drafter``) are
    addressed by ``-2 - j`` for scratch row ``j``: a draft node's row that no slot owns and no step outlives.

    **Ring rows** (``ring_layouts``, ``ring_buffers``; SGLang's paged pool, ``paged_layouts``): a CSA layer's
    compressor rows are read at most ``2r - 1`` positions back and an HCA layer's state one position back (a ring
    layout may have its own dtype), so a page of window rows keeps only
    ``ring_period`` of them: window row ``w`` is ring row ``(w // page) * ring_period + w % ring_period``. A page's
    last ``ring_period`` positions stay (what the next page's first blocks and a radix match at the page's end read);
    a later position of the same page overwrites an earlier one, so a forward reads the rows it wrote itself from
    its own values (``Compressor``, ``HcaCompressor``) and writes only the last of those sharing a ring row
    (``ring_write_slots``).
    Without a ``ring_period`` ring rows are window rows (one per slot).

    ``view(layer, piece)`` is the piece's column range of its buffer; index it with ``index(layer, piece, slots)``.
    ``buffers`` may be supplied by the caller (views of an SGLang KV pool); otherwise zeros. Writes are in place
    unless autograd needs the written values (training), in which case the buffer is replaced out of place so
    gradients flow through later reads.
    """

    def __init__(self, layouts: list[LayerLayout], num_slots: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", buffers: list[torch.Tensor] | None = None,
                 token_layouts: list[LayerLayout] | None = None, token_buffers: list[torch.Tensor] | None = None,
                 window_index: torch.Tensor | None = None, entry_ratios: list[int] | None = None,
                 scratch_rows: int = 0, window_scratch_rows: int = 0,
                 ring_layouts: list[LayerLayout] | None = None, ring_buffers: list[torch.Tensor] | None = None,
                 ring_period: int | None = None, page: int | None = None):
        self.layouts = layouts
        self.token_layouts = token_layouts or [LayerLayout.of([]) for _ in layouts]
        self.ring_layouts = ring_layouts or [LayerLayout.of([]) for _ in layouts]
        self.ring_period, self.page = (ring_period, page) if ring_period and ring_period < (page or 0) else (None, None)
        self.num_slots = num_slots
        if buffers is None:
            buffers = [torch.zeros(num_slots + window_scratch_rows, lay.width,
                                   dtype=torch.uint8 if lay.codecs else dtype, device=device) for lay in layouts]
        # the store's own dtype and device: the given buffers' (a coded layer's are bytes)
        dt = next((b.dtype for b, lay in zip(buffers, layouts, strict=False) if not lay.codecs), dtype)
        dev = buffers[0].device if buffers else device
        if token_buffers is None:
            token_buffers = [torch.zeros(entry_layer_rows(num_slots, self._ratio_of(entry_ratios, i), scratch_rows),
                                         lay.width, dtype=torch.uint8 if lay.codecs else dt, device=dev)
                             for i, lay in enumerate(self.token_layouts)]
        if ring_buffers is None:
            rows = num_slots // page * ring_period if self.ring_period else (
                buffers[0].shape[0] - window_scratch_rows if buffers else num_slots)  # a row per window row
            ring_buffers = [torch.zeros(rows, lay.width, dtype=lay.dtype or dt, device=dev)
                            for lay in self.ring_layouts]
        for kind, bufs, lays in (("window", buffers, layouts), ("token", token_buffers, self.token_layouts),
                                 ("ring", ring_buffers, self.ring_layouts)):
            for i, (b, lay) in enumerate(zip(bufs, lays, strict=False)):
                if b.dim() != 2 or b.shape[1] != lay.width:
                    raise ValueError(f"layer {i}: {kind} buffer shape {tuple(b.shape)} != [rows, {lay.width}]")
        self.buffers = list(buffers)
        self.token_buffers = list(token_buffers)
        self.ring_buffers = list(ring_buffers)
        self.window_index = window_index
        self.window_scratch_rows = window_scratch_rows
        self.forward_memo: dict | None = None  # set by a forward for its duration (``_rows``)
        self.window_scratch_base = buffers[0].shape[0] - window_scratch_rows if buffers else 0
        self.entry_ratios = entry_ratios
        # First scratch row of each token layer (its committed rows: one per block of the slot range).
        self.scratch_base = [entry_layer_rows(num_slots, self._ratio(i), 0) for i in range(len(self.token_layouts))]

    @staticmethod
    def _ratio_of(entry_ratios: list[int] | None, layer: int) -> int:
        return entry_ratios[layer] if entry_ratios is not None else 0

    def _ratio(self, layer: int) -> int:
        """The block a token row of ``layer`` stands for: 0 (or 1) for one row per slot."""
        return self._ratio_of(self.entry_ratios, layer)

    def _where(self, layer: int, piece: str) -> tuple[list[torch.Tensor], int, int, str]:
        """(buffer list, column offset, width, kind of row: "window", "ring" or "token")."""
        window = self.layouts[layer].pieces.get(piece)
        if window is not None:
            return self.buffers, *window, "window"
        ring = self.ring_layouts[layer].pieces.get(piece)
        if ring is not None:
            return self.ring_buffers, *ring, "ring"
        return self.token_buffers, *self.token_layouts[layer].pieces[piece], "token"

    def _codec(self, layer: int, piece: str) -> Fp8Codec | None:
        kind = self._where(layer, piece)[3]
        layouts = {"window": self.layouts, "token": self.token_layouts, "ring": self.ring_layouts}[kind]
        return layouts[layer].codecs.get(piece)

    def _rows(self, layer: int, slots: torch.Tensor, kind: str) -> torch.Tensor:
        """Rows of ``slots`` in the buffers of ``kind``; within a forward (``forward_memo``, the forward's
        ``ForwardBatch.memo_``) computed once per slot tensor and layout, not once per layer and piece."""
        token = kind == "token"
        key = ("rows", kind, self._ratio(layer) if token else 0, self.scratch_base[layer] if token else 0)
        return self._per_forward(key, (slots,), lambda: self._compute_rows(layer, slots, kind))

    def _per_forward(self, key: tuple, inputs: tuple[torch.Tensor, ...], fn: Callable[[], torch.Tensor]):
        """``fn()`` once per forward (``forward_memo``) for these input tensors; every call outside a forward. The
        memo holds the inputs, so their ids are not reused while it lives."""
        memo = self.forward_memo
        if memo is None:
            return fn()
        full = key + tuple(id(t) for t in inputs)
        hit = memo.get(full)
        if hit is None or any(a is not b for a, b in zip(hit[0], inputs, strict=True)):
            hit = memo[full] = (inputs, fn())
        return hit[1]

    def _compute_rows(self, layer: int, slots: torch.Tensor, kind: str) -> torch.Tensor:
        if kind == "token":
            return self._token_rows(layer, slots)
        rows = self._window_rows(slots)
        if kind == "ring" and self.ring_period:
            rows = ring_rows(rows, self.page, self.ring_period)
        return rows

    def in_ring(self, layer: int, piece: str) -> bool:
        """Whether ``piece`` lives in ring rows (a forward must read its own rows of it from its own values)."""
        return self._where(layer, piece)[3] == "ring" and self.ring_period is not None

    def ring_write_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` a forward writes its ring rows at: those of a slot whose ring row a later position of the
        same forward (same page, ``ring_period`` on) also writes become 0 -- SGLang's padding slot, whose rows
        nothing reads -- so every ring row has one writer (the rows a forward wrote over are read from its own
        values, ``Compressor``)."""
        if self.ring_period is None:
            return slots
        later = slots + self.ring_period
        same_page = slots % self.page + self.ring_period < self.page
        return torch.where((slots > 0) & same_page & find(slots, later)[0], 0, slots)

    def _window_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Window rows of token ``slots`` (``-1`` stays ``-1``; ``-2 - j`` is window scratch row ``j``)."""
        rows = slots
        if self.window_index is not None:
            rows = torch.where(slots >= 0, self.window_index[slots.clamp(min=0)].to(slots.dtype), -1)
        if self.window_scratch_rows:
            rows = torch.where(slots <= -2, self.window_scratch_base - 2 - slots, rows)
        return rows

    def _token_rows(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Token rows of entry ``slots`` of ``layer`` (``-1`` stays ``-1``; ``-2 - q`` is scratch row ``q``)."""
        r = self._ratio(layer)
        if r <= 1:
            return slots
        return torch.where(slots >= 0, slots // r, torch.where(slots == -1, -1, self.scratch_base[layer] - 2 - slots))

    def index(self, layer: int, piece: str, slots: torch.Tensor) -> torch.Tensor:
        """Rows of ``view(layer, piece)`` holding token ``slots`` (``-1`` stays ``-1``)."""
        return self._rows(layer, slots, self._where(layer, piece)[3])

    def view(self, layer: int, piece: str) -> torch.Tensor:
        bufs, off, w, _ = self._where(layer, piece)
        return bufs[layer][:, off:off + w]

    def write_dtype(self, layer: int, piece: str) -> torch.dtype:
        """The dtype in which values of ``piece`` are best produced: the buffer's for a plain piece (written
        without a conversion), fp32 for a coded one (its codec encodes from fp32)."""
        return self.view(layer, piece).dtype if self._codec(layer, piece) is None else torch.float32

    def write(self, layer: int, piece: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        codec = self._codec(layer, piece)
        self._write_stored(layer, piece, slots, values if codec is None else codec.encode(values))

    def write_pieces(self, layer: int, pieces: tuple[str, ...], slots: torch.Tensor, values: torch.Tensor) -> None:
        """``write`` of several plain (not coded) pieces at the same slots, ``values`` holding their columns side
        by side in ``pieces`` order: one scatter where the pieces sit next to each other, in that order, in one
        buffer -- a CSA layer's four compressor pieces, produced by one fused projection -- else one per piece."""
        where = [self._where(layer, p) for p in pieces]
        if any(self._codec(layer, p) is not None for p in pieces):
            raise ValueError(f"write_pieces: {pieces} include a coded piece")
        widths = [w for _, _, w, _ in where]
        if values.shape[-1] != sum(widths):
            raise ValueError(f"pieces {pieces} are {sum(widths)} columns wide, values {values.shape[-1]}")
        bufs, off, _, kind = where[0]
        adjacent = all(b is bufs and k == kind and o == off + sum(widths[:i])
                       for i, (b, o, _, k) in enumerate(where))
        if not adjacent:
            for p, part in zip(pieces, values.split(widths, -1), strict=True):
                self._write_stored(layer, p, slots, part)
            return
        self._scatter(bufs, layer, self._rows(layer, slots, kind), off, off + sum(widths), values)

    def _write_stored(self, layer: int, piece: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Write what the buffer holds (a codec's bytes for a coded piece)."""
        bufs, off, w, kind = self._where(layer, piece)
        self._scatter(bufs, layer, self._rows(layer, slots, kind), off, off + w, values)

    @staticmethod
    def _scatter(bufs: list[torch.Tensor], layer: int, rows: torch.Tensor, start: int, end: int,
                 values: torch.Tensor) -> None:
        """``values`` into columns ``[start, end)`` of ``rows`` of ``bufs[layer]``: in place, or out of place where
        autograd needs the written values (the class doc)."""
        buf = bufs[layer]
        if values.requires_grad and torch.is_grad_enabled():
            cols = torch.arange(start, end, device=buf.device)
            bufs[layer] = buf.index_put((rows[:, None], cols[None, :]), values.to(buf.dtype))
        else:
            buf[rows, start:end] = values.to(buf.dtype)

    def write_kept(self, layer: int, piece: str, slots: torch.Tensor, values: torch.Tensor,
                   keep: torch.Tensor) -> None:
        """``write`` where ``keep``, with fixed shapes: the others leave what is stored as it was. With a token row
        per slot they write their row's own value back; with a row per block the row is shared with the block's
        other queries (whose write-back would race with the kept one), so they write to row 0 -- the block of
        SGLang's padding slot, never read -- instead."""
        codec = self._codec(layer, piece)
        stored = (values if codec is None else codec.encode(values)).to(self.view(layer, piece).dtype)
        if self._where(layer, piece)[3] != "token" or self._ratio(layer) <= 1:
            stored = torch.where(keep[:, None], stored, self._read_stored(layer, piece, slots))
        else:
            slots = self._kept_slots(slots, keep)
        self._write_stored(layer, piece, slots, stored)

    def _kept_slots(self, slots: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``slots`` where ``keep``, else 0; one tensor per (slots, keep) within a forward, so that its rows are
        mapped once (``_rows``)."""
        return self._per_forward(("kept",), (slots, keep), lambda: torch.where(keep, slots, 0))

    def read(self, layer: int, piece: str, slots: torch.Tensor) -> torch.Tensor:
        """Rows at ``slots`` (any shape); negative slots read as zeros (callers mask them). Coded pieces decoded."""
        got = self._read_stored(layer, piece, slots)
        codec = self._codec(layer, piece)
        return got if codec is None else codec.decode(got)

    def _read_stored(self, layer: int, piece: str, slots: torch.Tensor) -> torch.Tensor:
        bufs, off, w, kind = self._where(layer, piece)
        return gather_rows(bufs[layer], self._rows(layer, slots, kind), off, w)  # one kernel on a GPU

    def readable(self, layer: int, piece: str, rows: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A ``[S, width]`` tensor of ``dtype`` a kernel can read at rows ``rows [N, E]`` (from ``index``, ``-1``:
        none), and those rows in it: the piece's own columns, or for a coded piece its decoded rows (``[N*E]``,
        renumbered). Decoding only the rows a step reads keeps the entries' bytes as they are in the pool."""
        codec = self._codec(layer, piece)
        if codec is None:
            return self.view(layer, piece), rows
        got = codec.decode(self.view(layer, piece)[rows.clamp(min=0).reshape(-1)]).to(dtype)
        renumbered = torch.arange(rows.numel(), device=rows.device).view_as(rows)
        return got, torch.where(rows >= 0, renumbered, -1)

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole rows (every layer, every piece, window and token rows) ``src[i] -> dst[i]``: the
        accepted-token move, as SGLang's ``move_kv_cache`` does it. One token row per slot only (with
        ``entry_ratios`` the entries move by ``commit_entries``)."""
        if self.entry_ratios is not None:
            raise ValueError("copy_rows needs one token row per slot; this store keeps one per block")
        s, d = self._window_rows(src), self._window_rows(dst)
        for b in self.buffers:
            b[d] = b[s]
        s, d = self._rows(0, src, "ring"), self._rows(0, dst, "ring")
        for b in self.ring_buffers:
            b[d] = b[s]
        for b in self.token_buffers:
            b[dst] = b[src]

    def commit_entries(self, src: torch.Tensor, dst: torch.Tensor, positions: torch.Tensor) -> None:
        """Accepted-path refresh of the entries: copy the entry of entry slot ``src[i]`` (a scratch slot ``-2 - q``
        or a slot) to the canonical row of slot ``dst[i]``, where position ``positions[i]`` closes a block of the
        layer's ratio (``-1`` in ``src`` or ``dst``: nothing). Row 0 -- the block of SGLang's padding slot, never
        read -- takes the copies that are masked out, so shapes do not depend on the data."""
        for layer, buf in enumerate(self.token_buffers):
            r = self._ratio(layer)
            if r <= 1 or buf.shape[1] == 0:
                continue
            keep = ((positions + 1) % r == 0) & (src != -1) & (dst >= 0)
            s = torch.where(keep, self._token_rows(layer, src), 0)
            d = torch.where(keep, self._token_rows(layer, dst), 0)
            buf[d] = buf[s]

    def all_buffers(self) -> list[torch.Tensor]:
        """Window, token, then (where a layer has any) ring buffers."""
        return self.buffers + self.token_buffers + [b for b in self.ring_buffers if b.shape[1]]

    def rows(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """Window, token, then ring rows at ``slots``, every layer (copies), as ``all_buffers``."""
        w, r = self._window_rows(slots), self._rows(0, slots, "ring")
        return ([b[w].clone() for b in self.buffers]
                + [b[self._token_rows(i, slots)].clone() for i, b in enumerate(self.token_buffers)]
                + [b[r].clone() for b in self.ring_buffers if b.shape[1]])

    def checksum(self, slots: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Exact fingerprint per buffer (a float64 sum of the bit patterns), for isolation checks."""
        out = []
        for x in (self.all_buffers() if slots is None else self.rows(slots)):
            bits = x.contiguous().view(torch.int32).to(torch.float64) if x.dtype == torch.float32 else x.double()
            w = torch.arange(1, bits.numel() + 1, dtype=torch.float64, device=x.device).view_as(bits)
            out.append(torch.stack([bits.sum(), (bits * w).sum()]))
        return out


def ring_rows(window_rows: torch.Tensor, page: int, period: int) -> torch.Tensor:
    """Ring row of each window row (``SlotStore`` doc; ``-1`` stays ``-1``)."""
    return torch.where(window_rows >= 0, window_rows // page * period + window_rows % period, -1)


def find(values: torch.Tensor, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each of ``queries`` (any shape) is one of ``values`` (1-D), an index of it in ``values``), with
    fixed shapes (no host sync)."""
    if values.numel() == 0:
        return torch.zeros_like(queries, dtype=torch.bool), torch.zeros_like(queries)
    ordered, order = values.sort()
    at = torch.searchsorted(ordered, queries.contiguous()).clamp(max=values.numel() - 1)
    return ordered[at] == queries, order[at]


def entry_layer_rows(num_slots: int, ratio: int, scratch_rows: int) -> int:
    """Rows of a token layer: one per slot (``ratio`` 0 or 1), or one per block of ``ratio`` slots and then
    ``scratch_rows`` rows of draft-tree scratch (``SlotStore`` doc)."""
    if ratio <= 1:
        return num_slots
    return -(-num_slots // ratio) + scratch_rows


@dataclass
class SlotTable:
    """Per-query map from position to slot (see module doc).

    req_table: [B, T] long, slot of position ``t`` of request ``b`` (``-1`` where unknown).
    query_req: [N] long, row of ``req_table`` for each query.
    base:      [N] long, positions ``< base`` come from ``req_table``; positions ``>= base`` from ``anc``.
    anc:       [N, D] long, ``anc[i, j]`` = slot of position ``base[i] + j`` on query i's own path (D may be 0).
    anc_entry: [N, D] long or None, where the entries of those ancestors are (``SlotStore`` doc: a slot, or
               ``-2 - q`` for a draft node whose entry is in tree scratch); None: at their slots.
    offset:    [N] long or None, the position of ``req_table``'s first column for each query: a table of a few
               columns per request (a sliding-window layer's, ``mtp_drafter.window_table``) instead of the whole
               context's. Positions outside its columns are unknown (-1). None: column = position.
    """

    req_table: torch.Tensor
    query_req: torch.Tensor
    base: torch.Tensor
    anc: torch.Tensor
    anc_entry: torch.Tensor | None = None
    offset: torch.Tensor | None = None

    def lookup(self, pos: torch.Tensor, entries: bool = False) -> torch.Tensor:
        """Slots for positions ``pos [N, K]`` (each row belongs to query i); ``-1`` for negative positions.
        ``entries``: where the entries closed at those positions are (``anc_entry`` for ancestors)."""
        n, _ = pos.shape
        T = self.req_table.shape[1]
        rel = pos - self.base[:, None]
        if self.offset is None:
            from_req = self.req_table[self.query_req[:, None], pos.clamp(0, T - 1)]
        else:
            col = pos - self.offset[:, None]
            from_req = self.req_table[self.query_req[:, None], col.clamp(0, T - 1)]
            from_req = torch.where((col >= 0) & (col < T), from_req, -1)
        if self.anc.shape[1] > 0:
            anc = self.anc_entry if entries and self.anc_entry is not None else self.anc
            from_anc = anc.gather(1, rel.clamp(0, anc.shape[1] - 1))
            slots = torch.where(rel >= 0, from_anc, from_req)
        else:
            slots = from_req
        return torch.where(pos >= 0, slots, torch.full_like(slots, -1))

    @staticmethod
    def for_requests(req_table: torch.Tensor, query_req: torch.Tensor, positions: torch.Tensor) -> "SlotTable":
        """Prefill / chunked prefill / decode: every position up to the query's own is in ``req_table``."""
        return SlotTable(req_table, query_req, positions + 1,
                         torch.zeros(positions.shape[0], 0, dtype=torch.long, device=positions.device))


@dataclass(frozen=True)
class StepCaps:
    """Capacities that fix every shape of a forward, so that it needs no host synchronisation.

    Without caps a forward sizes its lists by the batch (``int(counts.max())``, ``nonzero`` on the block-closing
    queries): cheap, but each such read drains a GPU and makes shapes data-dependent, so the step cannot be captured.
    With caps every list has a width known before the step runs: a query may see at most ``max_context // r``
    entries of ratio ``r`` (fewer are masked), every query computes its would-be entry and only block-closing
    queries keep it. ``max_context`` is a startup capacity (SGLang's ``req_to_token`` width) or, where nothing is
    captured, a bucket of the batch's longest context known on the host (same code, smaller padding)."""

    max_context: int
    run: int | None = None  # most queries of one request in the forward (a verify step's D); None: all of them

    def entries(self, ratio: int) -> int:
        """Most entries of ratio ``ratio`` a query at position ``< max_context`` can see."""
        return self.max_context // ratio

    @staticmethod
    def bucket(longest: int, limit: int, run: int | None = None) -> "StepCaps":
        """The next power of two at or above ``longest`` (at least 64), at most ``limit``: few distinct shapes."""
        return StepCaps(min(max(64, 1 << max(int(longest) - 1, 0).bit_length()), limit), run)


@dataclass
class ForwardBatch:
    """N query tokens (any mix of requests: prefill chunks, decode tokens, draft-tree nodes).

    ``caps``: None sizes lists by the batch (eager); a ``StepCaps`` fixes every shape (no host sync, capturable)."""

    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    out_slots: torch.Tensor  # [N] long: the ONLY slot each query writes
    table: SlotTable
    caps: StepCaps | None = None
    entry_out: torch.Tensor | None = None  # [N] where each query's entry goes (``SlotStore`` doc); None: out_slots
    memo_: dict = field(default_factory=dict, repr=False)

    @property
    def entry_out_slots(self) -> torch.Tensor:
        return self.out_slots if self.entry_out is None else self.entry_out

    def entry_width(self, ratio: int) -> int:
        """Width of the per-query lists of compressed entries of ratio ``ratio``: the capacity with fixed shapes,
        otherwise the most entries any query of the batch can see (read back from the positions)."""
        if self.caps is not None:
            return self.caps.entries(ratio)
        return int(((self.positions + 1) // ratio).max()) if self.positions.numel() else 0

    def memo(self, key: Any, fn: Callable[[], Any]) -> Any:
        """Per-forward cache for what every layer would recompute identically (rope tables, window and entry
        slot lists, block-closing queries)."""
        if key not in self.memo_:
            self.memo_[key] = fn()
        return self.memo_[key]
