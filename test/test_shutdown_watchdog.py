"""The quiet Ctrl-C exit stops SGLang's subprocess watchdog before ``launch_server`` kills the children.

On that path the watchdog (polling once a second) sometimes saw the scheduler's SIGKILL before the server process
exited and printed "scheduler_0 crashed with exit code -9. Triggering SIGQUIT" (``test_server_shutdown`` caught it
once in many runs). Here the race is made certain: a watchdog polling every 20 ms over a real child process. The
control, a watchdog left running, shows the same kill is reported, so the check can fail."""

from __future__ import annotations

import multiprocessing
import signal
import time
import types

import pytest
from sglang.srt.entrypoints import http_server
from sglang.srt.utils.watchdog import SubprocessWatchdog

from sglang_tree_v4 import shutdown


def _watched_child() -> tuple[multiprocessing.Process, SubprocessWatchdog]:
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
    child.start()
    watchdog = SubprocessWatchdog([child], ["scheduler_0"], interval=0.02)
    watchdog.start()
    return child, watchdog


def _killed_and_waited(child: multiprocessing.Process) -> None:
    child.kill()
    child.join(timeout=10)
    time.sleep(0.3)  # 15 watchdog polls


@pytest.fixture
def sigquits():
    seen: list[int] = []
    previous = signal.signal(signal.SIGQUIT, lambda signum, frame: seen.append(signum))
    yield seen
    signal.signal(signal.SIGQUIT, previous)


def test_ctrl_c_stops_the_watchdog_before_the_children_die(monkeypatch, sigquits):
    child, watchdog = _watched_child()
    server_state = types.SimpleNamespace(tokenizer_manager=types.SimpleNamespace(_subprocess_watchdog=watchdog))
    monkeypatch.setattr(http_server, "_global_state", server_state)
    with pytest.raises(SystemExit) as exited:
        shutdown._exit_quietly(signal.SIGINT, None)
    assert exited.value.code == 0
    _killed_and_waited(child)
    assert sigquits == []


def test_control_a_running_watchdog_reports_the_same_kill(sigquits):
    child, watchdog = _watched_child()
    try:
        _killed_and_waited(child)
    finally:
        watchdog.stop()
    assert sigquits == [signal.SIGQUIT]


def test_no_server_state_still_exits_quietly(monkeypatch):
    monkeypatch.setattr(http_server, "_global_state", None)
    with pytest.raises(SystemExit) as exited:
        shutdown._exit_quietly(signal.SIGINT, None)
    assert exited.value.code == 0
