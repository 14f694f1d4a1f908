"""Checkpoint loading: DeepSeek naming (the published checkpoints, incl. ``mtp.*``) and HF transformers naming.

Each tensor name is translated on its own (so a file may mix both: HF-named main model + DeepSeek-named ``mtp.*``)
into this package's module names, which follow DeepSeek's except that routed experts are stacked
(``ffn.experts.w1 [E, I, D]``) and hyper-connection triples are submodules (``hc_attn.fn`` for ``hc_attn_fn``).

Quantized weights (FP8 e4m3 with a block scale ``<name>.scale`` / ``<name>.weight_scale_inv``; FP4 e2m1 packed
experts with per-32 scales) are copied as stored into modules the config keeps quantized (``quantize``), and
dequantised on load into dense modules otherwise. ``save_published`` writes DeepSeek's published layout.
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import Mapping

import torch

from sgl_kernel_ext.weight_formats import (
    FP4_GROUP,
    dequantize_fp4,
    e8m0_bytes,
    e8m0_to_float,
)

from ..dsv4.config import DSV4Config, read_checkpoint_config


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


# transformers 5.19's ``save_pretrained`` writes ``model.`` + DeepSeek's inner names, except the attention's
# kv_norm, which it calls ``attn.norm`` (the compressors' ``compressor.norm`` is DeepSeek's own name).
_SAVED_KV_NORM_RE = re.compile(r"^((?:layers|mtp)\.\d+\.attn)\.norm\.weight$")


def to_internal(name: str) -> str | None:
    """Checkpoint name (any scheme: DeepSeek's, transformers' in memory, transformers' ``save_pretrained``) ->
    module name; ``None`` for tensors that are deliberately not loaded (the MTP's copies of the shared embedding /
    head)."""
    if is_hf_name(name):
        if name == "lm_head.weight":
            return "head.weight"
        n = "." + name[len("model."):] + "."
        n = n.replace(".embed_tokens.", ".embed.")
        for a, b in _HF_SUBS:
            n = n.replace(a, b)
        name = _SAVED_KV_NORM_RE.sub(r"\1.kv_norm.weight", n[1:-1])
    if re.match(r"^mtp\.\d+\.(emb\.tok_emb|head)\.", name):
        return None
    return _HC_RE.sub(lambda m: f"{m.group(1)}hc_{m.group(2)}.{m.group(3)}", name)


def to_deepseek(name: str) -> str:
    """Module name -> DeepSeek checkpoint name (stacked experts stay stacked; ``save_checkpoint`` splits them).
    DSpark's stages are published as ``mtp.{s}.*``, heads included (``dsv4.dspark``)."""
    name = re.sub(r"^dspark\.stages\.", "mtp.", name)
    return re.sub(r"(^|\.)hc_(attn|ffn|head)\.(fn|base|scale)$", lambda m: f"{m.group(1)}hc_{m.group(2)}_{m.group(3)}",
                  name)


# ---- dtype handling ---------------------------------------------------------------------------------------------
_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}
_PACKED = (torch.int8, torch.uint8)
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_FILE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                "F8_E8M0": getattr(torch, "float8_e8m0fnu", torch.uint8)}


# A checkpoint tensor arrives either read (``torch.Tensor``) or as a safetensors slice handle that reads from disk
# only the part that is indexed; these three answer for both.
def _dtype(t) -> torch.dtype:
    return t.dtype if isinstance(t, torch.Tensor) else _FILE_DTYPES[t.get_dtype()]


def _shape(t) -> tuple[int, ...]:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t.get_shape())


def _whole(t) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t[...]


