"""HCA compression as a running state, one fold per position.

An HCA entry pools a block of ``r`` positions (128 at V4-Flash) per channel: ``sum_j softmax_j(s_j) v_j`` with
``s_j = score_j + ape[j]``. Pooling the stored rows when the block closes needs every row since the block's start,
i.e. a block's worth of ``[kv | score]`` rows per request (10.8 of the 36.2 MB a running request held at V4-Flash).
The same sum can be carried along as a state ``[o | lse]`` (the pooled value so far and the log-sum-exp of the
logits so far), folded one position at a time:

    lse' = logaddexp(lse, s),    o' = o * exp(lse - lse') + v * exp(s - lse');    a block's first position: (v, s)

Position ``p`` stores its state; position ``p + 1`` reads only that one, so the committed state a forward reads is
one position back and lives in a few ring rows per page (``storage.RING_READ_BACK``). The closing position's ``o``,
RMS-normalised and rotated at the block's first position, is the entry. The fold itself is
``sgl_kernel_ext.hca_fold``'s (one kernel on a GPU).

Why a strict order of folds: the entry must be bit for bit the same whichever forward computed it -- a prefill
chunk, a decode step, a draft-tree node on the accepted path -- or the tree's tokens could drift from the
non-speculative server's. Every state is therefore ``fold(state of the previous position, own row)``, never a
regrouped sum. Within one forward the previous position may be another query of the same forward (a prefill
chunk, a node's parent): the states are solved by repeated sweeps, each one folding every query onto the current
value of its predecessor, until the longest chain inside a block is done (``iterations``); every sweep is the same
elementwise arithmetic, so the final values are those of the one-by-one folds.
"""
from __future__ import annotations

import math

import torch

from sgl_kernel_ext.hca_fold import hca_fold

from .compressor import CompressorWeights
from .rope import Rope
from .storage import ForwardBatch, SlotStore, find


class HcaCompressor(CompressorWeights):
    """The HCA layer's compressor: ``CompressorWeights`` (non-overlapping), the pooling as a running state (module
    doc)."""

    def __init__(self, dim_in: int, d: int, ratio: int, eps: float):
        super().__init__(dim_in, d, ratio, False, eps)
        self.register_buffer("ape_f32", None)  # ``ape`` in fp32, stored so by ``checkpoint.fuse``

    def update(self, rows: list[torch.Tensor], fb: ForwardBatch, store: SlotStore, layer: int, rope: Rope,
               state: str = "cstate", entry: str = "entry") -> None:
        """Every query's state into its own slot, then block-closing queries' entries; ``rows``: the queries'
        ``[kv, score]`` projections (``Attention._compressor_rows``)."""
        r, d = self.ratio, self.d
        p = fb.positions
        # Per forward, not per layer (the same tensors in every HCA layer, so their slot rows are mapped once too).
        phase, start, closes = fb.memo(("hca_phases", r), lambda: (p % r, p % r == 0, (p + 1) % r == 0))
        ape = self.ape_f32 if self.ape_f32 is not None else self.ape.float()
        v = rows[0].float()
        s = ape[phase] + rows[1]  # promoted to fp32 in the add: the same values as rows[1].float() + ape
        pred, hit, query = fb.memo("hca_predecessors", lambda: _predecessors(fb))
        stored = store.read(layer, state, pred).float()  # read before this forward writes any ring row
        n = p.shape[0]
        v, s, start, hit, query, stored = _whole_vectors((v, s, start, hit, query, stored), d)
        sweeps = fb.memo(("hca_iterations", r), lambda: iterations(fb, r))
        states = hca_fold(v, s, start, hit, query, stored, sweeps)[:n]  # [o | lse]: the folds, one kernel on a GPU
        o = states[:, :d]
        slots = fb.out_slots
        if store.in_ring(layer, state):
            slots = fb.memo("ring_out", lambda: store.ring_write_slots(fb.out_slots))
        store.write(layer, state, slots, states)

        if fb.caps is None:  # eager: only the block-closing queries
            closers = closes.nonzero().squeeze(1)
            if closers.numel() == 0:
                return
            o, p = o[closers], p[closers]
        m = o.shape[0]  # the [rows, 1] rsqrt and the RoPE's cos/sin of p must run whole vectors too
        o, p = _whole_vectors((o, p), 1)
        # RoPE at the entry's first position: the same in every HCA layer of the forward. o is fp32: the whole norm
        # is (the weight promoted).
        cos, sin = fb.memo(("hca_entry_rope", r, p.shape[0], id(rope)), lambda: rope.cos_sin(p + 1 - r))
        y = rope.norm_rotate(o, self.norm.weight, self.norm.eps, cos, sin)[:m]
        if fb.caps is None:
            store.write(layer, entry, fb.entry_out_slots[closers], y)
        else:  # fixed shapes: every query computed its would-be entry; only block-closers keep it
            store.write_kept(layer, entry, fb.entry_out_slots, y, closes)


# Elements of a fold's tensors a CPU's elementwise loop takes in whole vectors: ATen runs two vectors per iteration
# (32 float32 with AVX-512) and the remainder through the scalar functions, whose exp differs from the vector one
# in the last bit now and then. A position's state would then depend on where its row fell in the forward (in
# the whole vectors of a 27-row prefill, in the tail of a 1-row decode): 2 of 432 elements differed on an AVX-512
# CPU. Padding every fold to a multiple of this many elements keeps each element on the vector path in every
# split (on a GPU every element runs the same code anyway, and at V4-Flash's 512 channels no padding is needed).
VECTOR_ELEMENTS = 64


def _whole_vectors(tensors: tuple[torch.Tensor, ...], width: int) -> tuple[torch.Tensor, ...]:
    """On the CPU, each tensor with zero rows appended until ``[rows, width]`` is a whole multiple of
    ``VECTOR_ELEMENTS`` (elsewhere as they are). A padded fold row reads no other row (``hit`` False) and folds
    zeros onto a zero state: finite values, dropped after; a padded entry row normalises zeros (the epsilon keeps
    it finite) at position 0."""
    n = tensors[0].shape[0]
    step = VECTOR_ELEMENTS // math.gcd(VECTOR_ELEMENTS, width)
    rows = -(-n // step) * step
    if rows == n or tensors[0].device.type != "cpu":
        return tensors
    return tuple(torch.cat([t, t.new_zeros((rows - n, *t.shape[1:]))]) for t in tensors)


def _predecessors(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per forward (the same for every HCA layer): each query's previous position's slot (``-1``: none), whether
    this forward computes that position itself, and the query that does."""
    pred = fb.table.lookup((fb.positions - 1)[:, None])[:, 0]
    hit, query = find(fb.out_slots, pred)
    return pred, hit & (pred >= 0), query


def iterations(fb: ForwardBatch, r: int) -> int:
    """Sweeps that settle every state of the forward: one more than the longest chain of queries of one request
    inside one block, at most ``r``. With fixed shapes the caps say it (``StepCaps.run``, a verify step's D) or the
    whole forward bounds it; eagerly it is read from the batch."""
    n = fb.positions.shape[0]
    if n == 0:
        return 0
    if fb.caps is not None:
        return min(r, fb.caps.run or n)
    return min(r, int(torch.bincount(fb.table.query_req).max()))
