"""Checkpoint formats through disk: DeepSeek's published layout (FP8 block-scaled linears, FP4 experts, shards +
index), transformers' ``save_pretrained``, our ``save_checkpoint``; kept quantized in memory, streamed in, errors
that name the tensor. The ground truth is HF transformers on the same (dequantised) weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sgl_kernel_ext.weight_formats import (
    dequantize_fp4,
    pack_fp4,
    quantize_fp4,
    quantize_fp8_block,
    unpack_fp4,
)
from sglang_tree_v4.checkpoint.quantized_modules import FP4Experts, FP8BlockLinear
from sglang_tree_v4.checkpoint.swap import parameter_bytes
from sglang_tree_v4.checkpoint.weights import (
    CheckpointError,
    load_model,
    save_checkpoint,
    save_published,
)
from sglang_tree_v4.dsv4.config import ConfigError
from support import real_format as rf
from support.hf_reference import build_hf, hf_logits, ours_from_hf, rel_err

TOL = 1e-4


def _ids(n=60, vocab=3072, seed=5):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model.forward_sequences(ids[None]).logits[0]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    hf = build_hf(8, seed=3, vocab=3072)
    path = tmp_path_factory.mktemp("published")
    save_published(ours_from_hf(hf, with_mtp=True), str(path), max_shard_bytes=2_000_000)
    return path


def test_e2m1_nibble_order_and_grid():
    values = torch.tensor([[0.5, -6.0, 1.0, 0.0, 3.0, -0.5]])
    packed = pack_fp4(values)
    assert packed.tolist() == [[0xF1, 0x02, 0x95]]  # low nibble = even element, bit 3 = sign
    assert torch.equal(unpack_fp4(packed), values)


def test_published_layout_on_disk(published):
    index = json.loads((published / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2
    with safe_open(str(published / index["weight_map"]["layers.1.attn.wq_b.weight"]), "pt") as f:
        assert f.get_tensor("layers.1.attn.wq_b.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("layers.1.attn.wq_b.scale").dtype == torch.float8_e8m0fnu
    with safe_open(str(published / index["weight_map"]["layers.1.ffn.experts.3.w2.weight"]), "pt") as f:
        assert f.get_tensor("layers.1.ffn.experts.3.w2.weight").dtype == torch.int8
        assert f.get_tensor("layers.1.ffn.experts.3.w2.scale").shape[1] * 32 == 64  # per-32 along the input
    assert any(k.startswith("mtp.0.") for k in index["weight_map"])
    config = json.loads((published / "config.json").read_text())
    assert config["expert_dtype"] == "fp4" and config["quantization_config"]["weight_block_size"] == [128, 128]


def test_published_layout_kept_quantized_and_equal_to_hf_on_dequantised_weights(published):
    model = load_model(str(published))
    assert isinstance(model.layers[1].attn.wq_b, FP8BlockLinear) and isinstance(model.layers[1].ffn.experts,
                                                                              FP4Experts)
    assert model.layers[1].attn.wq_b.weight.dtype == torch.float8_e4m3fn
    ids = _ids()
    hf = rf.hf_reference(published, hf_config_dir=_hf_config_dir(published))
    assert rel_err(_logits(model, ids), hf_logits(hf, ids)) <= TOL
    assert rel_err(_logits(model, ids), _logits(rf.dequantised_model(published), ids)) <= 1e-6


def _hf_config_dir(published):
    out = published / "hf_config"
    if not out.exists():
        build_hf(8, seed=3, vocab=3072).config.save_pretrained(out)
    return out


def test_resident_bytes_are_the_checkpoint_bytes(published):
    """Kept quantized with the dense weights in bf16 (as published), the model holds what the files hold."""
    model = load_model(str(published), dtype=torch.bfloat16)
    held = parameter_bytes(model)["param_bytes_per_rank"]
    on_disk = 0
    for file in published.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for k in f.keys():
                if not k.startswith("mtp.0.emb") and not k.startswith("mtp.0.head"):
                    t = f.get_tensor(k)
                    on_disk += t.numel() * t.element_size()
    assert held <= 1.05 * on_disk, (held, on_disk)


def test_save_pretrained_through_disk_matches_hf(tmp_path):
    hf = build_hf(8, seed=1, vocab=3072)
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path))
    assert len(model.mtp) == 0  # transformers' model has no MTP layer to save
    ids = _ids()
    assert rel_err(_logits(model, ids), hf_logits(hf, ids)) <= TOL


def test_own_save_checkpoint_round_trip(tmp_path):
    hf = build_hf(8, seed=2, vocab=3072)
    ours = ours_from_hf(hf, with_mtp=True)
    save_checkpoint(ours, str(tmp_path))
    again = load_model(str(tmp_path))
    ids = _ids()
    assert torch.equal(_logits(again, ids), _logits(ours, ids))


def _rewrite(published, tmp_path, edit):
    """A copy of the published checkpoint with one shard's tensors edited."""
    import shutil
    out = tmp_path / "bad"
    shutil.copytree(published, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    file = out / index["weight_map"]["layers.1.attn.wq_b.weight"]
    with safe_open(str(file), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(file))
    return out


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("layers.1.attn.wq_b.weight"), r"layers\.1\.attn\.wq_b\.weight"),
    (lambda t: t.__setitem__("layers.1.attn.wq_b.scale", t["layers.1.attn.wq_b.scale"][:, :0]),
     r"layers\.1\.attn\.wq_b\.scale.*does not tile"),
    (lambda t: t.__setitem__("layers.1.attn.wq_b.weight", t["layers.1.attn.wq_b.weight"].float()),
     r"layers\.1\.attn\.wq_b\.weight.*FP8"),
    (lambda t: t.__setitem__("layers.1.attn.wq_b.weight", t["layers.1.attn.wq_b.weight"][:3]),
     r"layers\.1\.attn\.wq_b\.weight.*shape"),
], ids=["missing", "scale-does-not-tile", "wrong-dtype", "wrong-shape"])
def test_bad_tensors_are_named(published, tmp_path, edit, match):
    with pytest.raises(CheckpointError, match=match):
        load_model(str(_rewrite(published, tmp_path, edit)))


