"""Stopping a TREE_V4 server: the demo's own stop and SIGTERM exit 0 with no crash text, Ctrl-C (SIGINT to the
whole foreground process group, as a terminal sends it) prints no "crashed" / "SIGQUIT", and a scheduler that
really dies is still reported as a crash by SGLang.

Without ``sglang_tree_v4.shutdown`` the first two end with "Subprocess scheduler_0 ... crashed with exit code -15.
Triggering SIGQUIT" and crash diagnostics, and Ctrl-C with a KeyboardInterrupt traceback and status 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from sglang_tree_v4.testing import launcher

pytestmark = pytest.mark.server
ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tiny-v4"
FLAGS = ["--speculative-algorithm", "TREE_V4", "--sleep-on-idle"]
CRASH_WORDS = ("crashed", "SIGQUIT", "Traceback", "crash diagnostics")


def _served(tmp_path: Path, name: str) -> launcher.Server:
    server = launcher.wait_healthy(launcher.launch(MODEL, FLAGS, log=tmp_path / f"{name}.log"))
    out = server.generate({"text": "Tom has 3 apples.", "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                       "ignore_eos": True}})
    assert out["meta_info"]["completion_tokens"] == 12
    return server


def _stopped_by(server: launcher.Server, sig: int, timeout: float = 60) -> int:
    os.killpg(server.process.pid, sig)  # the whole group: the server, its scheduler and its detokenizer
    try:
        return server.process.wait(timeout=timeout)
    finally:
        server.stop()


def _no_crash_text(text: str) -> None:
    found = [w for w in CRASH_WORDS if w in text]
    assert not found, f"{found} in:\n{text[-3000:]}"


def test_sigterm_exits_zero_without_crash_text(tmp_path):
    server = _served(tmp_path, "sigterm")
    assert _stopped_by(server, signal.SIGTERM) == 0, server.log_tail()
    _no_crash_text(server.log.read_text())


def test_ctrl_c_exits_without_crash_text(tmp_path):
    server = _served(tmp_path, "sigint")
    rc = _stopped_by(server, signal.SIGINT)
    _no_crash_text(server.log.read_text())
    assert rc == 0, server.log_tail()


def test_dead_scheduler_is_still_reported(tmp_path):
    server = _served(tmp_path, "crash")
    schedulers = [p for p in psutil.Process(server.process.pid).children(recursive=True)
                  if p.name().startswith("sglang::scheduler")]
    assert schedulers, "no scheduler process found"
    schedulers[0].kill()
    try:
        rc = server.process.wait(timeout=90)
    finally:
        server.stop()
    text = server.log.read_text()
    assert "crashed" in text and rc != 0, text[-3000:]


def test_demo_stops_cleanly(tmp_path):
    """The demo's default output is short (at most 25 lines: both speeds and whether the texts match), and both
    servers whose logs it names stop without a crash."""
    port = launcher.free_port()
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--port", str(port),
                           "--log-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=launcher.clean_env())
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert "accepted length:" in text and "texts identical:" in text and "tokens/s" in text, text
    assert len(text.splitlines()) <= 25, text
    logs = sorted(tmp_path.glob("*.log"))
    assert len(logs) == 2, logs
    for log in logs:
        assert str(log) in text
        _no_crash_text(log.read_text())
