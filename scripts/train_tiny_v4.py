"""Train the embedded default model, ``models/tiny-v4``: a byte-level BPE and a small DeepSeek-V4 + its MTP layer,
jointly, on chat-formatted GSM8K train, MBPP train (task ids 601-974) and ShareGPT conversations.

Sized for a 2-core CPU in under an hour: ~2.5M parameters, one torch thread (on a shared 2-core machine a second
thread measured far slower), a fixed number of steps over a fixed, seeded token stream, so the same command
reproduces the same weights on the same torch build.

Loss = target next-token CE + ``--mtp-weight`` * MTP CE (token p+2 from the target's streams at p and the token at
p+1). The streams are NOT detached by default: as in DeepSeek's own MTP training, the MTP gradient also shapes the
trunk, which (a) densifies the training signal of a data-starved model and (b) lets the trunk carry in its streams
what the draft layer needs to agree with the target -- agreement is what speculative decoding is paid for.
``--detach-mtp`` trains the draft layer on frozen-trunk features instead.

Usage (from the repository root):
    python scripts/train_tiny_v4.py --out models/tiny-v4 --log tiny_v4_train.log
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_v4_data as data  # noqa: E402
import tiny_v4_model as tm  # noqa: E402


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (every byte string is encodable) with the chat's special tokens; no post-processor, so the
    chat template alone places bos/eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=data.SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=data.BOS, eos_token=data.EOS,
                                   pad_token=data.PAD, chat_template=data.CHAT_TEMPLATE,
                                   model_max_length=4096)


def token_stream(tokenizer, texts: list[str], n_tokens: int) -> torch.Tensor:
    """Rendered chats (already containing bos/eos) concatenated until ``n_tokens`` (documents are packed)."""
    ids: list[int] = []
    epoch = 0
    while len(ids) < n_tokens:  # past the end of the corpus: start it over (a later stage may need that)
        for t in texts:
            ids.extend(tokenizer.encode(t, add_special_tokens=False))
            if len(ids) >= n_tokens:
                break
        epoch += 1
        if epoch > 8:
            raise SystemExit(f"corpus too small for {n_tokens} tokens")
    return torch.tensor(ids[:n_tokens], dtype=torch.long)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def save(model, tokenizer, cfg: dict, out: Path, meta: dict) -> None:
    """Weights in DeepSeek naming (``save_checkpoint``), then the config rewritten in HF's layout."""
    from sglang_tree_v4.checkpoint.weights import save_checkpoint
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, str(out))
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    tokenizer.save_pretrained(str(out))
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")
    (out / "training_meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/tiny-v4")
    ap.add_argument("--log", default=None, help="loss log (TSV), kept outside the model folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=3072)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--hca-ratio", type=int, default=16)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--detach-mtp", action="store_true")
    ap.add_argument("--mtp-distill", type=float, default=0.0,
                    help="share of the MTP loss taken against the target's own next-token distribution")
    ap.add_argument("--sharegpt-train", type=int, default=1200)
    ap.add_argument("--mbpp-repeats", type=int, default=3)
    ap.add_argument("--save-every", type=int, default=50, help="intermediate checkpoints (same folder)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--init", default=None,
                    help="continue from this checkpoint (weights AND tokenizer; a fresh optimizer and schedule)")
    ap.add_argument("--skip-steps", type=int, default=0,
                    help="skip the first N*batch*seq tokens of the stream (those an earlier stage trained on)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    from tqdm import tqdm

    train_src, _ = data.corpus(args.sharegpt_train, 0)
    texts = data.mixed_texts(train_src, {"mbpp": args.mbpp_repeats}, args.seed)
    if args.init:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.init)
    else:
        tokenizer = train_tokenizer(texts, args.vocab)
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tokenizer.apply_chat_template(probe, tokenize=False) == data.render(probe), "template drift"

    n_tok = args.steps * args.batch * args.seq
    skip = args.skip_steps * args.batch * args.seq
    stream = token_stream(tokenizer, texts, skip + n_tok)[skip:].view(args.steps, args.batch, args.seq)
    cfg = tm.hf_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, args.hidden,
                       args.hca_ratio, args.window)
    if args.init:
        from sglang_tree_v4.checkpoint.weights import load_model
        model = load_model(args.init).train()
        cfg = json.loads((Path(args.init) / "config.json").read_text())
    else:
        model = tm.build_model(cfg, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    # the log path is machine-local: kept out of the model folder
    meta = {"args": {k: v for k, v in vars(args).items() if k != "log"}, "params": n_params, "train_tokens": n_tok,
            "sources": {k: len(v) for k, v in train_src.items()}}
    log = open(args.log, "w") if args.log else None
    if log:
        log.write(f"# params={n_params} tokens={n_tok} args={json.dumps(vars(args))}\n")
        log.write("step\tloss\ttarget_ce\tmtp_ce\tlr\tsec\n")
    out = Path(args.out)
    t0 = time.time()
    bar = tqdm(range(args.steps), desc="train", mininterval=5)
    for step in bar:
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for gr in opt.param_groups:
            gr["lr"] = lr
        loss, tgt, mtp, _, _ = tm.joint_loss(model, stream[step], args.mtp_weight, args.detach_mtp,
                                              args.mtp_distill)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(tgt=f"{tgt.item():.3f}", mtp=f"{mtp.item():.3f}")
        if log:
            log.write(f"{step}\t{loss.item():.4f}\t{tgt.item():.4f}\t{mtp.item():.4f}\t{lr:.2e}\t"
                      f"{time.time() - t0:.0f}\n")
            log.flush()
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save(model.eval(), tokenizer, cfg, out, {**meta, "steps_done": step + 1})
            model.train()
    meta.update(steps_done=args.steps, train_seconds=round(time.time() - t0))
    save(model.eval(), tokenizer, cfg, out, meta)
    if log:
        log.write(f"# done in {time.time() - t0:.0f}s\n")
        log.close()


if __name__ == "__main__":
    main()
