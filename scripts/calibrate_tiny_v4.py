"""Fit the draft-score temperature of a DeepSeek-V4 + MTP checkpoint and (with ``--write``) store it in its
``config.json`` as ``tree_v4.draft_score_temperature``, where the TREE_V4 worker reads it.

Why: the EAGLE-2 reranking (``tree.build``) keeps the nodes with the highest cumulative draft probability, which
maximises the expected accept length only if a draft's probability is the chance that verification accepts it.
Under greedy verification a draft is accepted when it equals the target's argmax, and an MTP trained on data
predicts the data, not the target's argmax: on a small model the two differ a lot (the top-1 draft agrees with the
target far more often than its probability says), and the uncalibrated tree wastes its budget on siblings.

How: classic temperature scaling. On training-split prompts (GSM8K train, MBPP train, ShareGPT training
conversations; never the held-out sets the benchmarks use) the target decodes greedily; along each continuation the
MTP drafts every next-next token exactly as in serving (target streams at p, the target's own token at p+1), and
T minimises the cross-entropy of the target's greedy token under ``softmax(MTP logits / T)``. A reliability table
(confidence bins vs agreement) is printed before and after.

Usage: python scripts/calibrate_tiny_v4.py --model models/tiny-v4 --n 20 --write
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_v4_data as data  # noqa: E402
import tiny_v4_model as tm  # noqa: E402

from sglang_tree_v4.testing.offline import plain_greedy  # noqa: E402

TEMPERATURES = [round(0.05 * 1.05 ** i, 4) for i in range(76)]  # 0.05 .. ~2.0, 5% apart


def training_prompts(tokenizer, n: int) -> dict[str, list[list[int]]]:
    sharegpt_train, _ = data.sharegpt_chats(max(n, 1), 0)
    sources = {"gsm8k": data.gsm8k_chats("train"), "mbpp": data.mbpp_chats("train"), "sharegpt": sharegpt_train}
    return {name: [data.first_turn_ids(tokenizer, c) for c in chats[:n]] for name, chats in sources.items()}


@torch.no_grad()
def draft_logits_and_labels(model, runner, prompt: list[int], max_new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP logits of every draft query along the target's greedy continuation, and the target's token there."""
    ids = torch.tensor(prompt + plain_greedy(runner, prompt, max_new))
    _, _, _, _, mtp_logits = tm.joint_loss(model, ids[None], 0.0)
    queries = torch.arange(len(prompt) - 1, len(ids) - 2)  # query q drafts token q + 2 from the target's q + 1
    return mtp_logits[0, queries].float(), ids[queries + 2]


def reliability(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> list[dict]:
    probs = (logits / temperature).softmax(-1)
    conf, top = probs.max(-1)
    agree = (top == labels).float()
    rows = []
    for lo, hi in ((0.0, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.8), (0.8, 1.01)):
        m = (conf >= lo) & (conf < hi)
        if m.any():
            rows.append({"bin": f"[{lo:.1f}, {min(hi, 1):.1f})", "n": int(m.sum()),
                         "confidence": round(conf[m].mean().item(), 3), "agreement": round(agree[m].mean().item(), 3)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-v4")
    ap.add_argument("--n", type=int, default=20, help="training prompts per source")
    ap.add_argument("--max-new", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write", action="store_true", help="store the fitted temperature in the model's config.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from sglang_tree_v4.checkpoint.weights import load_model
    from sglang_tree_v4.testing.runner import DSV4Runner

    model = load_model(args.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    runner = DSV4Runner(model, num_slots=4096, max_len=2048, max_reqs=2)
    logits, labels = [], []
    for _name, prompts in training_prompts(tokenizer, args.n).items():
        for p in prompts:
            lg, lb = draft_logits_and_labels(model, runner, p, args.max_new)
            logits.append(lg)
            labels.append(lb)
    logits, labels = torch.cat(logits), torch.cat(labels)
    nll = {t: F.cross_entropy(logits / t, labels).item() for t in TEMPERATURES + [1.0]}
    best = min(TEMPERATURES, key=nll.__getitem__)
    fit = {"draft_score_temperature": best, "queries": len(labels),
           "greedy_agreement": round((logits.argmax(-1) == labels).float().mean().item(), 4),
           "nll_at_1": round(nll[1.0], 4), "nll_fitted": round(nll[best], 4),
           "fitted_on": f"greedy continuations ({args.max_new} tokens) of the first {args.n} GSM8K train, MBPP train "
                        f"and ShareGPT training prompts"}
    print(json.dumps(fit, indent=1))
    for t in (1.0, best):
        print(f"reliability at T = {t}:")
        for row in reliability(logits, labels, t):
            print("  " + json.dumps(row))
    if args.write:
        path = Path(args.model) / "config.json"
        cfg = json.loads(path.read_text())
        cfg["tree_v4"] = fit
        path.write_text(json.dumps(cfg, indent=1) + "\n")
        print(f"wrote tree_v4.draft_score_temperature = {best} to {path}")


if __name__ == "__main__":
    main()
