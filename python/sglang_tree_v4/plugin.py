"""SGLang plugin entry point (group ``sglang.srt.plugins``): registration only.

SGLang calls ``register`` at the start of every process it runs (launcher, each scheduler / TP rank,
detokenizer). It registers the ``TREE_V4`` speculative algorithm and the DeepSeek-V4 model override, a quiet stop
on Ctrl-C / SIGTERM (``shutdown``), and on a machine without a GPU the CPU support. Heavy imports stay inside the
hooks they serve.
"""

from __future__ import annotations

import sys


def register() -> None:
    from . import shutdown
    from .cpu import activate
    from .cpu.driver_stub import StubBuildError
    from .speculative import algorithm, model_override

    try:
        activate()
    except StubBuildError as err:
        # SGLang logs and skips plugins that raise; without the stand-in nothing can work, so stop
        # the process with the one message that says what is missing.
        print(str(err), file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    shutdown.install()
    algorithm.register()
    model_override.install()