def dequantize(name: str, w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor as a dense ``dtype`` tensor: FP8 with its block scale (any block size that tiles the
    weight), FP4-packed with its per-32 scale, or a plain cast."""
    if w.dtype in _PACKED and scale is not None:
        if (w.dim() != 2 or scale.dim() != 2 or scale.shape[0] != w.shape[0]
                or scale.shape[1] * FP4_GROUP != 2 * w.shape[1]):
            raise CheckpointError(f"{name}: FP4 weight {tuple(w.shape)} (two values per byte) and scale "
                                  f"{tuple(scale.shape)} do not match (expected [out, in/{FP4_GROUP}])")
        return dequantize_fp4(w, scale).to(dtype)
    if w.dtype in _FP8:
        if scale is None:
            raise CheckpointError(f"{name}: FP8 tensor without a block scale (.scale / .weight_scale_inv)")
        if w.dim() != 2 or scale.dim() != 2:
            raise CheckpointError(f"{name}: FP8 dequantisation expects 2-D weight and scale")
        b0 = -(-w.shape[0] // scale.shape[0])
        b1 = -(-w.shape[1] // scale.shape[1])
        if -(-w.shape[0] // b0) != scale.shape[0] or -(-w.shape[1] // b1) != scale.shape[1]:
            raise CheckpointError(f"{name}: scale shape {tuple(scale.shape)} does not tile weight {tuple(w.shape)}")
        s = e8m0_to_float(scale).repeat_interleave(b0, 0)[: w.shape[0]].repeat_interleave(b1, 1)[:, : w.shape[1]]
        return (w.float() * s).to(dtype)
    return w.to(dtype) if w.is_floating_point() else w


# ---- loading ----------------------------------------------------------------------------------------------------
def _stem(name: str) -> str:
    """``x.weight`` / ``x.scale`` / ``x.weight_scale_inv`` -> ``x``."""
    for suffix in (".weight_scale_inv", ".scale", ".weight"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


class StreamingLoader:
    """Copies checkpoint tensors into a model one at a time, as they are read (a file never has to be held whole).

    A tensor-parallel rank's model carries ``shard_plan`` (``tp.shard_model``): for each sharded tensor the slice
    this rank holds. Fed safetensors slice handles (``iter_safetensors(..., lazy=True)``), the loader reads from
    disk only that slice, and never reads another rank's experts at all.

    A target that is kept quantized (``quantized_modules.FP8BlockLinear``, ``quantized_modules.FP4Experts``)
    receives the weight and
    its scale as stored; a dense target receives the dequantised weight, so a quantized weight waits here only until
    its scale arrives (a weight and its scale live in the same file). ``finish`` names what is missing, left
    unpaired or unexpected. Every check names the checkpoint tensor and what was expected."""

    def __init__(self, model: torch.nn.Module, strict: bool = True):
        self.own = dict(model.state_dict())
        self.dtype = next((v.dtype for k, v in self.own.items() if k.endswith("embed.weight")), torch.float32)
        self.has_mtp = any(k.startswith("mtp.") for k in self.own)
        self.has_dspark = any(k.startswith("dspark.") for k in self.own)
        self.strict = strict
        self.plan = getattr(model, "shard_plan", {})
        self.filled: set[str] = set()
        self.experts: dict[str, set[int]] = {}
        self.pending: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}  # stem -> {"weight"/"scale": (name, t)}
        self.unexpected: list[str] = []

    # -- routing ------------------------------------------------------------------------------------------------
    def _internal(self, name: str) -> str | None:
        """``to_internal``, with a DSpark checkpoint's ``mtp.{s}.*`` going to the drafter's stages."""
        internal = to_internal(name)
        if self.has_dspark and internal is not None and internal.startswith("mtp."):
            return "dspark.stages." + internal[len("mtp."):]
        return internal

    def feed(self, name: str, t) -> None:
        """``t``: the tensor, or a safetensors slice handle (then only this rank's part is read)."""
        internal = self._internal(name)
        if internal is None or (internal.startswith("mtp.") and not self.has_mtp):
            return  # deliberately not loaded (the MTP's copies of shared tensors; a model built without MTP)
        m = _EXPERT_RE.match(name)
        if m:
            base = self._internal(f"{m.group(1)}.{m.group(3)}")
            e = self._local_expert(base, int(m.group(2)))
            if e is None:
                return  # another rank's expert: never read
            return self._feed_expert(name, _whole(t), base, e, "weight" if m.group(4) == "weight" else "scale")
        if name.endswith(_SCALE_SUFFIXES):
            weight = self._internal(_stem(name) + ".weight")
            if weight in self.own:  # the block scale of a quantized weight (not a parameter named "scale")
                if self.own[weight].dtype in _FP8:
                    key = weight[: -len(".weight")] + ".scale"
                    return self._copy(name, key, e8m0_to_float(self._part(name, key, t)), scale=True)
                return self._pair(name, _whole(t), "scale", lambda w, sc: self._dense(w[0], w[1], sc))
        own = self.own.get(internal)
        if own is not None and own.dtype in _FP8:
            if _dtype(t) not in _FP8:
                raise CheckpointError(f"{name}: expected an FP8 e4m3 weight (the config declares FP8 linears), got "
                                      f"{_dtype(t)}")
            return self._copy(name, internal, self._part(name, internal, t))
        if _dtype(t) in _FP8 or _dtype(t) in _PACKED:
            return self._pair(name, _whole(t), "weight", lambda w, sc: self._dense(w[0], w[1], sc))
        self._dense(name, t, None)

    def _part(self, name: str, key: str, t) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``t`` for module tensor ``key`` (all of it when not sharded)."""
        shard = self.plan.get(key)
        if shard is None:
            return _whole(t)
        shape = _shape(t)
        if len(shape) <= shard.dim or shape[shard.dim] != shard.full:
            raise CheckpointError(f"{name}: wrong shape: {shape} in checkpoint, model expects {shard.full} along "
                                  f"dimension {shard.dim} (split over the tensor-parallel ranks)")
        return t[(slice(None),) * shard.dim + (slice(shard.start, shard.stop),)]

    def _local_expert(self, base: str, e: int) -> int | None:
        shard = self.plan.get(base)
        if shard is None:
            return e
        return e - shard.start if shard.start <= e < shard.stop else None

    def _feed_expert(self, name: str, t: torch.Tensor, base: str, e: int, part: str) -> None:
        own = self.own.get(base)
        if own is None:
            return self._unexpected(base)
        if own.dtype == torch.uint8:  # FP4Experts: bytes as stored
            if part == "weight" and t.dtype not in _PACKED:
                raise CheckpointError(f"{name}: the config declares FP4 experts (expert_dtype fp4), got {t.dtype}")
            key = base if part == "weight" else base + "_scale"
            self._check_slice(name, key, self.own[key][e], t, packed=True)
            self.own[key][e].copy_(t.view(torch.uint8) if part == "weight" else e8m0_bytes(t))
            self.experts.setdefault(key, set()).add(e)
            return
        if part == "weight" and t.dtype not in _FP8 and t.dtype not in _PACKED:
            return self._expert_copy(name, base, e, dequantize(name, t, None, self.dtype))
        self._pair(name, t, part, lambda w, sc: self._expert_copy(w[0], base, e, dequantize(w[0], w[1], sc,
                                                                                              self.dtype)))

    def _pair(self, name: str, t: torch.Tensor, part: str, done) -> None:
        """Hold a quantized weight or its scale until the other arrives, then ``done((name, weight), scale)``."""
        slot = self.pending.setdefault(_stem(name), {})
        slot[part] = (name, t)
        if "weight" in slot and "scale" in slot:
            del self.pending[_stem(name)]
            done(slot["weight"], slot["scale"][1])

    def _expert_copy(self, name: str, base: str, e: int, w: torch.Tensor) -> None:
        own = self.own[base]
        self._check_slice(name, base, own[e], w)
        own[e].copy_(w.to(own.dtype))
        self.experts.setdefault(base, set()).add(e)

    @staticmethod
    def _check_slice(name: str, key: str, own: torch.Tensor, t: torch.Tensor, packed: bool = False) -> None:
        if tuple(own.shape) != tuple(t.shape):
            what = "scale does not tile its weight" if key.endswith(("scale", "_scale")) else "wrong shape"
            raise CheckpointError(f"{name}: {what}: shape {tuple(t.shape)} in checkpoint, model expects "
                                  f"{tuple(own.shape)}" + (" (FP4: two values per byte)" if packed else ""))

    def _dense(self, name: str, t, scale: torch.Tensor | None) -> None:
        base = self._internal(name)
        if base.endswith(".ffn.experts.gate_up_proj"):  # HF in memory: [E, 2I, D] = cat(w1, w3)
            stem = base[: -len("gate_up_proj")]
            w = dequantize(name, self._part(name, stem + "w1", t), None, self.dtype)
            half = w.shape[1] // 2
            self._copy(name, stem + "w1", w[:, :half])
            self._copy(name, stem + "w3", w[:, half:])
        elif base.endswith(".ffn.experts.down_proj"):
            key = base[: -len("down_proj")] + "w2"
            self._copy(name, key, dequantize(name, self._part(name, key, t), None, self.dtype))
        elif scale is None:
            self._copy(name, base, dequantize(name, self._part(name, base, t), None, self.dtype))
        else:  # quantized where the config keeps it dense: dequantised whole, then this rank's part
            self._copy(name, base, self._part(name, base, dequantize(name, t, scale, self.dtype)))

    def _copy(self, name: str, key: str, w: torch.Tensor, scale: bool = False) -> None:
        own = self.own.get(key)
        if own is None:
            return self._unexpected(key)
        shard = self.plan.get(key)
        if shard is not None and own.shape[shard.dim] > shard.stop - shard.start == w.shape[shard.dim]:
            own.zero_()  # vocabulary padding past the last real row
            own = own.narrow(shard.dim, 0, w.shape[shard.dim])
        if tuple(own.shape) != tuple(w.shape):
            what = "scale does not tile its weight: " if scale else ""
            raise CheckpointError(f"{name} ({key}): {what}shape {tuple(w.shape)} in checkpoint, model expects "
                                  f"{tuple(own.shape)}")
        own.copy_(w.to(own.dtype) if own.is_floating_point() else w)
        self.filled.add(key)

    def _unexpected(self, key: str) -> None:
        if not (key.startswith("mtp.") and not self.has_mtp):
            self.unexpected.append(key)

    def forget(self, prefix: str) -> None:
        """Stop expecting the model's tensors under ``prefix`` (a layer the checkpoint turned out not to have)."""
        self.own = {k: v for k, v in self.own.items() if not k.startswith(prefix)}
        self.experts = {k: v for k, v in self.experts.items() if not k.startswith(prefix)}
        self.has_mtp = any(k.startswith("mtp.") for k in self.own)

    # -- the end ------------------------------------------------------------------------------------------------
    def missing(self) -> list[str]:
        out = []
        for k, v in self.own.items():
            if k in self.experts:
                lost = [i for i in range(v.shape[0]) if i not in self.experts[k]]
                if lost:
                    out.append(f"{k}: missing experts {lost[:8]}{'...' if len(lost) > 8 else ''}")
            elif k not in self.filled:
                out.append(k)
        return out

    def finish(self) -> None:
        problems = []
        for _stem, parts in self.pending.items():
            have = ", ".join(n for n, _ in parts.values())
            problems.append(f"{have}: quantized weight and scale must come in pairs (got only this)")
        missing = self.missing()
        if missing:
            problems.append(f"missing tensors (module names; DeepSeek names: "
                            f"{[to_deepseek(k.split(':')[0]) for k in missing[:6]]}): "
                            f"{missing[:12]}{' ...' if len(missing) > 12 else ''}")
        if self.unexpected and self.strict:
            problems.append(f"unexpected tensors: {self.unexpected[:12]}{' ...' if len(self.unexpected) > 12 else ''}")
        if problems:
            raise CheckpointError("cannot load DeepSeek-V4 checkpoint:\n  " + "\n  ".join(problems))


def load_state(model: torch.nn.Module, tensors, dtype: torch.dtype | None = None, strict: bool = True) -> None:
    """Copy checkpoint tensors (a mapping, or an iterable of ``(name, tensor)`` as SGLang's loader streams them)
    into ``model``. Missing, mis-shaped, mis-typed or unpaired tensors raise ``CheckpointError`` naming them;
    ``mtp.*`` tensors are skipped when the model has no MTP layer."""
    loader = StreamingLoader(model, strict)
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    with torch.no_grad():
        for name, t in items:
            loader.feed(name, t)
    loader.finish()


def _safetensors_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else [path]
    if not files:
        raise CheckpointError(f"no *.safetensors under {path}")
    return files


def iter_safetensors(path: str, lazy: bool = False):
    """``(name, tensor)`` of every ``*.safetensors`` file under ``path``, one tensor at a time (``safe_open``);
    ``lazy``: a slice handle instead of the tensor, valid until the next item (read only what is indexed)."""
    from safetensors import safe_open
    for f in _safetensors_files(path):
        with safe_open(f, "pt") as handle:
            for name in handle.keys():
                yield name, (handle.get_slice(name) if lazy else handle.get_tensor(name))


def checkpoint_names(path: str) -> list[str]:
    """Tensor names of a checkpoint, from the file headers only."""
    from safetensors import safe_open
    names = []
    for f in _safetensors_files(path):
        with safe_open(f, "pt") as handle:
            names += list(handle.keys())
    return names


def load_model(path: str, with_mtp: bool = True, dtype: torch.dtype = torch.float32):
    """Config (``config.json``, either layout) + weights (all ``*.safetensors``, streamed) -> ``DSV4Model`` in eval
    mode, kept quantized where the config declares it (``swap.build_model``)."""
    from .swap import build_model
    cfg = DSV4Config.from_pretrained(path)
    with_mtp = with_mtp and any(k.startswith("mtp.") for k in checkpoint_names(path))
    model = build_model(cfg, read_checkpoint_config(path), with_mtp=with_mtp, dtype=dtype)
    load_state(model, iter_safetensors(path))
    return model.eval()


def deepseek_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Module state -> DeepSeek checkpoint names (per-expert tensors, ``hc_*_fn`` names)."""
    out = {}
    for k, v in model.state_dict().items():
        m = re.match(r"^(.*\.ffn\.experts)\.(w[123])$", k)
        if m:
            for e in range(v.shape[0]):
                out[to_deepseek(f"{m.group(1)}.{e}.{m.group(2)}.weight")] = v[e].contiguous()
        else:
            out[to_deepseek(k)] = v.contiguous()
    return out


def deepseek_config(model: torch.nn.Module) -> dict:
    """The model's DeepSeek ``config.json``, with its DSpark drafter's keys where it has one."""
    config = model.cfg.to_deepseek_dict()
    if getattr(model, "dspark", None) is not None:
        config.update(model.dspark.dcfg.to_dict())
    return config


def save_checkpoint(model: torch.nn.Module, path: str) -> None:
    """DeepSeek naming + DeepSeek ``config.json``."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    save_file(deepseek_state(model), os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(deepseek_config(model), f, indent=1)


# DeepSeek's published dtypes for the tensors that are not quantized
_FLOAT32_RE = re.compile(r"(hc_(attn|ffn|head)_(fn|base|scale)|attn_sink|\.ape|gate\.bias)$")


def save_published(model: torch.nn.Module, path: str, max_shard_bytes: int = 1 << 30) -> None:
    """Write ``model`` (dense) as DeepSeek publishes V4-Flash: DeepSeek names incl. ``mtp.0.*``; attention, indexer
    ``wq_b``, shared experts and MTP projections FP8 e4m3 with e8m0 128 x 128 block scales (``<module>.scale``);
    routed experts FP4 e2m1 packed two per byte with e8m0 per-32 scales; hyper-connections, sinks, ape and the
    gate bias float32; the rest bf16. Shards of at most ``max_shard_bytes`` (a weight and its scale stay together)
    plus ``model.safetensors.index.json``, and a DeepSeek ``config.json`` declaring the quantization."""
    from safetensors.torch import save_file

    from sgl_kernel_ext.weight_formats import quantize_fp4, quantize_fp8_block

    from .swap import FP8_LINEARS

    os.makedirs(path, exist_ok=True)
    groups: list[dict[str, torch.Tensor]] = []
    for name, t in deepseek_state(model).items():
        stem = _stem(name)
        if _EXPERT_RE.match(name):
            q, sc = quantize_fp4(t)
            groups.append({name: q, stem + ".scale": sc})
        elif name.endswith(".weight") and FP8_LINEARS.search(stem):
            q, sc = quantize_fp8_block(t)
            groups.append({name: q, stem + ".scale": sc})
        elif not t.is_floating_point():
            groups.append({name: t})
        else:
            groups.append({name: t.float() if _FLOAT32_RE.search(name) else t.to(torch.bfloat16)})
    shards, size = [[]], 0
    for g in groups:
        nbytes = sum(t.numel() * t.element_size() for t in g.values())
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(g)
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: v.contiguous() for g in shard for k, v in g.items()}
        save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({k: file for k in tensors})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    config = deepseek_config(model)
    config.update(torch_dtype="bfloat16", expert_dtype="fp4", quantization_config={
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128]})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


__all__ = ["load_model", "load_state", "StreamingLoader", "save_checkpoint", "save_published", "deepseek_state",
           "iter_safetensors", "checkpoint_names", "to_internal", "to_deepseek", "CheckpointError", "dequantize"]
