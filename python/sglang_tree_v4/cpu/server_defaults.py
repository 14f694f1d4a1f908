"""CPU defaults for SGLang's server arguments, applied only where the user gave no value.

Without a GPU, SGLang sizes the KV pool as a fraction of the machine's RAM: on a 24 GiB machine
that is ~15 GiB and ~30 s of allocation for a model of a few MB. A fixed token budget is the
sensible default on a CPU; ``--max-total-tokens`` still overrides it. Our DeepSeek-V4 runs in float32 on a CPU
(half precision is slow there and the losslessness tests compare against float32 references); ``--dtype`` still
overrides it.
"""

from __future__ import annotations

import json
import os

TARGET = "sglang.srt.server_args.ServerArgs.resolve_once"
DEFAULT_MAX_TOTAL_TOKENS = 65536


def apply_cpu_defaults(original, self, *args, **kwargs):
    """AROUND hook on ``ServerArgs.resolve_once``: fill CPU defaults, then resolve as usual."""
    if not getattr(self, "_resolution_finished", False):
        if self.max_total_tokens is None:
            self.max_total_tokens = DEFAULT_MAX_TOTAL_TOKENS
        if self.dtype == "auto" and _is_deepseek_v4(self.model_path):
            self.dtype = "float32"
    return original(self, *args, **kwargs)


def _is_deepseek_v4(model_path: str) -> bool:
    path = os.path.join(str(model_path), "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return json.load(f).get("model_type") == "deepseek_v4"
