"""Train the embedded DSpark model, ``models/tiny-v4-dspark``: a DSpark block drafter over the frozen ``tiny-v4``.

The target (embedding, LM head and every layer) is frozen and copied bit for bit; only the drafter learns. Each
step takes ``--batch`` packed 256-token rows of the same chat mix the target was trained on, runs the target once
(no gradient) for its logits and its features at the tapped layers (``--taps``), writes every position's stage keys
from those features, and drafts ``--anchors`` random blocks per row: anchor = the data token at position L, context
= positions below L, rows j = 0 .. γ - 1 predicting the token at L + j + 1 with the Markov head teacher-forced on the
data token before it. DSpark's loss per row, weighted ``exp(-j / 4)``:

    0.1 · CE(data token) + 0.9 · TV(draft, target) + BCE(confidence, 1 - TV)

(TV: total variation between the row's draft distribution and the target's next-token distribution there.)
AdamW, warmup then cosine, gradient clipping 1.0, one torch thread.

Resumable: ``--state`` (outside the model folder) keeps the drafter, the optimizer and the step; ``--minutes``
stops early and saves it, and the same command resumes. The model folder is written at every ``--save-every``
and at the end: the target's files with its ``mtp.*`` tensors replaced by DSpark's (``mtp.{s}.*``, main_proj on
stage 0, the heads on the last stage) and the ``dspark_*`` config keys.

Usage (from the repository root):
    python scripts/train_tiny_v4_dspark.py --log dspark_train.log
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_v4_data as data  # noqa: E402
from train_tiny_v4 import lr_at, token_stream  # noqa: E402

from sglang_tree_v4.checkpoint.dspark_files import write_dspark_model  # noqa: E402
from sglang_tree_v4.checkpoint.weights import load_model  # noqa: E402
from sglang_tree_v4.dsv4 import dspark as ds  # noqa: E402


def init_drafter(drafter: torch.nn.Module, seed: int, n_layers: int) -> None:
    """Seeded init (zeros in the constructors are for loading: zero experts or HC projections never train)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith(".fn") or name.endswith("gate.weight"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            elif name.endswith("markov_head.head.weight"):
                p.zero_()  # the Markov bias starts at nothing: U alone
            elif p.dim() >= 2:
                std = p.shape[-1] ** -0.5
                if any(name.endswith(s) for s in ("wo_b.weight", ".w2", "w2.weight")):
                    std /= (2 * n_layers) ** 0.5
                p.copy_(std * torch.randn(p.shape, generator=g))


def dspark_loss(model, ids: torch.Tensor, anchors: int, gen: torch.Generator) -> tuple[torch.Tensor, dict]:
    """ids [B, T] -> (loss, figures): see the module doc."""
    dcfg: ds.DSparkConfig = model.dspark.dcfg
    B, T = ids.shape
    gamma, W = dcfg.block_size, model.cfg.window
    with torch.no_grad():
        out = model.forward_sequences(ids, taps=dcfg.target_layer_ids)
    n_blocks = B * anchors
    store = ds.new_dspark_store(model.cfg, dcfg, B * T + n_blocks * gamma)
    ds.write_context(model, out.features.reshape(B * T, -1), torch.arange(T).repeat(B), torch.arange(B * T), store)
    rows = torch.arange(B).repeat_interleave(anchors)
    L = torch.randint(1, T - gamma, (n_blocks,), generator=gen)
    ctx = L[:, None] - W + torch.arange(W)
    block = B * T + torch.arange(n_blocks * gamma).view(n_blocks, gamma)
    keys = torch.cat([torch.where(ctx >= 0, rows[:, None] * T + ctx, -1), block], 1)
    got = ds.block_logits(model, ids[rows, L], L, keys, block, store)
    j = torch.arange(gamma)
    at = L[:, None] + j  # the row's parent position; it predicts the token after it
    prev, labels = ids[rows[:, None], at], ids[rows[:, None], at + 1]
    cond = ds.conditional_logits(model, got.logits, prev)
    logp = cond.log_softmax(-1)
    target = out.logits[rows[:, None], at].float().softmax(-1)
    ce = F.nll_loss(logp.flatten(0, 1), labels.flatten(), reduction="none").view(n_blocks, gamma)
    tv = 0.5 * (logp.exp() - target).abs().sum(-1)
    conf = ds.confidence(model, got.hidden, prev)
    bce = F.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), (1 - tv).detach(), reduction="none")
    w = torch.exp(-j.float() / 4)
    loss = ((0.1 * ce + 0.9 * tv + bce) * w).sum(1).mean() / w.sum()
    agree = (cond.argmax(-1) == target.argmax(-1)).float().mean(0)
    return loss, {"ce": ce.mean().item(), "tv": tv.mean().item(), "bce": bce.mean().item(),
                  "agree": [round(a, 3) for a in agree.tolist()]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="models/tiny-v4")
    ap.add_argument("--out", default="models/tiny-v4-dspark")
    ap.add_argument("--state", default="tiny_v4_dspark_state.pt", help="resume state (not part of the model)")
    ap.add_argument("--log", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--taps", default="1,3", help="target layers whose output features the drafter reads")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--anchors", type=int, default=24, help="blocks drafted per row per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--sharegpt-train", type=int, default=1200)
    ap.add_argument("--mbpp-repeats", type=int, default=3)
    ap.add_argument("--save-every", type=int, default=250)
    ap.add_argument("--minutes", type=float, default=0, help="stop (resumably) after this long; 0: no limit")
    ap.add_argument("--stop-at", type=int, default=0,
                    help="stop (resumably) before this step, writing the model (the schedule stays --steps)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--export", action="store_true", help="only write the model folder from --state")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from transformers import AutoTokenizer
    target = Path(args.target)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    model = load_model(str(target), with_mtp=False)
    for p in model.parameters():
        p.requires_grad_(False)
    dspark_keys = {"dspark_block_size": args.gamma, "dspark_markov_rank": args.rank,
                   "dspark_markov_head_type": "vanilla", "dspark_noise_token_id": tokenizer.pad_token_id,
                   "dspark_target_layer_ids": [int(t) for t in args.taps.split(",")]}
    dcfg = ds.DSparkConfig.from_dict(dspark_keys, model.cfg.num_layers, model.cfg.vocab_size)
    model.dspark = ds.DSparkDrafter(model.cfg, dcfg)
    init_drafter(model.dspark, args.seed, dcfg.num_stages)
    opt = torch.optim.AdamW(model.dspark.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    start, spent, state = 0, 0.0, {}
    if os.path.exists(args.state):
        state = torch.load(args.state)
        model.dspark.load_state_dict(state["drafter"])
        opt.load_state_dict(state["opt"])
        start, spent = state["step"], state["seconds"]
        print(f"resuming at step {start} ({spent:.0f} s trained)")
    if args.export:
        if not state:
            raise SystemExit(f"--export: no training state at {args.state}")
        meta = {"args": state.get("args", {}), "drafter_params": sum(p.numel() for p in model.dspark.parameters()),
                "target": "tiny-v4 (frozen, bit-identical)", "steps_done": start, "train_seconds": round(spent)}
        write_dspark_model(model.eval(), target, Path(args.out), dspark_keys, meta)
        return

    train_src, _ = data.corpus(args.sharegpt_train, 0)
    texts = data.mixed_texts(train_src, {"mbpp": args.mbpp_repeats}, args.seed + 1)
    stream = token_stream(tokenizer, texts, args.steps * args.batch * args.seq).view(args.steps, args.batch, args.seq)
    n_params = sum(p.numel() for p in model.dspark.parameters())
    meta = {"args": {k: v for k, v in vars(args).items() if k not in ("log", "state")}, "drafter_params": n_params,
            "target": "tiny-v4 (frozen, bit-identical)"}
    log = open(args.log, "a") if args.log else None
    if log and start == 0:
        log.write(f"# drafter params={n_params} args={json.dumps(meta['args'])}\n")
        log.write("step\tloss\tce\ttv\tbce\tagree_by_row\tlr\tsec\n")
    t0 = time.time() - spent
    model.dspark.train()
    step = start
    for step in range(start, args.steps):
        if args.minutes and time.time() - t0 - spent > args.minutes * 60:
            break
        if args.stop_at and step >= args.stop_at:
            write_dspark_model(model.eval(), target, Path(args.out), dspark_keys,
                               {**meta, "steps_done": step, "train_seconds": round(time.time() - t0)})
            break
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for gr in opt.param_groups:
            gr["lr"] = lr
        gen = torch.Generator().manual_seed(args.seed * 100003 + step)
        loss, fig = dspark_loss(model, stream[step], args.anchors, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.dspark.parameters(), 1.0)
        opt.step()
        line = (f"{step}\t{loss.item():.4f}\t{fig['ce']:.4f}\t{fig['tv']:.4f}\t{fig['bce']:.4f}\t"
                f"{','.join(map(str, fig['agree']))}\t{lr:.2e}\t{time.time() - t0:.0f}")
        if log:
            log.write(line + "\n")
            log.flush()
        if step % 25 == 0:
            print(line, flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            done = step + 1
            torch.save({"drafter": model.dspark.state_dict(), "opt": opt.state_dict(), "step": done,
                        "seconds": time.time() - t0, "args": meta["args"]}, args.state)
            write_dspark_model(model.eval(), target, Path(args.out), dspark_keys,
                        {**meta, "steps_done": done, "train_seconds": round(time.time() - t0)})
            model.dspark.train()
    else:
        step = args.steps
    if step < args.steps:  # stopped by --minutes
        torch.save({"drafter": model.dspark.state_dict(), "opt": opt.state_dict(), "step": step,
                    "seconds": time.time() - t0, "args": meta["args"]}, args.state)
        print(f"stopped at step {step}; the same command resumes")


if __name__ == "__main__":
    main()
