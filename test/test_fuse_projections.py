"""The fuse-the-projections step (``checkpoint.fuse``): a fused model computes what the separate linears did, FP8
parts stack only where their blocks allow, a CSA layer writes its four compressor pieces with one scatter, and the
fused layers launch fewer ops (counted on meta)."""

from __future__ import annotations

import collections
import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from sgl_kernel_ext.weight_formats import quantize_fp8_block
from sglang_tree_v4.checkpoint.fuse import FusedLinear, fuse_projections
from sglang_tree_v4.checkpoint.quantized_modules import FP8BlockLinear
from sglang_tree_v4.dsv4.attention import Attention
from sglang_tree_v4.dsv4.config import CSA, DSV4Config
from sglang_tree_v4.dsv4.model import DSV4Model
from sglang_tree_v4.dsv4.storage import SlotStore, layer_layout
from support.tiny_v4 import prefill_decode_logits, randomize, tiny_config

ROOT = Path(__file__).resolve().parents[1]


def _fp8(out: int, inp: int, seed: int) -> FP8BlockLinear:
    lin = FP8BlockLinear(inp, out)
    lin.weight, lin.scale = quantize_fp8_block(torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)))
    return lin


def test_fused_model_computes_what_the_separate_linears_did():
    """Prefill and decodes across CSA and HCA blocks: the fused model's logits equal the unfused model's."""
    model = DSV4Model(DSV4Config.from_dict(tiny_config(64, hca_ratio=8, window=8)), with_mtp=True).eval()
    randomize(model, seed=5)
    fused = copy.deepcopy(model)
    made = fuse_projections(fused)
    layers = list(fused.layers) + list(fused.mtp)
    compressed = sum(b.attn.compressor is not None for b in layers)
    assert made == 2 * len(layers) + compressed  # q + kv and w1 + w3 everywhere, the compressors where they are
    assert all(b.attn.wq_a is None and b.ffn.shared_experts.w1 is None for b in layers)
    prompt = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = prefill_decode_logits(model, prompt), prefill_decode_logits(fused, prompt)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_fp8_parts_stack_with_their_scales_only_on_block_boundaries():
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    a, b = _fp8(256, 256, 2), _fp8(100, 256, 3)  # the last part may end inside a block
    fused = FusedLinear.of([a, b])
    assert fused is not None and fused.widths == [256, 100] and fused.scale.shape == (3, 2)
    got_a, got_b = fused(x).split(fused.widths, -1)
    assert torch.equal(got_a, a(x)) and torch.equal(got_b, b(x))
    # the controls: a first part ending inside a block, a shard starting inside one, mixed formats
    assert FusedLinear.of([b, a]) is None
    shifted = _fp8(256, 256, 4)
    shifted.offsets = (0, 64)
    assert FusedLinear.of([a, shifted]) is None
    assert FusedLinear.of([a, nn.Linear(256, 128, bias=False)]) is None
    assert FusedLinear.of([nn.Linear(256, 8, bias=True), nn.Linear(256, 8, bias=False)]) is None


def test_csa_pieces_are_written_with_one_scatter():
    """``write_pieces`` stores what four ``write`` calls store; one ``index_put_`` where the pieces are adjacent
    (the CSA layout), one per piece in another order."""
    cfg = DSV4Config.from_dict(tiny_config(64))
    lay = layer_layout(cfg, CSA)
    pieces = ("ckv", "cscore", "ikv", "iscore")
    width = sum(lay.pieces[p][1] for p in pieces)
    values = torch.randn(3, width, generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([5, 2, 9])
    one, four = SlotStore([lay], 16), SlotStore([lay], 16)
    one.write_pieces(0, pieces, slots, values)
    col = 0
    for p in pieces:
        w = lay.pieces[p][1]
        four.write(0, p, slots, values[:, col:col + w])
        col += w
    assert torch.equal(one.buffers[0], four.buffers[0]) and one.buffers[0].abs().sum() > 0
    swapped = SlotStore([lay], 16)
    swapped.write_pieces(0, ("cscore", "ckv", "ikv", "iscore"),
                         slots, torch.cat([values[:, 2 * cfg.head_dim:4 * cfg.head_dim],
                                           values[:, :2 * cfg.head_dim], values[:, 4 * cfg.head_dim:]], -1))
    assert torch.equal(swapped.buffers[0], four.buffers[0])

    from torch.utils._python_dispatch import TorchDispatchMode

    class Scatters(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func is torch.ops.aten.index_put_.default
            return func(*args, **(kwargs or {}))

    for order, expected in ((pieces, 1), (("cscore", "ckv", "ikv", "iscore"), 4)):
        with Scatters() as count:
            SlotStore([lay], 16).write_pieces(0, order, slots, values)
        assert count.n == expected, order
    with pytest.raises(ValueError, match="columns wide"):
        one.write_pieces(0, pieces, slots, values[:, 1:])


def test_fused_layers_launch_fewer_ops_on_meta():
    """The embedded checkpoint's round on meta, per verify layer: every layer kind launches fewer ops fused."""
    from sglang_tree_v4.checkpoint.weights import load_model
    from sglang_tree_v4.step_cost.counter import StepCounter
    from sglang_tree_v4.step_cost.round import run_round

    def per_layer(model):
        counter = StepCounter(weights=list(model.parameters()) + list(model.buffers()))
        run_round(model, counter, 2, 200, 8, 3, 4)
        layers = collections.Counter()
        for op in counter.ops:
            if op.phase == "verify" and isinstance(op.layer, int):
                layers[op.layer] += op.launches
        return layers

    plain = load_model(str(ROOT / "models" / "tiny-v4")).to("meta")
    fused = copy.deepcopy(plain)
    fuse_projections(fused)
    before, after = per_layer(plain), per_layer(fused)
    assert before.keys() == after.keys()
    kinds = {type(m.attn.compressor).__name__ for m in plain.layers}
    assert len(kinds) >= 2  # sliding-only (None), CSA and HCA layers all present
    for layer in before:
        assert after[layer] < before[layer], layer
    assert all(isinstance(m, Attention) for m in [b.attn for b in fused.layers])
