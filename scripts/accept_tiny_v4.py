"""Accepted length of MTP tree drafting vs the matched MTP chain on ``models/tiny-v4``, greedy, without SGLang.

The decode loop is ``testing.offline.speculative_greedy``: the drafter the SGLang worker uses
(``speculative.mtp_drafter``), one target verify forward per round, the accepted rows committed. Accept length =
tokens emitted per round (accepted drafts + the bonus), SGLang's definition.

The emitted text is checked token for token against plain greedy decoding, so a number here is never the number
of a wrong decoder.

Usage: python scripts/accept_tiny_v4.py --model models/tiny-v4 --n 10 --max-new 64
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_v4_data as data  # noqa: E402


def prompts(tokenizer, n: int) -> dict[str, list[list[int]]]:
    out = {}
    for name, chats in (("gsm8k", data.gsm8k_chats("test")), ("mbpp", data.mbpp_chats("test"))):
        out[name] = [data.first_turn_ids(tokenizer, c) for c in chats[:n]]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-v4")
    ap.add_argument("--n", type=int, default=10, help="prompts per dataset (GSM8K test, MBPP test)")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--configs", default="8,4,4;8,2,7;8,1,7", help="D,K,S triples separated by ';'")
    ap.add_argument("--score-temperature", type=float, default=None,
                    help="draft-score temperature of the trees (default: the model's calibrated one, as served)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from sglang_tree_v4.checkpoint.weights import load_model
    from sglang_tree_v4.speculative.server_args import checkpoint_score_temperature
    from sglang_tree_v4.testing.offline import plain_greedy, speculative_greedy
    from sglang_tree_v4.testing.runner import DSV4Runner

    model = load_model(args.model)
    tok = AutoTokenizer.from_pretrained(args.model)
    temperature = args.score_temperature or checkpoint_score_temperature(args.model)
    runner = DSV4Runner(model, num_slots=8192, max_len=2048, max_reqs=4)
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";")]
    result: dict = {"model": args.model, "max_new": args.max_new, "prompts_per_dataset": args.n,
                    "score_temperature": temperature, "results": []}
    for name, ps in prompts(tok, args.n).items():
        for D, K, S in configs:
            t0, rounds, emitted = time.time(), 0, 0
            for p in ps:
                run = speculative_greedy(runner, p, D, K, S, args.max_new, tok.eos_token_id, temperature)
                toks, acc = run.tokens, run.accepts
                if toks != plain_greedy(runner, p, len(toks)):
                    raise SystemExit(f"{name} D={D} K={K} S={S}: speculative output differs from greedy")
                rounds, emitted = rounds + len(acc), emitted + sum(acc)
            row = {"dataset": name, "D": D, "K": K, "S": S, "T": temperature, "rounds": rounds, "tokens": emitted,
                   "accept_length": round(emitted / max(rounds, 1), 3), "seconds": round(time.time() - t0, 1)}
            result["results"].append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
