"""What the serving tests share: the embedded model, the CPU server flags, the shapes served, and the plain decoding
our model gives outside SGLang (the ground truth some tests compare served tokens with)."""

from __future__ import annotations

from pathlib import Path

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tiny-v4"
# CPU servers with seeded sampling; modules whose servers run side by side add SLEEP.
COMMON = ["--device", "cpu", "--max-total-tokens", "32768", "--random-seed", "7"]
SLEEP = ["--sleep-on-idle"]
BUDGET = ["--speculative-num-draft-tokens", "6"]
TREE = ["--speculative-algorithm", "TREE_V4", *BUDGET, "--speculative-eagle-topk", "3", "--speculative-num-steps", "3"]
CHAIN = ["--speculative-algorithm", "TREE_V4", *BUDGET, "--speculative-eagle-topk", "1", "--speculative-num-steps", "5"]
# The powered sampled test: 500 samples of 10 tokens per (prompt, setting).
SAMPLES_PER_CASE = 500
SAMPLED_TOKENS = 10
# SGLang frees window rows as early as it ever does.
EARLIEST_EVICTION = {"SGLANG_SWA_EVICTION_INTERVAL": "1"}
# Pages of 64: the tree servers' CSA compressor rows in a ring of 16 per page (a plain server's pages of 16: 8).
RING_PAGES = ["--page-size", "64"]


def reference_greedy(model_path, prompt_ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of our model outside SGLang (no speculation)."""
    from sglang_tree_v4.checkpoint.weights import load_model
    from sglang_tree_v4.testing.offline import plain_greedy
    from sglang_tree_v4.testing.runner import DSV4Runner

    runner = DSV4Runner(load_model(str(model_path)), num_slots=1024, max_len=512, max_reqs=2)
    return plain_greedy(runner, prompt_ids, n)
