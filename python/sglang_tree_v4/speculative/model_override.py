"""Make SGLang build our DeepSeek-V4 for V4 checkpoints (on a CPU always; on a GPU when TREE_V4 is selected).

Four hooks: where SGLang parses a checkpoint's config, a V4 config is replaced by a plain config that names our
architecture and asks for the hybrid sliding-window KV pool our state lives in, with the checkpoint's own config
kept for our model; our class is put in SGLang's model registry under that name; and where SGLang picks its KV
pool class it gets ours, whose layers each have their own width and whose entry layers have a row per block and
the tree scratch (``serving.sglang_pool``; the scratch is sized by the running-request capacity SGLang builds the
pools with, which the fourth hook notes). With the architecture
renamed, none of SGLang's own DeepSeek-V4 special cases (its CUDA-only pool, backend and the topk == 1 assertion)
fire.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

PARSE_TARGET = "sglang.srt.utils.hf_transformers.config.HfModelConfigParser.parse"
ARCH_TARGET = "sglang.srt.model_loader.utils.get_model_architecture"
CHAT_TARGET = "sglang.srt.entrypoints.openai.chat_encoding.resolve_chat_encoding_spec"
POOL_TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_kv_pool_class"
POOL_SIZES_TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool"
KV_DTYPE_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.configure_kv_cache_dtype"
_max_requests: dict[int, int | None] = {}  # configurator -> running-request capacity, while it builds its pool
OWN_MODEL_ENV = "SGLANG_TREE_V4_OWN_MODEL"


def use_own_model() -> bool:
    """Ours on a CPU-only machine, or wherever TREE_V4 was asked for (flag set while resolving its arguments)."""
    from ..cpu import cpu_only_machine

    return (os.environ.get(OWN_MODEL_ENV) == "1" or "TREE_V4" in sys.argv or cpu_only_machine())


def torch_itemsize(raw: dict) -> int:
    """Bytes per element of the checkpoint's ``torch_dtype`` (the pool's dtype until the server says otherwise)."""
    return {"bfloat16": 2, "float16": 2}.get(str(raw.get("torch_dtype", "float32")).replace("torch.", ""), 4)


def sglang_config(raw: dict, entry_format: str | None = None, itemsize: int = 1):
    """The config SGLang sizes its pools and tokenizer from; ``raw`` travels along for our model. With fp8 entries
    (``entry_format``) the full sub-pool's ``head_dim`` is their bytes in columns of ``itemsize`` bytes (the
    server learns both later and sets it then, ``entry_dtype``)."""
    from transformers import PretrainedConfig

    from ..dsv4.config import DSV4Config
    from ..serving import sglang_pool as sp
    from ..serving.sglang_model import ARCHITECTURE, RAW_CONFIG_ATTR

    cfg = DSV4Config.from_dict(raw)
    window, token = sp.window_layer_widths(cfg), sp.token_layer_widths(cfg)
    config = PretrainedConfig(
        architectures=[ARCHITECTURE], vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=len(window) + len(token), num_attention_heads=cfg.num_heads, num_key_value_heads=1,
        head_dim=sp.pool_head_dim(sp.token_columns_per_slot(cfg, entry_format, itemsize)), v_head_dim=sp.V_COLUMNS,
        swa_head_dim=sp.swa_head_dim(cfg, sp.state_page_size(cfg), 1, itemsize if entry_format else
                                     torch_itemsize(raw), entry_format), swa_v_head_dim=sp.V_COLUMNS,
        swa_num_key_value_heads=1,
        is_hybrid_swa=True, hybrid_layer_pattern=[1] * len(window) + [0] * len(token),
        sliding_window=sp.retained_window(cfg),
        max_position_embeddings=raw.get("max_position_embeddings", cfg.max_position_embeddings),
        bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"),
        tie_word_embeddings=False, torch_dtype=raw.get("torch_dtype", "float32"))
    setattr(config, RAW_CONFIG_ATTR, raw)
    return config


def around_parse(original, parser, model, *args, **kwargs):
    """AROUND hook on ``HfModelConfigParser.parse(self, model, ...)``: V4 checkpoints never reach transformers'
    config class (which only knows ratios 4 and 128 in DeepSeek's layout) when our model serves them."""
    from ..dsv4.config import is_deepseek_v4, read_checkpoint_config

    raw = read_checkpoint_config(model)
    if not is_deepseek_v4(raw) or not use_own_model():
        return original(parser, model, *args, **kwargs)
    config = sglang_config(raw)
    config._name_or_path = str(model)
    return config


def before_get_architecture(model_config, *args, **kwargs):
    """BEFORE hook on ``get_model_architecture``: register our class under our architecture name."""
    from sglang.srt.models.registry import ModelRegistry

    from ..serving.sglang_model import ARCHITECTURE, TreeV4DeepseekV4ForCausalLM

    if ModelRegistry.models.get(ARCHITECTURE) is not TreeV4DeepseekV4ForCausalLM:
        ModelRegistry.models[ARCHITECTURE] = TreeV4DeepseekV4ForCausalLM
    return None


def chat_encoding(original, *args, **kwargs):
    """AROUND hook on ``resolve_chat_encoding_spec``: a V4 checkpoint served by our model uses its own chat
    template when it ships one (the embedded model does), else DeepSeek's V4 encoder as stock SGLang would."""
    from ..serving.sglang_model import ARCHITECTURE

    hf_config, tokenizer = kwargs.get("hf_config"), kwargs.get("tokenizer")
    architecture = (getattr(hf_config, "architectures", None) or [None])[0]
    if architecture == ARCHITECTURE and kwargs.get("tool_call_parser") is None:
        return None if getattr(tokenizer, "chat_template", None) else "dsv4"
    return original(*args, **kwargs)


def state_pool(original, configurator, *args, **kwargs):
    """AROUND hook on ``KVCacheConfigurator._resolve_kv_pool_class(kind=...)``: for our model's MHA pools (both
    halves of the hybrid pool), the pool whose layers each have their own width."""
    from ..dsv4.config import DSV4Config
    from ..dsv4.dspark import block_size_of
    from ..serving.sglang_model import ENTRY_FORMAT_ATTR, RAW_CONFIG_ATTR
    from ..serving.sglang_pool import (
        model_state_pool_class,
        scratch_rows_of,
        verify_tokens_of,
    )

    raw = getattr(getattr(configurator.model_config, "hf_config", None), RAW_CONFIG_ATTR, None)
    if raw is None or kwargs.get("kind") != "mha":
        return original(configurator, *args, **kwargs)
    server_args = getattr(configurator, "server_args", None)
    scratch, mtp_scratch = scratch_rows_of(server_args, _max_requests.get(id(configurator)), block_size_of(raw))
    entry_format = getattr(configurator.model_config.hf_config, ENTRY_FORMAT_ATTR, None)
    return model_state_pool_class(DSV4Config.from_dict(raw), scratch, entry_format, mtp_scratch,
                                  verify_tokens_of(server_args))


def entry_dtype(original, runner, *args, **kwargs):
    """AROUND hook on ``ModelRunner.configure_kv_cache_dtype``: with ``--kv-cache-dtype fp8_e4m3`` our model keeps
    its compressed entries and its target layers' window keys as upstream's fp8 bytes (``entry_codec.entry_codecs``)
    and everything else -- compressor rows and states, the MTP's keys and streams -- in their own dtypes. So SGLang
    builds and sizes a pool of the model's dtype whose entry layers are as wide, in that dtype, as the fp8 bytes (the
    full sub-pool's ``head_dim``; the window sub-pool's likewise, below), and our pool class makes those layers
    uint8. Any other 8- or 4-bit KV dtype stops the server naming the flag.
    Here, where the page size, TREE_V4's D and the pool's dtype are known, the window sub-pool's ``head_dim`` also
    gets the compressor ring's share (``sglang_pool.swa_head_dim``)."""
    import torch

    from ..dsv4.config import DSV4Config
    from ..serving import sglang_pool as sp
    from ..serving.sglang_model import ENTRY_FORMAT_ATTR, RAW_CONFIG_ATTR

    out = original(runner, *args, **kwargs)
    hf_config = getattr(runner.model_config, "hf_config", None)
    raw = getattr(hf_config, RAW_CONFIG_ATTR, None)
    if raw is None:
        return out
    cfg = DSV4Config.from_dict(raw)
    kv, entry_format = runner.kv_cache_dtype, None
    if kv.itemsize == 1 or "float4" in str(kv):
        if kv != torch.float8_e4m3fn:
            raise ValueError(f"--kv-cache-dtype {getattr(runner.server_args, 'kv_cache_dtype', kv)}: DeepSeek-V4 "
                             "served by sglang-tree-v4 keeps its state in the model's dtype or bfloat16, or its "
                             "compressed entries and window keys in fp8_e4m3")
        entry_format = "fp8_e4m3"
        runner.kv_cache_dtype, runner.kv_cache_dtype_str = runner.dtype, "auto"
        runner.model_config.head_dim = sp.pool_head_dim(
            sp.token_columns_per_slot(cfg, entry_format, runner.dtype.itemsize))
        logger.info("TREE_V4 DeepSeek-V4 state: compressed entries and window keys as %s, compressor rows and "
                    "the MTP's rows in %s", entry_format, runner.dtype)
    setattr(hf_config, ENTRY_FORMAT_ATTR, entry_format)
    # the window sub-pool's width with the compressor ring the server will build, in its dtype's columns
    runner.model_config.swa_head_dim = sp.swa_head_dim(cfg, runner.server_args.page_size or sp.state_page_size(cfg),
                                                       sp.verify_tokens_of(runner.server_args),
                                                       runner.kv_cache_dtype.itemsize, entry_format)
    return out


def remember_pool_sizes(original, configurator, *args, **kwargs):
    """AROUND hook on ``KVCacheConfigurator._build_token_to_kv_pool(sizes=...)``: the running-request capacity it
    sizes the pools with (``--max-running-requests`` may still be unset in the server arguments), for the tree
    scratch of our pool class."""
    _max_requests[id(configurator)] = getattr(kwargs.get("sizes"), "max_running_requests", None)
    try:
        return original(configurator, *args, **kwargs)
    finally:
        _max_requests.pop(id(configurator), None)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(PARSE_TARGET, around_parse, HookType.AROUND)
    HookRegistry.register(ARCH_TARGET, before_get_architecture, HookType.BEFORE)
    HookRegistry.register(CHAT_TARGET, chat_encoding, HookType.AROUND)
    HookRegistry.register(POOL_TARGET, state_pool, HookType.AROUND)
    HookRegistry.register(POOL_SIZES_TARGET, remember_pool_sizes, HookType.AROUND)
    HookRegistry.register(KV_DTYPE_TARGET, entry_dtype, HookType.AROUND)
