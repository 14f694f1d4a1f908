"""Checkpoints in the formats users bring, written to disk by the tools that write them, and their HF references.

* ``published_checkpoint``: the embedded trained model re-written in DeepSeek's published V4-Flash layout
  (``checkpoint.weights.save_published``: FP8 block-scaled attention / shared experts / MTP projections, FP4 experts,
  two
  or more shards + index, DeepSeek names incl. ``mtp.0.*``), with the embedded tokenizer. Trained, so the
  quantized MTP still agrees with the quantized target and drafts are accepted.
* ``save_pretrained_checkpoint``: a random HF ``DeepseekV4ForCausalLM`` written by transformers' own
  ``save_pretrained``, with the same tokenizer.
* ``hf_reference``: HF transformers' model carrying exactly the weights a checkpoint stores (dequantised), the
  ground truth both are compared with.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from sglang_tree_v4.checkpoint.weights import (
    iter_safetensors,
    load_model,
    load_state,
    save_published,
    to_internal,
)
from sglang_tree_v4.dsv4.config import DSV4Config
from sglang_tree_v4.dsv4.model import DSV4Model

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = ROOT / "models" / "tiny-v4"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def _copy_tokenizer(out: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy(EMBEDDED / name, out / name)


def published_checkpoint(out: Path) -> Path:
    save_published(load_model(str(EMBEDDED)), str(out), max_shard_bytes=2_000_000)
    _copy_tokenizer(out)
    return out


def save_pretrained_checkpoint(out: Path, seed: int = 0) -> Path:
    from support.hf_reference import build_hf
    hf = build_hf(8, seed=seed, vocab=3072)
    hf.save_pretrained(out)
    _copy_tokenizer(out)
    return out


def dequantised_model(path: Path) -> DSV4Model:
    """A dense model (plain ``nn.Linear``, float32) holding the checkpoint's weights, dequantised on load."""
    model = DSV4Model(DSV4Config.from_pretrained(str(path)), with_mtp=False).eval()
    load_state(model, iter_safetensors(str(path)))
    return model


def hf_reference(path: Path, hf_config_dir: Path = EMBEDDED):
    """HF ``DeepseekV4ForCausalLM`` (config of ``hf_config_dir``) with the checkpoint's dequantised weights."""
    from transformers import AutoConfig, DeepseekV4ForCausalLM
    cfg = AutoConfig.from_pretrained(str(hf_config_dir))
    cfg._experts_implementation = "eager"
    hf = DeepseekV4ForCausalLM(cfg).eval().float()
    ours = dequantised_model(path).state_dict()
    state = {}
    for key in hf.state_dict():
        name = to_internal(key)
        if name.endswith(".gate_up_proj"):
            stem = name[: -len("gate_up_proj")]
            state[key] = torch.cat([ours[stem + "w1"], ours[stem + "w3"]], dim=1)
        elif name.endswith(".down_proj"):
            state[key] = ours[name[: -len("down_proj")] + "w2"]
        else:
            state[key] = ours[name]
    hf.load_state_dict(state)
    return hf


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and, per position, the log-prob gap between its top two tokens."""
    ids, gaps = list(prompt), []
    for _ in range(n):
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1)
        top = logp.topk(2)
        gaps.append(float(top.values[0] - top.values[1]))
        ids.append(int(top.indices[0]))
    return ids[len(prompt):], gaps


def assert_matches_hf(got: list[int], want: list[int], gaps: list[float], tie: float = 1e-3) -> None:
    """Token-identical, except that a divergence is tolerated where HF's top two are within ``tie`` (a near tie
    that float rounding may flip); nothing after a tolerated divergence is compared."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            assert gaps[i] < tie, f"token {i}: {a} != {b} with a top-2 log-prob gap of {gaps[i]:.3g}"
            return
    assert len(got) == len(want)
