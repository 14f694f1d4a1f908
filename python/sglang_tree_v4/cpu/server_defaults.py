"""CPU defaults for SGLang's server arguments, applied only where the user gave no value.

Without a GPU, SGLang sizes the KV pool as a fraction of the machine's RAM: on a 24 GiB machine
that is ~15 GiB and ~30 s of allocation for a model of a few MB. A fixed token budget is the
sensible default on a CPU; ``--max-total-tokens`` still overrides it, and ``--mem-fraction-static`` asks for
SGLang's memory-sized pool instead. Our DeepSeek-V4 runs in float32 on a CPU
(half precision is slow there and the losslessness tests compare against float32 references); ``--dtype`` still
overrides it; its window rows get half the token budget (``--swa-full-tokens-ratio`` overrides it), and its pages
are whole compression blocks (``--page-size``: a multiple of them, else startup stops naming the flag). Idle
schedulers sleep instead of polling. Tensor parallelism on a CPU needs each rank's cores named; we split the
available ones evenly.
"""

from __future__ import annotations

import os

TARGET = "sglang.srt.server_args.ServerArgs.resolve_once"
DEFAULT_MAX_TOTAL_TOKENS = 65536
# Window rows (SGLang's SWA pool) per token slot. A request holds about a window plus SGLang's eviction interval of
# window rows, but a prefill holds them for its whole chunk until its first decode step; half the token budget
# keeps the test and benchmark loads (64 requests of a few hundred prompt tokens) admitted at once.
CPU_SWA_FULL_TOKENS_RATIO = 0.5
THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"  # SGLang's CPU tensor parallelism needs one core set per rank


def cpu_binding(ranks: int) -> str:
    """Split this process's cores into ``ranks`` contiguous groups, SGLang's ``"0-3|4-7"`` notation."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // ranks)
    groups = [cores[min(i * per, len(cores) - 1): max(min((i + 1) * per, len(cores)), i * per + 1)]
              for i in range(ranks)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def apply_cpu_defaults(original, self, *args, **kwargs):
    """AROUND hook on ``ServerArgs.resolve_once``: fill CPU defaults, then resolve as usual."""
    from ..dsv4.config import DSV4Config, is_deepseek_v4, read_checkpoint_config
    from ..serving.sglang_pool import check_page_size, is_tree_v4

    if not getattr(self, "_resolution_finished", False):
        if self.max_total_tokens is None and self.mem_fraction_static is None:  # no budget asked for
            self.max_total_tokens = DEFAULT_MAX_TOTAL_TOKENS
        # An idle scheduler busy-polls; on a CPU those cycles are taken from the model's own compute.
        self.sleep_on_idle = True
        v4 = is_deepseek_v4(read_checkpoint_config(self.model_path))
        if self.dtype == "auto" and v4:
            self.dtype = "float32"
        if v4 and self.swa_full_tokens_ratio is None:
            self.swa_full_tokens_ratio = CPU_SWA_FULL_TOKENS_RATIO
        if v4:  # pages of whole compression blocks (``serving.sglang_pool``)
            self.page_size = check_page_size(DSV4Config.from_dict(read_checkpoint_config(self.model_path)),
                                             self.page_size)
        algorithm = getattr(self, "speculative_algorithm", None)
        if v4 and algorithm and not is_tree_v4(algorithm):
            # Our model's verify forward needs the TREE_V4 worker: it commits the accepted nodes' compressed
            # entries and sizes the CSA ring for the verify block; another worker would serve wrong tokens.
            raise ValueError(f"--speculative-algorithm {algorithm}: DeepSeek-V4 served by sglang-tree-v4 on a CPU "
                             "speculates with TREE_V4 only (or drop the flag)")
        if (self.tp_size or 1) > 1:
            os.environ.setdefault(THREADS_BIND_ENV, cpu_binding(self.tp_size))
    return original(self, *args, **kwargs)

