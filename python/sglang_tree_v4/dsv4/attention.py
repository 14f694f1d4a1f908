"""V4 attention: one formulation for every layer type and every kind of forward.

Query i at position p attends, with one softmax that also includes a learned per-head sink logit:

* the window keys of positions ``[p - W + 1, p]`` (K = V, one shared head), resolved through its slot table;
* CSA/HCA layers: compressed entries ``e < (p + 1) // r`` read from where the tokens at positions ``r*e + r - 1``
  put them (``SlotStore``) -- all of them for HCA, the indexer's top-k of them for CSA.

Before reading, every query writes its own key and compressor rows (an HCA layer: its running pooling state,
``hca_compressor``) to its own slot, then block-closing queries write their entries: that order lets queries of
one forward (a prefill chunk, a draft tree) read each other through their tables. The attention output's rope
slice is rotated back by -p (V carried the key rotation), then the grouped low-rank output projection: heads in
``o_groups`` groups, each projected to ``o_lora_rank`` (wo_a), concatenated, projected to hidden (wo_b).
"""
from __future__ import annotations

import torch
from torch import nn

from sgl_kernel_ext import ops
from sgl_kernel_ext.fp8_linear import fp8_block_linear
from sgl_kernel_ext.weight_formats import FP8_BLOCK, FP8_DTYPE

from .compressor import Compressor, Indexer
from .config import CSA, HCA, SLIDING, DSV4Config
from .hca_compressor import HcaCompressor
from .norm import RMSNorm
from .rope import Rope
from .storage import ForwardBatch, SlotStore

CSA_ROW_PIECES = ("ckv", "cscore", "ikv", "iscore")  # in ``storage.layer_layout``'s order


