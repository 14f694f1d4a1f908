"""A quiet stop: Ctrl-C or SIGTERM ends a server without crash reports, a real crash still reports.

What SGLang 0.5.23 does on its own (measured with the embedded model on the CPU):

* SIGTERM to the server process alone: it drains, stops its children and exits 0, cleanly.
* SIGTERM to the whole process group (``kill -- -PGID``, a service manager, a terminal closing): the scheduler
  and the detokenizer die of the signal too, the parent's watchdog reads their ``-15`` as a crash ("scheduler
  crashed with exit code -15. Triggering SIGQUIT"), prints crash diagnostics and ends by SIGKILL.
* Ctrl-C (SIGINT to the whole foreground group): the same in the children, and in the parent a
  ``KeyboardInterrupt`` traceback after uvicorn's shutdown, exit status 1.

SGLang's child processes never need a signal of their own to stop: the parent ends them with SIGKILL
(``kill_process_tree``) once it has drained, and ``PR_SET_PDEATHSIG`` ends them if the parent dies. So in those
children SIGINT and SIGTERM are ignored, which leaves the decision to the parent: a child that really dies (an
exception, a kill -9, out of memory) is still reported by SGLang's watchdog as before. In the ``launch_server``
process a Ctrl-C after the graceful shutdown, or before the server runs, exits with status 0 instead of a
traceback. Other programs (a user's script with ``sglang.Engine``) keep their own SIGINT.

After a Ctrl-C, uvicorn stops serving and re-raises the SIGINT, and ``launch_server`` then kills its children with
SIGKILL. SGLang's subprocess watchdog polls once a second and is still running on that path (SIGTERM stops it
first), so now and then it saw the scheduler's ``-9`` before the process exited and reported a crash. The quiet
exit stops the watchdog before the children are killed.
"""

from __future__ import annotations

import signal
import sys

# The functions SGLang runs its child processes in; each calls ``load_plugins`` (and so ``install``) first.
_CHILD_ENTRIES = {"run_scheduler_process", "run_detokenizer_process", "run_data_parallel_controller_process"}


def _in_sglang_child() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name in _CHILD_ENTRIES and "sglang" in code.co_filename:
            return True
        frame = frame.f_back
    return False


def _is_launch_server() -> bool:
    return sys.argv[0].replace("\\", "/").endswith("sglang/launch_server.py")


def _stop_crash_watch() -> None:
    """Stop the server's subprocess watchdog: from here on its children are ended on purpose."""
    try:
        from sglang.srt.entrypoints.http_server import get_global_state
    except ImportError:
        return
    state = get_global_state()
    watchdog = getattr(getattr(state, "tokenizer_manager", None), "_subprocess_watchdog", None)
    if watchdog is not None:
        watchdog.stop()


def _exit_quietly(signum, frame) -> None:
    _stop_crash_watch()
    raise SystemExit(0)


def install() -> None:
    """Called by the plugin in every SGLang process (main thread only: signal handlers live there)."""
    try:
        if _in_sglang_child():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        elif _is_launch_server():
            signal.signal(signal.SIGINT, _exit_quietly)
    except ValueError:  # not the main thread
        pass
