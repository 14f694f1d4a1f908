"""The README's main job: serve the embedded tiny DeepSeek-V4 with TREE_V4, ask it a question, show the
accepted length, and stop the server.

    python scripts/demo.py [--model-path models/tiny-v4] [--port 30000] [-- extra launch_server flags]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import requests
from transformers import AutoTokenizer

from sglang_tree_v4.testing import launcher

ROOT = Path(__file__).resolve().parents[1]
QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=str(ROOT / "models" / "tiny-v4"))
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("extra", nargs="*", help="more launch_server flags (after --)")
    args = parser.parse_args()
    flags = ["--speculative-algorithm", "TREE_V4", *args.extra]
    print("$ python -m sglang.launch_server --model-path", args.model_path, *flags, flush=True)
    server = launcher.launch(args.model_path, flags, port=args.port)
    url = server.url
    try:
        launcher.wait_healthy(server, timeout=600)
        # The chat template comes from the checkpoint's tokenizer; /generate reports per-request speculation stats.
        tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                            tokenize=False)
        ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
        r = requests.post(url + "/generate", timeout=600, json={
            "input_ids": list(ids), "sampling_params": {"max_new_tokens": 64, "temperature": 0}})
        r.raise_for_status()
        out = r.json()
        meta = out["meta_info"]
        print("\nQ:", QUESTION)
        print("A:", out["text"].strip())
        print(f"\naccepted length: {meta.get('spec_accept_length', 1.0):.2f} tokens per target verify pass "
              f"({meta['completion_tokens']} tokens, {meta.get('spec_verify_ct', 0)} verify passes)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
