"""Token-level KV compression (CSA and HCA), over per-slot rows.

Each token projects the attention input to a kv row and a score row (``wkv``, ``wgate``) and stores them in its
own slot. A block of ``r`` positions ``[r*e, r*e + r)`` is *closed* by its last token ``t = r*e + r - 1``; that
token computes entry ``e`` and stores it in its own slot:

* HCA (non-overlapping, any ratio r): per channel, softmax over the r window slots of ``score + ape[j]``, weighted
  sum of kv -- computed as a running state instead of from stored rows (``hca_compressor.HcaCompressor``, on the
  same ``CompressorWeights``).
* CSA (ratio 4, overlapping): rows are ``2*d`` wide, ``[Ca | Cb]``. Entry e pools 2r slots per channel: the
  previous block's Ca halves (with ``ape[j, :d]``) and its own block's Cb halves (with ``ape[j, d:]``). For e = 0
  the previous block does not exist (weight 0).

Then RMSNorm (``norm``) and RoPE (compress table) at position ``r*e``. The rows of the window are gathered through
the closing query's slot table, so for a draft-tree node they are its ancestors' rows -- the only thing that makes
siblings' versions of the same entry differ -- and for positions before the tree the committed rows. Where the
rows live in a ring of a few per page (``SlotStore``, SGLang's pool), a longer prefill chunk overwrites its own
earlier rows, so the rows a forward wrote itself are taken from its own values (cast to the store's dtype: the
same numbers a later forward reads back).
"""
from __future__ import annotations

import torch
from torch import nn

from sgl_kernel_ext import ops
from sgl_kernel_ext.indexer import indexer_scores

from .norm import RMSNorm
from .rope import Rope
from .storage import ForwardBatch, SlotStore, find


