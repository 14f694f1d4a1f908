"""Benchmark prompts, rendered the way a user's chat request would be.

GSM8K test questions, MBPP test tasks (ids 11-510; statement plus first test) and ShareGPT first human turns, each
sent as one user message through the model's own chat template (plain text when the tokenizer has none). ShareGPT
prompts come from past the conversations the embedded model was trained on, and are limited to mostly-ASCII turns
of at most ``SHAREGPT_MAX_CHARS`` characters (the embedded tokenizer is small and English-centric; long prompts
would make CPU prefill, not decoding, dominate the timing).
"""
from __future__ import annotations

from pathlib import Path

from sglang_tree_v4.testing import prompts

SHAREGPT_SKIP = 6000  # raw conversations skipped: the embedded model trained on the first usable 1,200
SHAREGPT_MAX_CHARS = 1500


def user_messages(dataset: str, n: int) -> list[str]:
    """The first ``n`` user messages of ``dataset`` (gsm8k, mbpp or sharegpt), in a fixed order."""
    if dataset == "gsm8k":
        return [r["question"] for r in prompts.gsm8k("test")[:n]]
    if dataset == "mbpp":
        return [prompts.mbpp_prompt(r) for r in prompts.mbpp("test")[:n]]
    if dataset == "sharegpt":
        out = []
        for text in prompts.sharegpt_prompts(20 * n + 200, skip=SHAREGPT_SKIP):
            text = text.strip()
            if len(text) <= SHAREGPT_MAX_CHARS and sum(c.isascii() for c in text) >= 0.97 * len(text):
                out.append(text)
                if len(out) == n:
                    break
        return out
    raise ValueError(f"unknown dataset {dataset!r}")


def chat_texts(model_path: str | Path, dataset: str, n: int) -> list[str]:
    """``n`` prompts of ``dataset`` rendered with the tokenizer's chat template (generation prompt appended)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    msgs = user_messages(dataset, n)
    if not getattr(tok, "chat_template", None):
        return msgs
    return [tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True)
            for m in msgs]
