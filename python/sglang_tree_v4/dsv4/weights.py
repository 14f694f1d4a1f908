"""Checkpoint loading: DeepSeek naming (the published checkpoints, incl. ``mtp.*``) and HF transformers naming.

Each tensor name is translated on its own (so a file may mix both: HF-named main model + DeepSeek-named ``mtp.*``)
into this package's module names, which follow DeepSeek's except that routed experts are stacked
(``ffn.experts.w1 [E, I, D]``) and hyper-connection triples are submodules (``hc_attn.fn`` for ``hc_attn_fn``).

FP8 weights (``float8_e4m3fn`` with a block scale ``<name>.scale`` or ``<name>.weight_scale_inv``, 128x128 blocks)
are dequantised on load. FP4-packed expert weights are not supported yet and are rejected by name.
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import Mapping

import torch

from .config import DSV4Config


class CheckpointError(ValueError):
    pass


# ---- name translation -------------------------------------------------------------------------------------------
_HF_SUBS = [
    (".self_attn.compressor.indexer.scorer.weights_proj.", ".attn.indexer.weights_proj."),
    (".self_attn.compressor.indexer.q_b_proj.", ".attn.indexer.wq_b."),
    (".self_attn.compressor.indexer.", ".attn.indexer.compressor."),
    (".self_attn.", ".attn."),
    (".mlp.shared_experts.gate_proj.", ".ffn.shared_experts.w1."),
    (".mlp.shared_experts.up_proj.", ".ffn.shared_experts.w3."),
    (".mlp.shared_experts.down_proj.", ".ffn.shared_experts.w2."),
    (".mlp.", ".ffn."),
    (".input_layernorm.", ".attn_norm."),
    (".post_attention_layernorm.", ".ffn_norm."),
    (".attn_hc.", ".hc_attn."),
    (".ffn_hc.", ".hc_ffn."),
    (".q_a_proj.", ".wq_a."),
    (".q_a_norm.", ".q_norm."),
    (".q_b_proj.", ".wq_b."),
    (".kv_proj.", ".wkv."),
    (".gate_proj.", ".wgate."),
    (".o_a_proj.", ".wo_a."),
    (".o_b_proj.", ".wo_b."),
    (".compressor.kv_norm.", ".compressor.norm."),
    (".attn.sinks.", ".attn.attn_sink."),
    (".position_bias.", ".ape."),
    (".gate.e_score_correction_bias.", ".gate.bias."),
    (".hc_head.hc_fn.", ".hc_head.fn."),
    (".hc_head.hc_base.", ".hc_head.base."),
    (".hc_head.hc_scale.", ".hc_head.scale."),
]
_HC_RE = re.compile(r"(^|\.)hc_(attn|ffn|head)_(fn|base|scale)$")
_EXPERT_RE = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale|weight_scale_inv)$")


def is_hf_name(name: str) -> bool:
    return name.startswith("model.") or name.startswith("lm_head.")


def to_internal(name: str) -> str | None:
    """Checkpoint name (either scheme) -> module name; ``None`` for tensors that are deliberately not loaded (the
    MTP's copies of the shared embedding / head)."""
    if is_hf_name(name):
        if name == "lm_head.weight":
            return "head.weight"
        n = "." + name[len("model."):] + "."
        n = n.replace(".embed_tokens.", ".embed.")
        for a, b in _HF_SUBS:
            n = n.replace(a, b)
        return n[1:-1]
    if re.match(r"^mtp\.\d+\.(emb\.tok_emb|head)\.", name):
        return None
    return _HC_RE.sub(lambda m: f"{m.group(1)}hc_{m.group(2)}.{m.group(3)}", name)


def to_deepseek(name: str) -> str:
    """Module name -> DeepSeek checkpoint name (stacked experts stay stacked; ``save_checkpoint`` splits them)."""
    return re.sub(r"(^|\.)hc_(attn|ffn|head)\.(fn|base|scale)$", lambda m: f"{m.group(1)}hc_{m.group(2)}_{m.group(3)}",
                  name)


# ---- dtype handling ---------------------------------------------------------------------------------------------
_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}
_FP4 = {getattr(torch, n) for n in ("float4_e2m1fn_x2",) if hasattr(torch, n)}


