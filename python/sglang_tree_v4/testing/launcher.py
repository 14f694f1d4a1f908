"""Start and stop real SGLang servers (``python -m sglang.launch_server``): for the end-to-end tests, the benchmarks
and the demo, which all measure or show what a user gets from the stock command.

Servers run with the user's plain environment: no SGLang variables are set here, because the project promises that
none are needed (stale ones inherited from a parent are dropped). Each server gets its own process group so that
stopping it also stops the scheduler and detokenizer processes it spawned.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

_SGLANG_VARS = ("SGLANG_USE_CPU_ENGINE", "LD_LIBRARY_PATH")


# Ports handed to servers: below the kernel's ephemeral range (which outgoing connections draw from, so a port picked
# there can be taken before the server binds it) and above the range SGLang picks its own later-bound ports from.
SERVER_PORTS = range(30000, 32768)
# Ports this process has handed out. Servers started side by side pick their ports before any of them binds, so a
# port that is free when it is picked may already be promised to another server. One test run started six servers
# at once, and two of them were given the same port; the second failed with "address already in use".
_handed_out: set[int] = set()


def free_port() -> int:
    """A port that is free now, that no outgoing connection will take before the server binds it, and that this
    process has not handed out before."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    ports = [p for p in SERVER_PORTS if p < ephemeral_low and p not in _handed_out]
    for port in random.sample(ports, min(64, len(ports))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # the whole range busy: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SGLANG_VARS}
    env.update(extra)
    return env


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    log: Path | None

    def post(self, path: str, payload: dict, timeout: float = 1800) -> requests.Response:
        return requests.post(self.url + path, json=payload, timeout=timeout)

    def generate(self, payload: dict) -> dict:
        r = self.post("/generate", payload)
        r.raise_for_status()
        return r.json()

    def log_tail(self, n: int = 60) -> str:
        if self.log is None:
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass


def launch(model: Path | str, args: list[str], log: Path | None = None, env: dict[str, str] | None = None,
           port: int | None = None) -> Server:
    """Start a server; returns at once (see ``wait_healthy``). Without ``log`` its output goes to the terminal."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
           "--host", "127.0.0.1", "--port", str(port), *args]
    out = open(log, "w") if log is not None else None
    if out is not None:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=env or clean_env(),
                            start_new_session=True)
    return Server(proc, f"http://127.0.0.1:{port}", log)


def wait_healthy(server: Server, timeout: float = 400) -> Server:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            if requests.get(server.url + "/health", timeout=5).status_code == 200:
                return server
        except requests.RequestException:
            pass
        time.sleep(2)
    server.stop()
    raise TimeoutError(f"server not healthy after {timeout}s:\n{server.log_tail()}")