def test_unknown_quantization_is_named(published, tmp_path):
    import shutil
    out = tmp_path / "q"
    shutil.copytree(published, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "awq"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quantization_config.quant_method"):
        load_model(str(out))


def test_fp8_and_fp4_quantizers_round_trip():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    q, s = quantize_fp4(w)
    d = dequantize_fp4(q, s)
    assert torch.equal(dequantize_fp4(*quantize_fp4(d)), d)  # dequantised values are on the grid


def _footprint(*args: str) -> dict:
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "sglang_tree_v4.footprint", *args], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_footprint_of_the_published_v4_flash_config():
    """The footprint report at V4-Flash shapes (meta device, no memory): the routed experts are held as FP4 bytes
    plus e8m0 scales, exactly (43 + 1 MTP) x 256 experts x 3 matrices x 2048 x 4096 x (1/2 + 1/32) bytes, and the
    FP8 linears as one byte per weight. Sharded over ``--tp N`` ranks (SGLang's parallel layers, expert parallel
    MoE), each rank holds 1/N of the experts and at most 0.55x (TP2), 45 GB (TP4), 24 GB (TP8)."""
    from pathlib import Path
    config = str(Path(__file__).resolve().parents[1] / "data" / "deepseek_v4_flash_config.json")
    reports = {tp: _footprint(config, "--tp", str(tp)) for tp in (1, 2, 4, 8)}
    report = reports[1]
    experts = 44 * 256 * 3 * 2048 * 4096 * 17 // 32
    assert report["param_bytes_by_dtype"]["uint8"] == experts
    assert report["param_bytes_by_dtype"]["float8_e4m3fn"] > 0
    assert report["param_bytes_per_rank"] == sum(report["param_bytes_by_dtype"].values())
    assert {"construct_s", "tp", "tp_rank", "dtype"} <= set(report)
    for tp, r in reports.items():
        assert r["tp"] == tp and r["param_bytes_by_dtype"]["uint8"] == experts // tp
        assert r["param_bytes_by_dtype"]["float8_e4m3fn"] < report["param_bytes_by_dtype"]["float8_e4m3fn"] or tp == 1
    assert reports[2]["param_bytes_per_rank"] <= 0.55 * report["param_bytes_per_rank"]
    assert reports[4]["param_bytes_per_rank"] <= 45e9
    assert reports[8]["param_bytes_per_rank"] <= 24e9
    last = _footprint(config, "--tp", "8", "--tp-rank", "7")  # ranks hold equal shares (no vocabulary padding)
    assert last["param_bytes_per_rank"] == reports[8]["param_bytes_per_rank"] and last["tp_rank"] == 7


