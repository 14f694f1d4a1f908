"""A DSpark model folder: a V4 target's files with a DSpark drafter in the published layout.

The target's tensors are copied bit for bit (its ``mtp.*``, an MTP layer, dropped), the drafter's are written as
DeepSeek publishes them (``mtp.{s}.*``: ``main_proj``/``main_norm`` on stage 0, the HC head, ``norm``, the Markov
and confidence heads on the last stage), and ``config.json`` gains the ``dspark_*`` keys (its MTP calibration, a
property of the old drafter, is dropped).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .weights import deepseek_state

COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def write_dspark_model(model: torch.nn.Module, target: str | Path, out: str | Path, dspark_keys: dict,
                       meta: dict | None = None) -> None:
    """``model``: the target with its ``dspark`` drafter; ``target``: the folder its weights came from."""
    from safetensors.torch import load_file, save_file

    target, out = Path(target), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v for k, v in load_file(str(target / "model.safetensors")).items() if not k.startswith("mtp.")}
    drafter = {k: v.detach().clone() for k, v in deepseek_state(model).items() if k.startswith("mtp.")}
    save_file({**tensors, **drafter}, str(out / "model.safetensors"))
    cfg = json.loads((target / "config.json").read_text())
    cfg.pop("tree_v4", None)
    cfg.update(dspark_keys, num_nextn_predict_layers=len(dspark_keys["dspark_target_layer_ids"]))
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    for name in COPIED:
        if (target / name).exists():
            shutil.copy(target / name, out / name)
    if meta is not None:
        (out / "training_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
