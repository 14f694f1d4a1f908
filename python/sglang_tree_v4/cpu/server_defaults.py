"""CPU defaults for SGLang's server arguments, applied only where the user gave no value.

Without a GPU, SGLang sizes the KV pool as a fraction of the machine's RAM: on a 24 GiB machine
that is ~15 GiB and ~30 s of allocation for a model of a few MB. A fixed token budget is the
sensible default on a CPU; ``--max-total-tokens`` still overrides it.
"""

from __future__ import annotations

TARGET = "sglang.srt.server_args.ServerArgs.resolve_once"
DEFAULT_MAX_TOTAL_TOKENS = 65536


def apply_cpu_defaults(original, self, *args, **kwargs):
    """AROUND hook on ``ServerArgs.resolve_once``: fill CPU defaults, then resolve as usual."""
    if not getattr(self, "_resolution_finished", False) and self.max_total_tokens is None:
        self.max_total_tokens = DEFAULT_MAX_TOTAL_TOKENS
    return original(self, *args, **kwargs)