@pytest.mark.slow
def test_footprint_state_of_the_published_v4_flash_config():
    """The state part of the report at V4-Flash shapes, bf16, measured from the hybrid pool the server builds.
    Pages are 128 slots (whole CSA and HCA blocks), so a token slot's share of the entries is one CSA entry (512 +
    index key 128) per 4 slots in 21 layers and one HCA entry (512) per 128 in 20, plus one V column per layer:
    6,962 bytes per token (1,474,650 when every state piece of every layer sat in a per-token row padded to the
    widest, 273,754 unpadded, 47,442 with a full entry row per token). A window row holds the rest -- keys (43
    layers + MTP, 512) and its share of the ring: 16 rows per page of 128 (the D=8 verify block after a CSA
    block's 7 rows back), 1/8 of a row per window row, of the CSA compressor rows (2 x 1024 + 2 x 256), the HCA
    running states (2 x 512, fp32) and the MTP's input streams (4 x 4096): 72,920 bytes (226,394 when every row
    kept every compressor row and stream, 132,314 with the HCA rows and the streams in every row) -- and a request
    holds at most 128 + 128 window rows (SGLang keeps the retained window of 128, a whole page, and
    frees every 128 positions, its eviction interval) + 8 for the verify block, 8 + 127 token slots beyond its
    committed tokens (reservation, last page), 8 scratch rows (one entry of every layer per draft node) and 9 MTP
    scratch rows (the K (S - 1) draft nodes past the root). The split by kind adds up; upstream's fp8 layout needs
    about 3.85 KB per token.

    With ``--kv-cache-dtype fp8_e4m3`` the entries are upstream's fp8 bytes -- 584 per entry (448 e4m3, 64 bf16
    rope channels, 7 scales, 1 pad), 132 per index key (128 e4m3, a 4-byte scale) -- and so are the 43 target
    layers' window keys (584 each; the MTP's key, the compressor rows and the streams keep their dtypes): 3,932.25
    bytes per token, the entries' 3,850.25 (upstream's slope) plus the V columns, a window row 54,000 bytes and at
    most 15.5 MB per running request (below 16 MiB). An unsupported KV dtype is refused, naming the flag."""
    from pathlib import Path
    config = str(Path(__file__).resolve().parents[1] / "data" / "deepseek_v4_flash_config.json")
    r = _footprint(config, "--tp", "4", "--tokens", "1000000", "--requests", "64", "--context-length", "131072")
    token = (21 * (512 + 128) // 4 + 20 * 512 // 128 + 41) * 2
    window_row = (44 * 512 + (21 * (2 * 1024 + 2 * 256) + 4 * 4096) * 16 // 128 + 44) * 2 + 20 * 2 * 512 * 4 // 8
    scratch_row = (21 * (512 + 128) + 20 * 512) * 2
    mtp_scratch = 3 * 3 * 512 * 2  # K (S - 1) rows of the MTP layer's window key
    assert r["state_bytes_per_token"] == token == 6_962 and r["window_row_bytes"] == window_row == 72_920
    assert r["page_size"] == 128 and r["tree_scratch_bytes_per_request"] == 8 * scratch_row + mtp_scratch
    assert r["draft_tree_slots_per_request"] == 8  # the default D=8 K=3 S=4 tree's verify block
    assert r["window_rows_per_request"] == 128 + 128 + 8
    assert r["state_bytes_per_request"] == (264 * window_row + (8 + 127) * token + 8 * scratch_row + mtp_scratch
                                            + 131072 * 4)
    kinds = r["state_bytes_by_kind"]
    assert sum(v for k, v in kinds.items() if k != "req_to_token") == (
        token * (r["state_tokens"] + 64 * 135) + window_row * 64 * 264 + 64 * (8 * scratch_row + mtp_scratch))
    assert kinds["compressed_entries"] == (21 * 640 // 4 + 20 * 512 // 128) * 2 * (1_000_000 + 64 * 135)
    assert r["state_bytes"] == 1_000_000 * r["state_bytes_per_token"] + 64 * r["state_bytes_per_request"]
    assert 3800 < r["upstream_fp8_state_bytes_per_token"] < 3900
    import subprocess
    import sys
    fp8 = _footprint(config, "--tp", "4", "--tokens", "1000000", "--requests", "64", "--context-length", "131072",
                     "--kv-cache-dtype", "fp8_e4m3")
    fp8_entries = 21 * (584 + 132) / 4 + 20 * 584 / 128
    assert fp8_entries == 3850.25 and fp8["state_bytes_per_token"] == fp8_entries + 41 * 2 <= 4000
    assert abs(fp8_entries - fp8["upstream_fp8_state_bytes_per_token"]) < 0.1
    assert fp8["state_bytes_by_kind"]["compressed_entries"] == round(fp8_entries * (1_000_000 + 64 * 135))
    fp8_window_row = window_row - 43 * (2 * 512 - 584)
    assert fp8["window_row_bytes"] == fp8_window_row == 54_000 and fp8["kv_cache_dtype"] == "fp8_e4m3"
    assert fp8["tree_scratch_bytes_per_request"] == 8 * (21 * (584 + 132) + 20 * 584) + mtp_scratch
    assert fp8["state_bytes_per_token"] <= 2 * 4000 and r["state_bytes_per_token"] <= 2 * 4000  # bf16: <= 2x
    assert fp8["state_bytes_per_request"] == round(264 * fp8_window_row + (8 + 127) * fp8["state_bytes_per_token"]
                                                    + fp8["tree_scratch_bytes_per_request"] + 131072 * 4)
    assert fp8["state_bytes_per_request"] <= 16 * 2 ** 20  # the bar; upstream's layout: 41.8 MB
    assert fp8["state_bytes_per_request"] < fp8["upstream_fp8_state_bytes_per_request"]
    bad = subprocess.run([sys.executable, "-m", "sglang_tree_v4.footprint", config, "--tokens", "10",
                          "--kv-cache-dtype", "fp8_e5m2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--kv-cache-dtype fp8_e5m2" in bad.stderr, bad.stderr[-500:]


@pytest.mark.slow
def test_footprint_names_a_tp_that_does_not_divide():
    import subprocess
    import sys
    from pathlib import Path
    config = str(Path(__file__).resolve().parents[1] / "data" / "deepseek_v4_flash_config.json")
    done = subprocess.run([sys.executable, "-m", "sglang_tree_v4.footprint", config, "--tp", "3"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "--tp 3" in done.stderr and "num_attention_heads (64)" in done.stderr


@pytest.mark.parametrize("config", ["models/tiny-v4/config.json", "data/deepseek_v4_flash_config.json"])
def test_sglang_sizes_the_pool_by_each_layers_own_width(config):
    """SGLang decides how many tokens fit a memory budget from the config our override hands it (per half of the
    hybrid pool: layers x (head_dim + v_head_dim), window layers with the ``swa_`` values); the pool our hook builds
    instead carves each layer at its own width and, for the entries, one row per block of its ratio. The two agree
    to less than one column per layer, so the tokens SGLang fits follow the real bytes; the window buffers are those
    widths and a move carries whole window rows; the entry buffers have a row per block and the scratch, and a move
    leaves them alone (the worker commits accepted entries). A page size that splits a block is refused."""
    from pathlib import Path

    import torch

    from sglang_tree_v4.dsv4.config import DSV4Config
    from sglang_tree_v4.dsv4.storage import ring_period
    from sglang_tree_v4.serving.sglang_pool import (
        TOKEN_LABEL,
        WINDOW_LABEL,
        model_state_pool_class,
        ring_layer_columns,
        ring_layer_widths,
        state_page_size,
        token_columns_per_slot,
        token_layer_ratios,
        token_layer_widths,
        window_layer_widths,
    )
    from sglang_tree_v4.speculative.model_override import sglang_config, torch_itemsize
    raw = json.loads((Path(__file__).resolve().parents[1] / config).read_text())
    cfg = DSV4Config.from_dict(raw)
    pc, window, token = sglang_config(raw), window_layer_widths(cfg), token_layer_widths(cfg)
    assert pc.is_hybrid_swa and pc.hybrid_layer_pattern == [1] * len(window) + [0] * len(token)
    assert pc.num_hidden_layers == len(window) + len(token)
    assert pc.sliding_window == max(cfg.window, *cfg.compress_ratios)  # what a step reads below its first query
    per_slot = token_columns_per_slot(cfg)
    page, ratios, scratch = state_page_size(cfg), token_layer_ratios(cfg), 6
    # a server without speculation, the pool in the checkpoint's dtype (an HCA state's fp32 in its columns)
    ring, period = ring_layer_columns(cfg, torch_itemsize(raw)), ring_period(cfg, page, 1)
    assert period == 8 < page and sum(ring) > 0  # the compressor rows and states: 8 of every page's window rows
    assert sum(ring) >= sum(ring_layer_widths(cfg))
    for widths, extra, hd, vd in ((window, sum(ring) * period / page, pc.swa_head_dim, pc.swa_v_head_dim),
                                  (per_slot, 0, pc.head_dim, pc.v_head_dim)):
        real = sum(widths) + extra + len(widths) * vd
        assert 0 <= len(widths) * (hd + vd) - real < len(widths)
    assert all(page % r == 0 for r in ratios)
    mtp_scratch, mtp = 4, cfg.num_nextn_predict_layers
    pool_class = model_state_pool_class(cfg, scratch, mtp_scratch_rows=mtp_scratch)
    for label, widths, hd in ((WINDOW_LABEL, window, pc.swa_head_dim), (TOKEN_LABEL, token, pc.head_dim)):
        pool = pool_class(size=4 * page, page_size=page, dtype=torch.float32, head_num=1, head_dim=hd,
                          layer_num=len(widths), device="cpu", enable_memory_saver=False, allocation_label=label)
        assert [b.shape[-1] for b in pool.k_buffer] == widths and all(b.shape[-1] == 1 for b in pool.v_buffer)
        pool.k_buffer[-1][2] = 7.0
        pool.move_kv_cache(torch.tensor([3]), torch.tensor([2]))
        if label == WINDOW_LABEL:  # every layer's whole row, whatever its width; the MTP's draft scratch after
            assert bool((pool.k_buffer[-1][3] == 7.0).all())
            assert [b.shape[0] for b in pool.k_buffer] == [5 * page] * (len(window) - mtp) + [5 * page + 4] * mtp
            # and its ring rows, 8 per page: window row page + 10 is ring row 8 + 2, window row 11 ring row 3
            shapes = [(b.shape[0], b.shape[1]) for b in pool.ring_buffers]
            assert shapes == [(5 * 8, w) for w in ring_layer_widths(cfg)]
            assert [b.dtype for b in pool.ring_buffers] == [torch.float32] * len(ring)  # HCA states: fp32 always
            csa = next(b for b in pool.ring_buffers if b.shape[1])
            csa[8 + 2] = 5.0
            pool.move_kv_cache(torch.tensor([11]), torch.tensor([page + 10]))
            assert bool((csa[3] == 5.0).all()) and not bool((csa[2] == 5.0).any() or (csa[4] == 5.0).any())
            assert sum(pool.get_kv_size_bytes()) == sum(b.numel() * b.element_size()
                                                        for b in pool.k_buffer + pool.v_buffer + pool.ring_buffers)
        else:
            assert [b.shape[0] for b in pool.k_buffer] == [5 * page // r + scratch for r in ratios]
            assert not bool((pool.k_buffer[-1][3] == 7.0).any())
    with pytest.raises(ValueError, match="--page-size"):
        pool_class(size=4 * page, page_size=page // 2, dtype=torch.float32, head_num=1, head_dim=pc.head_dim,
                   layer_num=len(token), device="cpu", enable_memory_saver=False, allocation_label=TOKEN_LABEL)
