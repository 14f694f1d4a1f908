"""The swap-the-linears step: turn the plain model into the one the checkpoint's quantization describes.

The model code (``model``, ``attention``, ``moe``) is written once in plain ``nn.Linear`` / stacked float experts.
``build_model`` constructs it on the meta device (no memory), swaps in kept-quantized modules where the checkpoint's
``config.json`` declares them, and only then allocates, so a 160 GB FP4/FP8 checkpoint never exists as floats:

* ``quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128]}`` -> the attention
  projections (``wq_a, wq_b, wkv, wo_a, wo_b``), the indexer's ``wq_b``, the shared experts and the MTP's
  ``e_proj / h_proj`` become ``FP8BlockLinear`` (what DeepSeek publishes in FP8; compressors, gate, embedding and
  head stay dense, as published);
* ``expert_dtype: fp4`` -> every routed-expert stack becomes ``FP4Experts``.

Anything else quantized in a checkpoint (e.g. FP8 experts) is dequantised on load into the dense module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from sgl_kernel_ext.weight_formats import FP8_BLOCK

from ..dsv4.config import ConfigError, DSV4Config
from ..dsv4.moe import Experts
from ..dsv4.rope import ropes_for
from .quantized_modules import FP4Experts, FP8BlockLinear

FP8_LINEARS = re.compile(r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]"
                         r"|e_proj|h_proj|main_proj)$")


@dataclass(frozen=True)
class Quantization:
    fp8_linears: bool = False
    fp4_experts: bool = False

    @classmethod
    def from_config(cls, raw: Mapping[str, Any] | None) -> "Quantization":
        """Read (and check) what a raw ``config.json`` declares; errors name the key."""
        raw = raw or {}
        qc = raw.get("quantization_config") or {}
        fp8 = False
        if qc:
            method = qc.get("quant_method")
            if method != "fp8":
                raise ConfigError(f"quantization_config.quant_method: only DeepSeek's fp8 is supported, got {method!r}")
            if qc.get("fmt", "e4m3") != "e4m3":
                raise ConfigError(f"quantization_config.fmt: expected e4m3, got {qc.get('fmt')!r}")
            block = list(qc.get("weight_block_size") or [FP8_BLOCK, FP8_BLOCK])
            if block != [FP8_BLOCK, FP8_BLOCK]:
                raise ConfigError(f"quantization_config.weight_block_size: expected [128, 128], got {block}")
            fp8 = True
        expert = raw.get("expert_dtype")
        if expert not in (None, "fp4", "fp8", "bf16", "bfloat16"):
            raise ConfigError(f"expert_dtype: expected fp4 / fp8 / bf16, got {expert!r}")
        return cls(fp8_linears=fp8, fp4_experts=expert == "fp4")


def swap_quantized(model: nn.Module, q: Quantization) -> nn.Module:
    """Replace the modules ``q`` keeps quantized (in place, on the modules' own device, typically meta)."""
    for name, module in list(model.named_modules()):
        if not name:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        device = next(module.parameters(), torch.empty(0)).device
        if q.fp8_linears and isinstance(module, nn.Linear) and FP8_LINEARS.search(name):
            setattr(parent, child, FP8BlockLinear(module.in_features, module.out_features, device=device))
        elif q.fp4_experts and type(module) is Experts:
            n, inter, dim = module.w1.shape
            setattr(parent, child, FP4Experts(n, dim, inter, module.limit, device=device))
    return model


def build_model(cfg: DSV4Config, raw_config: Mapping[str, Any] | None = None, with_mtp: bool = True,
                dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                shard: Callable[[nn.Module], Any] | None = None) -> nn.Module:
    """``DSV4Model`` with the checkpoint's quantization, parameters allocated (uninitialised) on ``device``
    (default: torch's current default device; ``"meta"`` to only measure it). ``shard``: a second swap step run on
    the meta model before anything is allocated (``tp.shard_model``: this rank's share of every module)."""
    from ..dsv4.dspark import DSparkConfig
    from ..dsv4.model import DSV4Model
    device = torch.device(device) if device is not None else torch.get_default_device()
    dspark = DSparkConfig.from_dict(raw_config or {}, cfg.num_layers, cfg.vocab_size)
    with torch.device("meta"):
        model = DSV4Model(cfg, with_mtp=with_mtp, dspark=dspark)
    swap_quantized(model, Quantization.from_config(raw_config))
    if shard is not None:
        shard(model)
    for t in list(model.parameters()) + list(model.buffers()):  # dense weights in the serving dtype
        if t.dtype in (torch.float32, torch.float16, torch.bfloat16) and t.dtype != dtype:
            t.data = torch.empty_like(t, dtype=dtype)
    if device.type != "meta":
        model.to_empty(device=device)
        with torch.device(device):
            model.ropes = ropes_for(cfg)  # computed tables, not parameters: rebuild off the meta device
    return model


def parameter_bytes(model: torch.nn.Module) -> dict:
    """Bytes of every parameter and buffer, in total and by dtype (works on meta tensors)."""
    by_dtype: dict[str, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        key = str(t.dtype).replace("torch.", "")
        by_dtype[key] = by_dtype.get(key, 0) + t.numel() * t.element_size()
    return {"param_bytes_per_rank": sum(by_dtype.values()), "param_bytes_by_dtype": dict(sorted(by_dtype.items()))}
