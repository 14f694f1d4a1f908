"""A DSpark checkpoint in the published layout (``checkpoint.dspark_files``), loaded back and told apart at startup.

* Written from the embedded target and a seeded drafter: the target's tensors are bit-identical to ``tiny-v4``'s,
  the drafter's are ``mtp.{s}.*`` with ``main_proj`` on stage 0 and the heads on the last stage, and loading the
  folder gives a model with the same drafter and no MTP layer.
* ``validate_model`` (TREE_V4's startup check) tells DSpark from MTP by keys and tensors, refuses a mismatch either
  way naming what it found, and refuses V4.1 naming ``model_type``.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from sglang_tree_v4.checkpoint.dspark_files import write_dspark_model
from sglang_tree_v4.checkpoint.weights import load_model
from sglang_tree_v4.dsv4 import dspark as ds
from sglang_tree_v4.speculative.server_args import drafter_kind, validate_model
from support.served import EMBEDDED

KEYS = {"dspark_block_size": 4, "dspark_markov_rank": 16, "dspark_markov_head_type": "vanilla",
        "dspark_noise_token_id": 2, "dspark_target_layer_ids": [1, 3]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model = load_model(str(EMBEDDED), with_mtp=False)
    dcfg = ds.DSparkConfig.from_dict(KEYS, model.cfg.num_layers, model.cfg.vocab_size)
    model.dspark = ds.DSparkDrafter(model.cfg, dcfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.dspark.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    out = tmp_path_factory.mktemp("dspark")
    write_dspark_model(model, EMBEDDED, out, KEYS)
    return out, model


def test_published_layout_and_bit_identical_target(folder):
    out, _ = folder
    got, target = load_file(str(out / "model.safetensors")), load_file(str(EMBEDDED / "model.safetensors"))
    for name, t in target.items():
        if not name.startswith("mtp."):
            assert torch.equal(got[name], t), name
    drafter = {n for n in got if n.startswith("mtp.")}
    assert "mtp.0.main_proj.weight" in drafter and "mtp.0.main_norm.weight" in drafter
    assert not any(n.startswith("mtp.1.main_") for n in drafter)
    for head in ("norm.weight", "hc_head_fn", "markov_head.embed.weight", "markov_head.head.weight",
                 "confidence_head.proj.weight"):
        assert f"mtp.1.{head}" in drafter and f"mtp.0.{head}" not in drafter, head
    assert "mtp.0.e_proj.weight" not in drafter and "mtp.1.ffn.experts.3.w1.weight" in drafter
    cfg = json.loads((out / "config.json").read_text())
    assert {k: cfg[k] for k in KEYS} == KEYS and "tree_v4" not in cfg


def test_loads_back_with_the_same_drafter(folder):
    out, written = folder
    model = load_model(str(out))
    assert len(model.mtp) == 0 and model.dspark is not None
    assert model.dspark.dcfg == written.dspark.dcfg
    for (name, a), (_, b) in zip(model.dspark.state_dict().items(), written.dspark.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_startup_tells_dspark_from_mtp_and_refuses_mismatches(folder, tmp_path):
    out, _ = folder
    assert drafter_kind(str(EMBEDDED), validate_model(str(EMBEDDED))) is None  # MTP
    assert drafter_kind(str(out), validate_model(str(out))).block_size == 4  # DSpark
    keys_only = tmp_path / "keys_only"  # DSpark keys over an MTP checkpoint
    shutil.copytree(EMBEDDED, keys_only)
    cfg = json.loads((keys_only / "config.json").read_text())
    (keys_only / "config.json").write_text(json.dumps({**cfg, **KEYS}))
    with pytest.raises(ValueError, match=r"no mtp\.0\.main_proj\.weight \(its mtp\.0\.\* is an MTP layer"):
        validate_model(str(keys_only))
    tensors_only = tmp_path / "tensors_only"  # DSpark tensors, no keys
    shutil.copytree(out, tensors_only)
    cfg = json.loads((tensors_only / "config.json").read_text())
    (tensors_only / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in KEYS}))
    with pytest.raises(ValueError, match="is a DSpark stage .* no dspark_\\* keys"):
        validate_model(str(tensors_only))
    gated = tmp_path / "gated"
    shutil.copytree(out, gated)
    (gated / "config.json").write_text(json.dumps({**cfg, "dspark_markov_head_type": "rnn"}))
    with pytest.raises(ValueError, match="dspark_markov_head_type 'rnn'"):
        validate_model(str(gated))
    (gated / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v41"}))
    with pytest.raises(ValueError, match="model_type 'deepseek_v41'"):
        validate_model(str(gated))
