"""Compressed entries kept as fp8 bytes (``--kv-cache-dtype fp8_e4m3``): the codec, and the model over it.

The codec is upstream's V4 layout: an entry's non-rope channels as e4m3 in tiles of 64 with one power-of-two
(UE8M0) scale byte per tile, its rope channels in bf16, one pad byte (584 B at V4-Flash); an index key wholly e4m3
with one float32 scale per 128 channels (132 B). Losslessness of speculation with fp8 entries is held elsewhere
against the same fp8 model (tree-state and paged-entry tests, fp8 servers); here: the bytes are what they should be,
and a model over them stays close to full precision without being identical to it (so the fp8 path is in use).
"""
from pathlib import Path

import pytest
import torch

from sglang_tree_v4.dsv4.config import DSV4Config
from sglang_tree_v4.dsv4.entry_codec import E4M3_MAX, Fp8Codec, entry_codecs
from support.hf_reference import rel_err

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


def v4_flash() -> DSV4Config:
    import json
    return DSV4Config.from_dict(json.loads((ROOT / "data" / "deepseek_v4_flash_config.json").read_text()))


def test_sizes_are_upstreams_at_v4_flash():
    codecs = entry_codecs(v4_flash(), "fp8_e4m3")
    assert codecs["entry"].nbytes == 448 + 64 * 2 + 7 + 1 == 584
    assert codecs["ientry"].nbytes == 128 + 4 == 132
    assert entry_codecs(v4_flash(), None) == {}
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e5m2"):
        entry_codecs(v4_flash(), "fp8_e5m2")


@pytest.mark.parametrize("codec", [Fp8Codec(512, 64, 64, 1, pad=1), Fp8Codec(128, 0, 128, 4),
                                   Fp8Codec(64, 16, 64, 1, pad=1)], ids=["entry", "index-key", "tiny-entry"])
def test_round_trip(codec):
    """Per tile: the scale is the smallest power of two that fits the tile's largest magnitude into e4m3's range,
    every value comes back within half an e4m3 step of its binade (at most 1/16 of the tile's largest magnitude),
    rope channels come back as bf16, an all-zero row (never written) decodes to zeros. Tiles of very different
    magnitudes in one row keep their own scales."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, codec.dim, generator=g)
    x[:, : codec.quantized] *= torch.logspace(-6, 3, codec.quantized)[torch.randperm(codec.quantized, generator=g)]
    x[3] = 0
    b = codec.encode(x)
    assert b.dtype == torch.uint8 and b.shape == (32, codec.nbytes)
    y = codec.decode(b)
    q = codec.quantized
    pad = codec.tiles * codec.tile - q
    tiles = torch.nn.functional.pad(x[:, :q], (0, pad)).view(32, codec.tiles, codec.tile)
    err = torch.nn.functional.pad((y - x)[:, :q], (0, pad)).view_as(tiles).abs()
    amax = tiles.abs().amax(-1, keepdim=True)
    assert bool((err <= amax / 16 + 1e-30).all())
    assert torch.equal(y[:, q:], x[:, q:].to(torch.bfloat16).float())
    assert torch.equal(y[3], torch.zeros(codec.dim))
    s0 = q + 2 * codec.rope
    scales = b[:, s0:s0 + codec.tiles * codec.scale_bytes]
    scale = torch.exp2(scales.float() - 127) if codec.scale_bytes == 1 else scales.contiguous().view(torch.float32)
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two
    fits = amax.squeeze(-1) / scale
    nonzero = amax.squeeze(-1) > 1e-6
    assert bool((fits[nonzero] <= E4M3_MAX).all() and (fits[nonzero] > E4M3_MAX / 2).all())
    assert torch.equal(codec.decode(torch.zeros(2, 5, codec.nbytes, dtype=torch.uint8)), torch.zeros(2, 5, codec.dim))
    assert torch.equal(codec.decode(codec.encode(y)), y)  # decoded values are on the grid


def test_embedded_model_over_fp8_state_stays_close_to_full_precision():
    """The trained embedded model, prefill logits of chat prompts: fp8 entries and window keys (the fp8 bytes are
    what attention reads) move them from full precision about as much as running the model in bf16 does (at most
    1.5x as much, prompt by prompt; measured 0.7-1.1x), and the entry and window-key buffers are uint8."""
    from sglang_tree_v4.checkpoint.weights import load_model
    from sglang_tree_v4.testing.runner import DSV4Runner
    from support.serving_checks import chat_prompt_ids

    model = load_model(str(ROOT / "models" / "tiny-v4"))
    bf16 = load_model(str(ROOT / "models" / "tiny-v4")).to(torch.bfloat16)
    for ids in chat_prompt_ids(ROOT / "models" / "tiny-v4"):
        logits = {}
        for name, m, fmt in (("full", model, None), ("fp8_e4m3", model, "fp8_e4m3"), ("bf16", bf16, None)):
            runner = DSV4Runner(m, num_slots=1024, max_len=256, max_reqs=2, entry_format=fmt)
            rid = runner.add_request()
            logits[name] = runner.extend([rid], [torch.tensor(ids)])[0].logits.float()
            if fmt:
                kept = [b for b in runner.store.token_buffers if b.shape[1]]
                assert kept and all(b.dtype == torch.uint8 for b in kept + runner.store.buffers)
        fp8, bf = rel_err(logits["fp8_e4m3"], logits["full"]), rel_err(logits["bf16"], logits["full"])
        assert 1e-5 < fp8 < 1.5 * bf, (fp8, bf)
