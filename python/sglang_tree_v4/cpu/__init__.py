"""Make stock SGLang 0.5.23 serve (and speculate) on a plain CPU, with no user-set environment.

Active only on machines without a CUDA device; on a GPU install ``activate`` returns at once.
What it does, in order, in every SGLang process (the plugin entry point runs in each of them):

1. turns on SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) for this process and its children,
   and refreshes the two values the launcher computed before plugins were loaded;
2. makes the CUDA build of sgl_kernel importable with a stand-in driver library (``driver_stub``);
3. registers pure-torch versions of the sgl_kernel CPU ops speculation needs (``kernel_ops``);
4. gives the torch_native attention backend target verification with a tree mask
   (``torch_native_verify``);
5. defaults the KV pool to a fixed token budget instead of a fraction of RAM (``server_defaults``);
6. runs torch single-threaded unless the user chose threads (``OMP_NUM_THREADS`` or SGLang's per-rank core binding):
   SGLang's server is several busy processes, and OpenMP threads competing with them for a few cores were an order
   of magnitude slower than one thread on the small models a CPU serves.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

# Gloo instead of NCCL for CPU tensor parallelism: the CUDA torch wheel ships libnccl, which SGLang
# would otherwise try (and fail) to use on CPU tensors.
_CPU_ENV_DEFAULTS = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_NCCL_SO_PATH": "libnccl-absent-on-cpu.so"}
_active = False


def cpu_only_machine() -> bool:
    """True when torch sees no CUDA (or ROCm) device: then SGLang can only run on the CPU here."""
    import torch

    return not torch.cuda.is_available()


def _refresh_launcher_cpu_flags() -> None:
    """The launcher imports SGLang (caching ``is_cpu() == False``) before it loads plugins."""
    import sys

    common = sys.modules.get("sglang.srt.utils.common")
    if common is not None:
        common.is_cpu.cache_clear()
    parallel_state = sys.modules.get("sglang.srt.distributed.parallel_state")
    if parallel_state is not None and hasattr(parallel_state, "_is_cpu"):
        parallel_state._is_cpu = True


def activate() -> bool:
    """Install the CPU support in this process if the machine has no GPU; return whether active."""
    global _active
    if _active:
        return True
    if not cpu_only_machine():
        return False
    for key, value in _CPU_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    _refresh_launcher_cpu_flags()
    if "OMP_NUM_THREADS" not in os.environ and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
        import torch

        torch.set_num_threads(1)

    from . import driver_stub, kernel_ops, server_defaults, torch_native_verify

    driver_stub.install()
    added = kernel_ops.register_missing()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(torch_native_verify.TARGET, torch_native_verify.verify_forward_extend,
                          HookType.AROUND)
    HookRegistry.register(server_defaults.TARGET, server_defaults.apply_cpu_defaults, HookType.AROUND)
    logger.info("sglang-tree-v4 CPU support active (pure-torch sgl_kernel ops: %s)", added)
    _active = True
    return True
