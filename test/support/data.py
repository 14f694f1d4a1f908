"""Real evaluation text for tests: GSM8K and MBPP from the project's data folder, ShareGPT-style chats."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data"


def _jsonl(name: str) -> list[dict]:
    with open(DATA / name) as f:
        return [json.loads(line) for line in f if line.strip()]


def gsm8k_questions(split: str, n: int) -> list[str]:
    return [r["question"] for r in _jsonl(f"gsm8k_{split}.jsonl")[:n]]


def mbpp_prompts(n: int, split: str = "test") -> list[str]:
    """MBPP task statements with their first test, as a code prompt (test = ids 11-510)."""
    lo, hi = (11, 510) if split == "test" else (601, 974)
    rows = [r for r in _jsonl("mbpp.jsonl") if lo <= r["task_id"] <= hi][:n]
    return [f"{r['text']}\n{r['test_list'][0]}\n" for r in rows]
