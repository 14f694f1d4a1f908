"""Serve the embedded tiny DeepSeek-V4 with TREE_V4 and without speculation, ask both the same question, and show
the answer, the accepted length, the tokens/s of each and whether the two texts are identical.

    python scripts/demo.py [--model-path models/tiny-v4] [--port 30000] [--log-dir DIR] [--verbose]
                           [-- extra launch_server flags]

The servers' logs go to files (named in the output; a fresh temporary folder unless --log-dir is given);
--verbose also copies them to the terminal as they are written. Extra flags go to both servers, except
--speculative-* flags, which only the TREE_V4 server gets. The timed requests alternate between the two servers
(one at a time), and both servers are stopped before the demo exits, also on an error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from sglang_tree_v4.testing import launcher

ROOT = Path(__file__).resolve().parents[1]
QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")


def _show(path: Path) -> str:
    """A path as short as it can be shown: relative to the working directory when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _without_speculation(flags: list[str]) -> list[str]:
    """``flags`` less every ``--speculative-*`` flag and its value."""
    out, i = [], 0
    while i < len(flags):
        flag = flags[i]
        i += 1
        if flag.startswith("--speculative-"):
            if "=" not in flag and i < len(flags) and not flags[i].startswith("--"):
                i += 1
            continue
        out.append(flag)
    return out


class _Follow(threading.Thread):
    """Copy a log file to stderr as it grows (``--verbose``)."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.done = path, threading.Event()

    def run(self) -> None:
        while not self.path.exists() and not self.done.is_set():
            time.sleep(0.1)
        with open(self.path, errors="replace") as f:
            while True:
                line = f.readline()
                if line:
                    sys.stderr.write(line)
                    sys.stderr.flush()
                elif self.done.is_set():
                    return
                else:
                    time.sleep(0.2)

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5)


class _Run:
    """One server: start it, answer the question, stop it."""

    def __init__(self, name: str, model: str, flags: list[str], log: Path, port: int | None, verbose: bool):
        self.name, self.model, self.flags, self.log, self.port = name, model, flags, log, port
        self.follow = _Follow(log) if verbose else None
        self.server: launcher.Server | None = None
        self.outputs: list[dict] = []
        self.rates: list[float] = []

    def start(self) -> float:
        t0 = time.monotonic()
        if self.follow is not None:
            self.follow.start()
        self.server = launcher.launch(self.model, self.flags, log=self.log, port=self.port)
        launcher.wait_healthy(self.server, timeout=600)
        return time.monotonic() - t0

    def ask(self, payload: dict, timed: bool = True) -> None:
        t0 = time.perf_counter()
        out = self.server.generate(payload)
        if timed:
            self.outputs.append(out)
            self.rates.append(out["meta_info"]["completion_tokens"] / (time.perf_counter() - t0))

    def stop(self) -> int | None:
        """Stop the server (and its scheduler and detokenizer); its exit status, None if it never started."""
        try:
            if self.server is None:
                return None
            for _ in range(3):  # another Ctrl-C while stopping must not leave the server running
                try:
                    self.server.stop()
                    return self.server.process.wait()
                except KeyboardInterrupt:
                    continue
            os.killpg(self.server.process.pid, signal.SIGKILL)
            return self.server.process.wait()
        finally:
            if self.follow is not None and self.follow.is_alive():
                self.follow.stop()


def _sigterm(signum, frame):  # stop the servers on SIGTERM too, as on Ctrl-C
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=str(ROOT / "models" / "tiny-v4"))
    parser.add_argument("--port", type=int, default=30000, help="the TREE_V4 server's port")
    parser.add_argument("--log-dir", type=Path, help="where the servers' logs go (default: a new temporary folder)")
    parser.add_argument("--verbose", action="store_true", help="also show the servers' logs as they are written")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed requests per server (median tokens/s)")
    parser.add_argument("extra", nargs="*", help="more launch_server flags (after --)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    signal.signal(signal.SIGTERM, _sigterm)

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="tree-v4-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    flags = ["--speculative-algorithm", "TREE_V4", *args.extra]
    tree = _Run("TREE_V4", args.model_path, flags, log_dir / "tree_v4.log", args.port, args.verbose)
    plain = _Run("no speculation", args.model_path, _without_speculation(args.extra),
                 log_dir / "no_speculation.log", None, args.verbose)

    # The chat template comes from the checkpoint's tokenizer (imported here: transformers is slow to import).
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                           tokenize=False)
    payload = {"input_ids": list(tokenizer(prompt, add_special_tokens=False)["input_ids"]),
               "sampling_params": {"max_new_tokens": args.max_new_tokens, "temperature": 0}}

    print("serving: python -m sglang.launch_server --model-path", _show(Path(args.model_path)), *flags, flush=True)
    statuses: dict[str, int | None] = {}
    try:
        try:
            # TREE_V4 first: it times its step shapes at startup, which must not share the CPU with another load.
            seconds = tree.start()
            print(f"started the TREE_V4 server on {Path(args.model_path).name} in {seconds:.0f} s; "
                  f"log: {_show(tree.log)}", flush=True)
            seconds = plain.start()
            print(f"started the same server without speculation in {seconds:.0f} s; log: {_show(plain.log)}",
                  flush=True)
            tree.ask(payload, timed=False)  # warm-up: a first request pays for lazy initialisation
            plain.ask(payload, timed=False)
            for _ in range(args.repeats):  # alternating, so that a change in the machine's speed hits both
                tree.ask(payload)
                plain.ask(payload)
        finally:
            try:
                statuses[tree.name] = tree.stop()
            finally:
                statuses[plain.name] = plain.stop()
    except KeyboardInterrupt:
        print(f"\ninterrupted; servers stopped; logs in {_show(log_dir)}", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line and the logs, not a traceback through the launcher
        lines = [line for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        print(f"\nfailed: {lines[0]}", file=sys.stderr)
        if len(lines) > 1:  # the launcher's message: the server log's last line
            print("  " + lines[-1].strip(), file=sys.stderr)
        print(f"servers stopped; logs in {_show(log_dir)}", file=sys.stderr)
        return 1

    answer, reference = tree.outputs[-1]["text"], plain.outputs[0]["text"]
    same = all(o["text"] == reference for o in tree.outputs + plain.outputs)
    tokens = sum(o["meta_info"]["completion_tokens"] for o in tree.outputs)
    rounds = sum(o["meta_info"].get("spec_verify_ct", 0) for o in tree.outputs)
    tree_rate, plain_rate = statistics.median(tree.rates), statistics.median(plain.rates)
    print("\nQ:", QUESTION)
    print("A:", answer.strip().replace("\n", "\n   "))
    print(f"\naccepted length: {tokens / max(rounds, 1):.2f} tokens per verify round "
          f"({tokens} tokens in {rounds} rounds over {len(tree.outputs)} requests)")
    print(f"tokens/s, batch 1, median of {args.repeats}: TREE_V4 {tree_rate:.1f}, no speculation "
          f"{plain_rate:.1f} ({tree_rate / plain_rate:.2f}x)")
    if same:
        print("texts identical: yes")
    else:  # exact for a float32 model; in bf16 a tie between two logits can flip a greedy token
        first = len(os.path.commonprefix([answer, reference]))
        print(f"texts identical: no (they differ from character {first}); without speculation:\n   "
              + reference.strip().replace("\n", "\n   "))
    bad = {name: rc for name, rc in statuses.items() if rc not in (0, None)}
    if bad:
        print("server exit status: " + ", ".join(f"{n} {rc}" for n, rc in bad.items())
              + f"; logs in {_show(log_dir)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
