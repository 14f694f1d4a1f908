"""Held-out evaluation of ``models/tiny-v4``: perplexity per dataset, the MTP layer's top-1 agreement with the
target, and one greedy chat answer, all printed as JSON (the model card quotes it).

* Perplexity: teacher-forced target CE over every token of each held-out chat (template included), one chat per
  sequence (truncated to ``--max-len``), per dataset: GSM8K test, MBPP test (task ids 11-510), and the ShareGPT
  conversations that directly follow the training slice in file order.
* MTP agreement: at position p the MTP sees the target's streams at p and the true token at p+1; it agrees when its
  argmax equals the target's argmax at p+1 -- the event "a depth-1 chain draft is accepted" under teacher forcing.
* Greedy answer: ``DSV4Runner`` prefill + decode of a GSM8K test question in the chat template.

Usage: python scripts/eval_tiny_v4.py --model models/tiny-v4 [--n 100]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_v4_data as data  # noqa: E402
import tiny_v4_model as tm  # noqa: E402


@torch.no_grad()
def score_chat(model, ids: torch.Tensor) -> tuple[float, int, int, int]:
    """-> (sum of target CE, #target tokens, #MTP-target agreements, #MTP positions) for one sequence."""
    _, _, _, logits, mlog = tm.joint_loss(model, ids[None], 0.0)
    ce = F.cross_entropy(logits[0, :-1], ids[1:], reduction="sum").item()
    tgt_next = logits[0, 1:].argmax(-1)  # target's choice for p+2, made at p+1
    agree = (mlog[0].argmax(-1) == tgt_next).sum().item()
    return ce, ids.numel() - 1, agree, tgt_next.numel()


@torch.no_grad()
def greedy_answer(model, tokenizer, question: str, max_new: int) -> str:
    from sglang_tree_v4.testing.runner import DSV4Runner
    ids = data.first_turn_ids(tokenizer, [{"role": "user", "content": question}])
    runner = DSV4Runner(model, num_slots=len(ids) + max_new + 8, max_len=len(ids) + max_new + 8, max_reqs=1)
    rid = runner.add_request()
    tok = int(runner.extend([rid], [ids])[0].logits[-1].argmax())
    out = [tok]
    while len(out) < max_new and tok != tokenizer.eos_token_id:
        tok = int(runner.decode([rid], [tok])[0].logits[0].argmax())
        out.append(tok)
    return tokenizer.decode(out, skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-v4")
    ap.add_argument("--n", type=int, default=100, help="held-out chats per dataset")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--sharegpt-train", type=int, default=None, help="default: from training_meta.json")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from sglang_tree_v4.checkpoint.weights import load_model

    model = load_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    n_sg = args.sharegpt_train
    if n_sg is None:
        with open(os.path.join(args.model, "training_meta.json")) as f:
            meta = json.load(f)
        n_sg = max(st["args"]["sharegpt_train"] for st in meta.get("stages", [meta]))
    _, held = data.corpus(n_sg, args.n)
    report: dict = {"model": args.model, "n_per_dataset": args.n, "max_len": args.max_len, "datasets": {}}
    agree_all = pos_all = 0
    for name, chats in held.items():
        ce = n = agree = npos = 0
        for chat in chats[: args.n]:
            ids = torch.tensor(tokenizer.encode(data.render(chat), add_special_tokens=False)[: args.max_len])
            c, k, a, p = score_chat(model, ids)
            ce, n, agree, npos = ce + c, n + k, agree + a, npos + p
        report["datasets"][name] = {"chats": min(args.n, len(chats)), "tokens": n, "ppl": round(math.exp(ce / n), 3),
                                    "mtp_top1_agreement": round(agree / npos, 4)}
        agree_all, pos_all = agree_all + agree, pos_all + npos
        print(name, report["datasets"][name], flush=True)
    report["mtp_top1_agreement_all"] = round(agree_all / pos_all, 4)
    q = held["gsm8k"][0][0]["content"]
    report["greedy_example"] = {"question": q, "answer": greedy_answer(model, tokenizer, q, args.max_new)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