def _scale_of(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    stem = name[: -len(".weight")] if name.endswith(".weight") else name
    for s in (stem + ".scale", stem + ".weight_scale_inv", name + "_scale_inv"):
        if s in tensors:
            return tensors[s]
    return None


def dequantize(name: str, w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if w.dtype in _FP4 or (w.dtype in (torch.int8, torch.uint8) and scale is not None):
        raise CheckpointError(f"{name}: FP4 (e2m1-packed) weights are not supported yet; convert the experts to "
                              f"FP8/BF16 first")
    if w.dtype in _FP8:
        if scale is None:
            raise CheckpointError(f"{name}: FP8 tensor without a block scale (.scale / .weight_scale_inv)")
        if w.dim() != 2 or scale.dim() != 2:
            raise CheckpointError(f"{name}: FP8 dequantisation expects 2-D weight and scale")
        b0 = -(-w.shape[0] // scale.shape[0])
        b1 = -(-w.shape[1] // scale.shape[1])
        if -(-w.shape[0] // b0) != scale.shape[0] or -(-w.shape[1] // b1) != scale.shape[1]:
            raise CheckpointError(f"{name}: scale shape {tuple(scale.shape)} does not tile weight {tuple(w.shape)}")
        s = scale.float().repeat_interleave(b0, 0)[: w.shape[0]].repeat_interleave(b1, 1)[:, : w.shape[1]]
        return (w.float() * s).to(dtype)
    return w.to(dtype) if w.is_floating_point() else w


# ---- loading ----------------------------------------------------------------------------------------------------
def convert_state(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                  num_experts: int | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (either naming) -> module-named, dequantised, experts stacked."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name.endswith(".scale") or name.endswith("_scale_inv"):
            stem = name[: name.rindex(".")]
            if any(k in tensors for k in (stem + ".weight", stem)) and not _HC_RE.search(name):
                continue  # consumed with its weight
        if name.endswith("_scale_inv"):
            continue
        m = _EXPERT_RE.match(name)
        if m:
            w = dequantize(name, t, _scale_of(tensors, name), dtype)
            experts.setdefault(to_internal(f"{m.group(1)}.{m.group(3)}"), {})[int(m.group(2))] = w
            continue
        new = to_internal(name)
        if new is None:
            continue
        if new.endswith(".ffn.experts.gate_up_proj"):  # HF: [E, 2I, D] = cat(w1, w3)
            w = dequantize(name, t, None, dtype)
            half = w.shape[1] // 2
            base = new[: -len("gate_up_proj")]
            out[base + "w1"], out[base + "w3"] = w[:, :half].contiguous(), w[:, half:].contiguous()
            continue
        if new.endswith(".ffn.experts.down_proj"):
            out[new[: -len("down_proj")] + "w2"] = dequantize(name, t, None, dtype)
            continue
        out[new] = dequantize(name, t, _scale_of(tensors, name), dtype)
    for stem, per in experts.items():
        n = max(per) + 1
        missing = [i for i in range(num_experts or n) if i not in per]
        if missing:
            raise CheckpointError(f"{stem}: missing experts {missing[:8]}{'...' if len(missing) > 8 else ''}")
        out[stem] = torch.stack([per[i] for i in range(n)])
    return out


def load_state(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32,
               strict: bool = True) -> None:
    """Copy checkpoint tensors into ``model``. Missing or mis-shaped tensors raise ``CheckpointError`` naming them;
    ``mtp.*`` tensors are skipped when the model has no MTP layer."""
    state = convert_state(tensors, dtype, getattr(getattr(model, "cfg", None), "n_routed_experts", None))
    own = dict(model.state_dict())
    has_mtp = any(k.startswith("mtp.") for k in own)
    unexpected = [k for k in state if k not in own and not (k.startswith("mtp.") and not has_mtp)]
    missing = [k for k in own if k not in state]
    problems = []
    if missing:
        problems.append(f"missing tensors (module names; DeepSeek names: {[to_deepseek(k) for k in missing[:6]]}"
                        f"): {missing[:12]}{' ...' if len(missing) > 12 else ''}")
    if unexpected and strict:
        problems.append(f"unexpected tensors: {unexpected[:12]}{' ...' if len(unexpected) > 12 else ''}")
    for k, v in state.items():
        if k in own and tuple(own[k].shape) != tuple(v.shape):
            problems.append(f"{k} ({to_deepseek(k)}): shape {tuple(v.shape)} in checkpoint, model expects "
                            f"{tuple(own[k].shape)}")
    if problems:
        raise CheckpointError("cannot load DeepSeek-V4 checkpoint:\n  " + "\n  ".join(problems))
    with torch.no_grad():
        for k, v in state.items():
            if k in own:
                own[k].copy_(v.to(own[k].dtype))


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else [path]
    if not files:
        raise CheckpointError(f"no *.safetensors under {path}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


def load_model(path: str, with_mtp: bool = True, dtype: torch.dtype = torch.float32):
    """Config (``config.json``, either layout) + weights (all ``*.safetensors``) -> ``DSV4Model`` in eval mode."""
    from .model import DSV4Model
    cfg = DSV4Config.from_pretrained(path)
    tensors = read_safetensors(path)
    with_mtp = with_mtp and any(k.startswith("mtp.") for k in tensors)
    model = DSV4Model(cfg, with_mtp=with_mtp).to(dtype)
    load_state(model, tensors, dtype)
    return model.eval()


def deepseek_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Module state -> DeepSeek checkpoint names (per-expert tensors, ``hc_*_fn`` names)."""
    out = {}
    for k, v in model.state_dict().items():
        m = re.match(r"^(.*\.ffn\.experts)\.(w[123])$", k)
        if m:
            for e in range(v.shape[0]):
                out[f"{m.group(1)}.{e}.{m.group(2)}.weight"] = v[e].contiguous()
        else:
            out[to_deepseek(k)] = v.contiguous()
    return out


def save_checkpoint(model: torch.nn.Module, path: str) -> None:
    """DeepSeek naming + DeepSeek ``config.json``."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    save_file(deepseek_state(model), os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.cfg.to_deepseek_dict(), f, indent=1)


__all__ = ["load_model", "load_state", "convert_state", "save_checkpoint", "deepseek_state",
                          "read_safetensors", "to_internal", "to_deepseek", "CheckpointError", "dequantize"]