class CompressorWeights(nn.Module):
    """What a compressor learns (the checkpoint's ``wkv``, ``wgate``, ``ape``, ``norm``): rows ``2 * d`` wide where
    blocks overlap (CSA), ``d`` where they do not (HCA)."""

    def __init__(self, dim_in: int, d: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        self.d, self.ratio = d, ratio
        width = 2 * d if overlap else d
        self.wkv = nn.Linear(dim_in, width, bias=False)
        self.wgate = nn.Linear(dim_in, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, width))
        self.norm = RMSNorm(d, eps)

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``[kv, score]`` rows of the input (where ``checkpoint.fuse`` has not stacked them into the attention's
        one projection)."""
        return [self.wkv(x), self.wgate(x)]


class Compressor(CompressorWeights):
    """An overlapping (CSA) compressor: rows stored per position, entries pooled from them when a block closes."""

    def __init__(self, dim_in: int, d: int, ratio: int, eps: float):
        super().__init__(dim_in, d, ratio, True, eps)
        self.register_buffer("pooled_ape", None)  # ``pool_ape()``, stored so by ``checkpoint.fuse``

    def pool_ape(self) -> torch.Tensor:
        """``[2r, d]``: the position biases in the order the pooling reads its window -- the previous block's
        ``Ca`` halves, then its own block's ``Cb`` halves."""
        d = self.d
        return torch.cat([self.ape[:, :d], self.ape[:, d:]], dim=0)

    def close_blocks(self, fb: ForwardBatch, store: SlotStore, layer: int, rope: Rope, kv: str, score: str,
                     entry: str, own: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Compute and store the entries of the queries that close a block (rows already written; ``own``: this
        forward's own ``(kv, score)`` rows, ``Attention._write_csa_rows``)."""
        r, d = self.ratio, self.d
        span = 2 * r
        closers, slots, closes = fb.memo(("closers", r, span), lambda: _closer_rows(fb, r, span))
        if closers.numel() == 0:
            return
        # slots 0..r-1: previous block's Ca halves; r..2r-1: own block's Cb halves; RoPE at the entry's first
        # position. The same in every layer of the forward: computed once.
        col_off, cos, sin = fb.memo(("closer_consts", r, span, d, id(rope)), lambda: (
            torch.arange(2 * r, device=closers.device).ge(r).long() * d,  # no host-to-device copy
            *rope.cos_sin(((fb.positions[closers] + 1) // r - 1) * r)))
        ape = self.pooled_ape if self.pooled_ape is not None else self.pool_ape()
        # Gated pooling + RMSNorm + RoPE in fp32: the kernel on a GPU, its torch reference here.
        if store.in_ring(layer, kv):
            kv_src, score_src, rows = _own_or_stored(fb, store, layer, (kv, score), slots, own, span)
        else:
            kv_src, score_src = store.view(layer, kv), store.view(layer, score)
            rows = fb.memo(("closer_rows", r, span), lambda: store.index(layer, kv, slots))
        ent = ops.compress_entries(kv_src, score_src, rows, col_off, ape,
                                   self.norm.weight, self.norm.eps, cos, sin,
                                   out_dtype=store.write_dtype(layer, entry))
        out = fb.memo(("closer_out", r, span), lambda: fb.entry_out_slots[closers])  # one tensor: rows mapped once
        if closes is not None:  # fixed shapes: every query pooled its window; only block-closers keep the entry
            store.write_kept(layer, entry, out, ent, closes)
        else:
            store.write(layer, entry, out, ent)


def _own_or_stored(fb: ForwardBatch, store: SlotStore, layer: int, pieces: tuple[str, str], slots: torch.Tensor,
                   own: tuple[torch.Tensor, torch.Tensor], span: int):
    """The closers' window rows of ``pieces`` gathered into ``[Nc * span, width]`` tensors (a row written by this
    forward from its own values, any other from the store) and their rows in them (``-1``: none)."""
    hit, query, rows = fb.memo(("own_rows", span), lambda: _own_rows(fb.out_slots, slots))
    gathered = []
    for piece, values in zip(pieces, own, strict=False):
        stored = store.read(layer, piece, slots)
        gathered.append(torch.where(hit[..., None], values.to(stored.dtype)[query], stored).flatten(0, 1))
    return gathered[0], gathered[1], rows


def _own_rows(out_slots: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per forward (the same for every layer): which closer window slots this forward wrote, the query that wrote
    each, and the rows of the gathered ``[Nc * span, width]`` tensors (``-1``: no position)."""
    hit, query = find(out_slots, slots)
    rows = torch.where(slots >= 0, torch.arange(slots.numel(), device=slots.device).view_as(slots), -1)
    return hit & (slots >= 0), query, rows


def _closer_rows(fb: ForwardBatch, r: int,
                 span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Queries closing a block of ratio r, the slots of their window's ``span`` positions (ascending), and None.
    With fixed shapes (``fb.caps``): every query, its window's slots, and which of them close a block."""
    closes = (fb.positions + 1) % r == 0
    if fb.caps is not None:
        closers = torch.arange(fb.positions.shape[0], device=closes.device)
    else:
        closers, closes = closes.nonzero().squeeze(1), None
    p = fb.positions[closers]
    pos = p[:, None] - torch.arange(span - 1, -1, -1, device=p.device)
    t = fb.table
    sub = type(t)(t.req_table, t.query_req[closers], t.base[closers], t.anc[closers],
                  offset=None if t.offset is None else t.offset[closers])
    return closers, sub.lookup(pos), closes


INDEXER_CHUNK_ELEMENTS = 1 << 22  # scores (fp32) and entry rows (int64) of one chunk: 16 + 32 MiB


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: its own overlapping ratio-4 compressor at ``index_head_dim`` produces
    index keys; query t scores ``sum_h w_{t,h} * ReLU(q_{t,h} . K_e) / sqrt(ihd)`` over exactly the entries it may
    see (``e < (t+1) // 4``, resolved through its slot table) and keeps the top ``index_topk``."""

    def __init__(self, dim_in: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, eps: float):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(dim_in, n_heads, bias=False)
        self.compressor = Compressor(dim_in, head_dim, 4, eps)

    def select(self, w: torch.Tensor, q_res: torch.Tensor, fb: ForwardBatch, store: SlotStore, layer: int,
               rope: Rope, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (entry indices [N, k], their scores [N, k]: ``-inf`` exactly where a selection is not valid, past the
        query's visible count, see ``selected_rows``); ``w``: the queries' head weights (``weights_proj`` of the
        attention input; scaled by n_heads ** -0.5 in fp32 inside the scores op); k = min(index_topk, max visible
        count in the batch, or the capacity ``fb.caps.entries(4)`` with fixed shapes).

        The scores are one ``indexer_scores`` op per chunk of ``chunk_entries(N)`` entries (one chunk for a decode
        or a draft tree up to long contexts), with a running top-k across chunks, so the temporaries are bounded by
        the chunk, not by the context."""
        n = w.shape[0]
        emax = fb.entry_width(4)
        if emax == 0:
            z = torch.zeros(n, 0, dtype=torch.long, device=w.device)
            return z, z.float()
        k = min(self.topk, emax)
        q = self.wq_b(q_res).view(n, self.n_heads, self.head_dim)
        q = rope.rotate(q, cos[:, None], sin[:, None])
        best_score = best_idx = None
        step = self.chunk_entries(n)
        for e0 in range(0, emax, step):
            cand = self.candidates(fb, e0, step)
            rows = self.candidate_rows(fb, store, layer, e0, step, cand)
            keys, rows = store.readable(layer, "ientry", rows, q.dtype)
            score = indexer_scores(q, w, keys, rows, self.head_dim ** -0.5, self.n_heads ** -0.5)
            if best_score is None:
                best_score, best_idx = score, cand
            else:
                best_score, best_idx = torch.cat([best_score, score], 1), torch.cat([best_idx, cand], 1)
            if best_score.shape[1] > k:
                top = best_score.topk(k, dim=-1)
                # the first chunk's candidates are 0, 1, ...: their picks are the top-k's own indices
                picked = top.indices if best_idx is cand and e0 == 0 else best_idx.gather(1, top.indices)
                best_score, best_idx = top.values, picked
        return best_idx, best_score

    @staticmethod
    def candidates(fb: ForwardBatch, e0: int, step: int) -> torch.Tensor:
        """Entry numbers ``e0 .. e0 + step`` (up to the width ``fb.entry_width(4)``) for every query: ``[N, C]``,
        the same in every CSA layer of the forward."""
        n, emax = fb.positions.shape[0], fb.entry_width(4)
        return fb.memo(("index_cand", e0, step), lambda: torch.arange(
            e0, min(e0 + step, emax), device=fb.positions.device).expand(n, -1))

    @staticmethod
    def candidate_rows(fb: ForwardBatch, store: SlotStore, layer: int, e0: int, step: int,
                       cand: torch.Tensor) -> torch.Tensor:
        """Token rows of the entries ``cand`` (a chunk from entry ``e0``; ``-1`` past a query's visible count).
        The same in every CSA layer of the forward (one layout; the index keys and the entries share a row): looked
        up once."""
        def look():
            visible = cand < ((fb.positions + 1) // 4)[:, None]
            return store.index(layer, "ientry", torch.where(visible, fb.table.lookup(cand * 4 + 3, entries=True), -1))

        return fb.memo(("index_rows", e0, step, store.scratch_base[layer]), look)

    def selected_rows(self, fb: ForwardBatch, store: SlotStore, layer: int,
                      idx: torch.Tensor) -> torch.Tensor | None:
        """Token rows of the selected entries ``idx`` (``-1`` where not valid), gathered from the candidates' rows
        where one chunk held every candidate; None otherwise. A selection is not valid exactly where its candidate
        has no row (past the query's visible count: row ``-1``, score ``-inf``), so the gathered rows are already
        ``-1`` there and validity needs no pass of its own."""
        emax = fb.entry_width(4)
        step = self.chunk_entries(fb.positions.shape[0])
        if emax == 0 or emax > step:
            return None
        rows = self.candidate_rows(fb, store, layer, 0, step, self.candidates(fb, 0, step))
        return rows.gather(1, idx)

    def chunk_entries(self, n_queries: int) -> int:
        """Entries scored at once: about ``INDEXER_CHUNK_ELEMENTS`` scores."""
        return max(64, INDEXER_CHUNK_ELEMENTS // max(n_queries, 1))
