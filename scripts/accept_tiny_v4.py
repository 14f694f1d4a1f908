"""Accepted length of MTP tree drafting vs the matched MTP chain on ``models/tiny-v4``, greedy, without SGLang.

Each round over committed length L with root (bonus) token b: the MTP catches up over the newly committed
positions (its last query is the root's draft), ``tree.build_draft_tree`` expands with the MTP over scratch slots
(``spec.mtp_drafter.MTPTreeDrafter``, the drafter the SGLang worker uses), the target verifies all nodes in one
forward (``dsv4.tree_state.TreeVerifier``), ``tree.verify_greedy`` picks the accepted path, and the accepted rows
are committed. Accept length = tokens emitted per round (accepted drafts + the bonus), SGLang's definition.

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


@torch.no_grad()
def speculative_greedy(runner, prompt: list[int], D: int, K: int, S: int, max_new: int, eos: int,
                       score_temperature: float = 1.0):
    """-> (emitted tokens, accept length per round). Stops at ``max_new`` tokens (the last round may pass it, as in
    serving) or at the first eos."""
    from sglang_tree_v4.dsv4.mtp_draft import MTPTreeDrafter as Refresher
    from sglang_tree_v4.dsv4.tree_state import TreeVerifier
    from sglang_tree_v4.spec.mtp_drafter import MTPTreeDrafter
    from sglang_tree_v4.tree import build_draft_tree, verify_greedy

    refresher, tv = Refresher(runner), TreeVerifier(runner)
    rid = runner.add_request()
    out = runner.extend([rid], [prompt])[0]
    bonus = int(out.logits[-1].argmax())
    root = refresher.refresh(rid, out.streams, prompt[1:] + [bonus])
    emitted, accepts = [bonus], []
    while len(emitted) < max_new and eos not in emitted:
        L = runner.lens[rid]
        slots = torch.tensor(runner.alloc.alloc(D + K * (S - 1)), dtype=torch.long)
        runner.req_table[rid, L:L + slots.numel()] = slots
        drafter = MTPTreeDrafter(runner.model, runner.mtp_store, runner.req_table[rid:rid + 1],
                                 torch.tensor([L]), D, K)
        tree = build_draft_tree(torch.tensor([bonus]), torch.tensor([L]), drafter, S, K, D,
                                root_draft=(root.logits[None], root.streams[None]),
                                score_temperature=score_temperature)
        n = int(tree.num_nodes[0])
        res = tv.verify([rid], tree.tokens[:, :n], tree.parents[:, :n], tree.num_nodes, scratch=[slots[:D]])
        logits = torch.zeros(1, tree.width, res.logits[0].shape[-1])
        logits[0, :n] = res.logits[0]
        vr = verify_greedy(tree, logits)
        k = int(vr.accept_lens[0])
        acc = vr.accepted_nodes[0, :k].tolist()
        new = vr.tokens[0, :k].tolist()  # accepted draft tokens (depth >= 1) then the bonus
        tv.commit(rid, acc)
        runner.alloc.release(slots[D:].tolist())
        root = refresher.refresh(rid, res.streams[0][acc], new)
        bonus = new[-1]
        if eos in new:  # the request ends at its first eos, even one accepted mid-round
            new = new[: new.index(eos) + 1]
        emitted += new
        accepts.append(len(new))
    runner.release(rid)
    return emitted, accepts


@torch.no_grad()
def plain_greedy(runner, prompt: list[int], n: int) -> list[int]:
    rid = runner.add_request()
    tok = int(runner.extend([rid], [prompt])[0].logits[-1].argmax())
    out = [tok]
    while len(out) < n:
        tok = int(runner.decode([rid], [tok])[0].logits[0].argmax())
        out.append(tok)
    runner.release(rid)
    return out


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
    from sglang_tree_v4.dsv4.runner import DSV4Runner
    from sglang_tree_v4.dsv4.weights import load_model
    from sglang_tree_v4.spec.server_args import checkpoint_score_temperature

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
                toks, acc = speculative_greedy(runner, p, D, K, S, args.max_new, tok.eos_token_id, temperature)
                ref = plain_greedy(runner, p, len(toks))
                if toks != ref:
                    raise SystemExit(f"{name} D={D} K={K} S={S}: speculative output differs from greedy")
                rounds, emitted = rounds + len(acc), emitted + sum(acc)
            row = {"dataset": name, "D": D, "K": K, "S": S, "T": temperature, "rounds": rounds, "tokens": emitted,
                   "accept_length": round(emitted / max(rounds, 1), 3), "seconds": round(time.time() - t0, 1)}
            result["results"].append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