class Attention(nn.Module):
    def __init__(self, cfg: DSV4Config, ratio: int):
        """``ratio``: 0 = sliding window only, 4 = CSA, anything else = HCA with that ratio."""
        super().__init__()
        layer_type = SLIDING if ratio == 0 else (CSA if cfg.is_csa_ratio(ratio) else HCA)
        D, H, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.cfg, self.layer_type = cfg, layer_type
        # Heads and output groups held here: all of them, or one rank's share once ``tp`` has sharded the layer.
        self.n_heads, self.o_groups = H, cfg.o_groups
        self.head_dim, self.window, self.eps = hd, cfg.window, cfg.rms_norm_eps
        self.wq_a = nn.Linear(D, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, H * hd, bias=False)
        self.wkv = nn.Linear(D, hd, bias=False)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(H * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, D, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        self.compressor: Compressor | HcaCompressor | None = None
        self.indexer: Indexer | None = None
        self.ratio = ratio
        if layer_type == HCA:
            self.compressor = HcaCompressor(D, hd, self.ratio, cfg.rms_norm_eps)
        elif layer_type == CSA:
            self.compressor = Compressor(D, hd, self.ratio, cfg.rms_norm_eps)
        if layer_type == CSA:
            self.indexer = Indexer(D, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk,
                                   cfg.rms_norm_eps)
        # Set by ``checkpoint.fuse`` once the weights are loaded: ``wq_a`` + ``wkv``, and the compressors' (and the
        # indexer's head weights') projections, each as one matmul.
        self.q_kv_a: nn.Module | None = None
        self.compress_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor, fb: ForwardBatch, store: SlotStore, layer: int, rope: Rope) -> torch.Tensor:
        n, H, hd, W = x.shape[0], self.n_heads, self.head_dim, self.window
        cos, sin = fb.memo(("rope", id(rope)), lambda: rope.cos_sin(fb.positions))
        if self.q_kv_a is not None:
            q_a, kv_a = self.q_kv_a(x).split(self.q_kv_a.widths, -1)
        else:
            q_a, kv_a = self.wq_a(x), self.wkv(x)
        q_res = self.q_norm(q_a)
        q = rope.norm_rotate(self.wq_b(q_res).view(n, H, hd), None, self.eps, cos[:, None], sin[:, None])
        k = rope.norm_rotate(kv_a, self.kv_norm.weight, self.kv_norm.eps, cos, sin)

        # 1) own rows only: the key, the compressor rows or state; 2) then the entries of block-closing queries
        store.write(layer, "k", fb.out_slots, k)
        head_w = None
        if self.layer_type == HCA:
            self.compressor.update(self._compressor_rows(x)[1], fb, store, layer, rope)
        if self.indexer is not None:
            own, own_index, head_w = self._write_csa_rows(x, fb, store, layer)
            self.compressor.close_blocks(fb, store, layer, rope, "ckv", "cscore", "entry", own)
            self.indexer.compressor.close_blocks(fb, store, layer, rope, "ikv", "iscore", "ientry", own_index)
        # 3) gather what each query sees (slot lists are the same for every layer: computed once per forward)
        win_slots = fb.memo(("window", W), lambda: fb.table.lookup(
            fb.positions[:, None] - torch.arange(W - 1, -1, -1, device=x.device)))
        win_rows = fb.memo(("window_rows", W), lambda: store.index(layer, "k", win_slots))
        ent_store = ent_slots = None
        if self.compressor is not None:
            r = self.ratio
            if self.indexer is not None:  # CSA: only the selected entries' slots are looked up
                idx, score = self.indexer.select(head_w, q_res, fb, store, layer, rope, cos, sin)
                ent_rows = self.indexer.selected_rows(fb, store, layer, idx)  # the scored candidates' rows
                if ent_rows is None:  # scored in several chunks: looked up now
                    ok = score > float("-inf")
                    ent_rows = store.index(layer, "entry",
                                           torch.where(ok, fb.table.lookup(idx * r + r - 1, entries=True), -1))
            else:  # HCA: every visible entry (one per 128 positions); the same rows in every HCA layer
                ent_rows = fb.memo(("entry_rows", r, store.scratch_base[layer]),
                                   lambda: store.index(layer, "entry", _entry_slots(fb, r)))
            ent_store, ent_slots = store.readable(layer, "entry", ent_rows, q.dtype)
        # One softmax with the sink over window keys and entries: the kernel on a GPU, its torch reference here.
        k_store, k_rows = store.readable(layer, "k", win_rows, q.dtype)  # fp8 keys: the rows read, decoded
        o = ops.tree_sparse_attention(q, k_store, k_rows, ent_store, ent_slots,
                                      self.attn_sink.to(q.dtype), hd ** -0.5)
        o = rope.rotate(o, cos[:, None], sin[:, None], inverse=True)
        return self.wo_b(self._grouped_wo_a(o.reshape(n, self.o_groups, H * hd // self.o_groups)))

    def _compressor_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The compressors' rows ``[kv, score]`` (CSA: then the indexer compressor's, then the indexer's head
        weights) and, where ``checkpoint.fuse`` stacked their weights into one matmul, that matmul's output (the
        parts are its column slices; None otherwise)."""
        if self.compress_proj is not None:
            y = self.compress_proj(x)
            return y, list(y.split(self.compress_proj.widths, -1))
        parts = self.compressor.project(x)
        if self.indexer is not None:
            parts += [*self.indexer.compressor.project(x), self.indexer.weights_proj(x)]
        return None, parts

    def _write_csa_rows(self, x: torch.Tensor, fb: ForwardBatch, store: SlotStore, layer: int):
        """Store every query's four CSA compressor pieces (one scatter when fused: the projection's columns are
        the row's); returns the two compressors' own ``(kv, score)`` rows and the indexer's head weights."""
        y, (ckv, cscore, ikv, iscore, head_w) = self._compressor_rows(x)
        slots = fb.out_slots
        if store.in_ring(layer, "ckv"):
            slots = fb.memo("ring_out", lambda: store.ring_write_slots(fb.out_slots))
        if y is not None:
            store.write_pieces(layer, CSA_ROW_PIECES, slots, y[:, : y.shape[1] - head_w.shape[1]])
        else:
            for piece, rows in zip(CSA_ROW_PIECES, (ckv, cscore, ikv, iscore), strict=True):
                store.write(layer, piece, slots, rows)
        return (ckv, cscore), (ikv, iscore), head_w

    def _grouped_wo_a(self, o: torch.Tensor) -> torch.Tensor:
        """``[n, g, H*hd/g]`` -> ``[n, g * o_lora_rank]``: group i through rows ``i*R .. (i+1)*R`` of ``wo_a``. An
        FP8 ``wo_a`` goes group by group through the FP8 linear (its block scales at the group's row offset), so
        no dequantised copy of the weight is ever written."""
        g = o.shape[1]
        w = self.wo_a.weight
        if w.dtype != FP8_DTYPE:
            return torch.einsum("ngd,grd->ngr", o, w.to(o.dtype).view(g, -1, o.shape[2])).flatten(1)
        rows = w.shape[0] // g
        off_r, off_c = getattr(self.wo_a, "offsets", (0, 0))
        outs = []
        for i in range(g):
            r0 = off_r + i * rows
            outs.append(fp8_block_linear(o[:, i], w[i * rows:(i + 1) * rows], self.wo_a.scale[r0 // FP8_BLOCK:],
                                         (r0 % FP8_BLOCK, off_c)))
        return torch.cat(outs, 1)


def _entry_slots(fb: ForwardBatch, r: int) -> torch.Tensor:
    """[N, E] slots of entries e < (p+1)//r (position r*e + r - 1), -1 beyond each query's count."""
    counts = (fb.positions + 1) // r
    emax = fb.entry_width(r)
    e = torch.arange(emax, device=fb.positions.device).expand(len(counts), emax)
    return torch.where(e < counts[:, None], fb.table.lookup(e * r + r - 1, entries=True), -1)
