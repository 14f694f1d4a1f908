"""The README's main job: serve the embedded tiny DeepSeek-V4 with TREE_V4, ask it a question, show the
accepted length, and stop the server.

    python scripts/demo.py [--model-path models/tiny-v4] [--port 30000] [-- extra launch_server flags]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with code {proc.returncode}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    sys.exit("the server did not become healthy in time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=str(ROOT / "models" / "tiny-v4"))
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("extra", nargs="*", help="more launch_server flags (after --)")
    args = parser.parse_args()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path,
           "--speculative-algorithm", "TREE_V4", "--host", "127.0.0.1", "--port", str(args.port), *args.extra]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_healthy(url, proc)
        r = requests.post(url + "/v1/chat/completions", timeout=600, json={
            "model": "default", "temperature": 0, "max_tokens": 96,
            "messages": [{"role": "user", "content": QUESTION}]})
        r.raise_for_status()
        print("\nQ:", QUESTION)
        print("A:", r.json()["choices"][0]["message"]["content"].strip())
        out = requests.post(url + "/generate", timeout=600, json={
            "text": QUESTION, "sampling_params": {"max_new_tokens": 96, "temperature": 0}}).json()
        meta = out["meta_info"]
        print(f"\naccepted length per verify step: {meta['spec_accept_length']:.2f} "
              f"({meta['completion_tokens']} tokens in {meta['spec_verify_ct']} target verify passes)")
        info = requests.get(url + "/get_server_info", timeout=60).json()["internal_states"][0]
        print(f"server average accepted length: {info['avg_spec_accept_length']:.2f}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
