"""Tensor-parallel sharding (``checkpoint.tp``) and the per-rank streaming load, without a process group: each rank's
model is built under SGLang's parallel-context override, loaded from a published-layout checkpoint on disk through
safetensors slice handles, and compared with the ``--tp 1`` model loaded the same way. Every sharded tensor must be
exactly its slice of the whole, every FP8 shard must dequantise to its slice of the whole dequantised weight (also
where a shard starts inside a 128 x 128 scale block), and no rank may read another rank's part.
(The sharded forward -- SGLang's all-reduce and gather -- runs in the ``--tp 2`` server tests.)"""

from __future__ import annotations

import json

import pytest
import torch

from sgl_kernel_ext.weight_formats import FP8_DTYPE, dense_weight
from sglang_tree_v4.checkpoint.swap import build_model, parameter_bytes
from sglang_tree_v4.checkpoint.weights import StreamingLoader, iter_safetensors
from sglang_tree_v4.dsv4.config import ConfigError, DSV4Config
from support import real_format as rf

sglang_parallel = pytest.importorskip("sglang.srt.runtime_context")
from sglang_tree_v4.checkpoint.tp import shard_model  # noqa: E402  (imports sglang)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return rf.published_checkpoint(tmp_path_factory.mktemp("published"))


class _Recorder:
    """Wraps safetensors slice handles: which tensors were read, and how many bytes."""

    def __init__(self):
        self.read: dict[str, int] = {}

    def wrap(self, items):
        for name, handle in items:
            yield name, _Recorded(self, name, handle)


class _Recorded:
    def __init__(self, rec, name, handle):
        self.rec, self.name, self.handle = rec, name, handle

    def get_shape(self):
        return self.handle.get_shape()

    def get_dtype(self):
        return self.handle.get_dtype()

    def __getitem__(self, index):
        t = self.handle[index]
        self.rec.read[self.name] = self.rec.read.get(self.name, 0) + t.numel() * t.element_size()
        return t


def _load(path, tp: int, rank: int):
    raw = json.loads((path / "config.json").read_text())
    with sglang_parallel.get_parallel().override(tp_size=tp, tp_rank=rank):
        model = build_model(DSV4Config.from_dict(raw), raw, dtype=torch.float32, device="cpu", shard=shard_model)
    rec = _Recorder()
    loader = StreamingLoader(model)
    with torch.no_grad():
        for name, t in rec.wrap(iter_safetensors(str(path), lazy=True)):
            loader.feed(name, t)
    loader.finish()
    return model, rec


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == FP8_DTYPE:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b)


@pytest.fixture(scope="module")
def loaded(published):
    return {(tp, r): _load(published, tp, r) for tp, r in ((1, 0), (2, 0), (2, 1))}


@pytest.mark.parametrize("rank", [0, 1])
def test_every_tensor_is_its_slice_of_the_whole(loaded, rank):
    whole = loaded[(1, 0)][0].state_dict()
    model = loaded[(2, rank)][0]
    plan = model.shard_plan
    assert any(k.endswith("attn.wq_b.weight") for k in plan) and any(k.endswith("experts.w1") for k in plan)
    for key, t in model.state_dict().items():
        shard = plan.get(key)
        if shard is None:
            assert _same(t, whole[key]), f"replicated {key} differs"
            continue
        n = shard.stop - shard.start
        assert _same(t.narrow(shard.dim, 0, n), whole[key].narrow(shard.dim, shard.start, n)), key
        assert not t.narrow(shard.dim, n, t.shape[shard.dim] - n).any(), f"{key}: padding is not zero"


@pytest.mark.parametrize("rank", [0, 1])
def test_fp8_shards_dequantise_to_their_slice(loaded, rank):
    """Column shards of ``wo_a`` (32 of one block's 128 rows) and row shards of ``wo_b`` (32 of 128 columns) start
    inside a scale block: their offsets must pick the right scales."""
    whole = dict(loaded[(1, 0)][0].named_modules())
    model = loaded[(2, rank)][0]
    checked = 0
    for name, module in model.named_modules():
        shard = model.shard_plan.get(name + ".weight")
        if shard is None or getattr(module, "weight", None) is None or module.weight.dtype != FP8_DTYPE:
            continue
        n = shard.stop - shard.start
        assert torch.equal(dense_weight(module), dense_weight(whole[name]).narrow(shard.dim, shard.start, n)), name
        checked += 1
        if name.endswith("wo_a") and rank == 1:
            assert module.offsets[0] == shard.start % 128 != 0
    assert checked >= 4 * 5  # wq_b, wo_a, wo_b, shared w1/w2/w3 per layer


def test_ranks_read_only_their_part(loaded):
    """Each rank reads from disk only what it holds: never another rank's expert, and the bytes it reads are the
    bytes it keeps (at most 5 % more: FP8 scale blocks two ranks share)."""
    full_read = sum(loaded[(1, 0)][1].read.values())
    for rank in (0, 1):
        model, rec = loaded[(2, rank)]
        held = range(rank * 2, rank * 2 + 2)  # 4 experts per layer, 2 per rank
        experts = [n for n in rec.read if ".ffn.experts." in n]
        assert experts and all(int(n.split(".ffn.experts.")[1].split(".")[0]) in held for n in experts)
        read = sum(rec.read.values())
        stored = parameter_bytes(model)["param_bytes_per_rank"]
        scales = sum(t.numel() * 3 for k, t in model.state_dict().items() if k.endswith(".scale"))  # e8m0 -> fp32
        assert read <= 1.05 * (stored - scales), (read, stored)
        assert read < 0.8 * full_read


def test_tp_must_divide_heads_groups_and_experts(published):
    raw = json.loads((published / "config.json").read_text())
    with sglang_parallel.get_parallel().override(tp_size=8, tp_rank=0):
        with pytest.raises(ConfigError, match=r"--tp 8: .*num_attention_heads \(4\)"):
            build_model(DSV4Config.from_dict(raw), raw, device="meta", shard=shard_model)
