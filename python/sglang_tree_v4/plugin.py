"""SGLang plugin entry point (group ``sglang.srt.plugins``): registration only.

SGLang calls ``register`` at the start of every process it runs (launcher, each scheduler / TP
rank, detokenizer). On a GPU machine the CPU support does nothing; imports stay lazy so that a
process that never needs our code pays nothing for it.
"""

from __future__ import annotations

import sys


def register() -> None:
    from .cpu import activate
    from .cpu.driver_stub import StubBuildError

    try:
        activate()
    except StubBuildError as err:
        # SGLang logs and skips plugins that raise; without the stand-in nothing can work, so stop
        # the process with the one message that says what is missing.
        print(str(err), file=sys.stderr, flush=True)
        raise SystemExit(1) from None
