"""Measure the cost of one target verify pass vs tokens per pass on a GPU, for the cost model.

Why: ``cost_model.py`` predicts GPU throughput from accept lengths and the cost of a verify pass as a function of
the tokens it carries (batch size x budget D). This script measures that curve with the project's own DeepSeek-V4
stack (``sglang_tree_v4.dsv4``, random weights) at V4-Flash per-layer shapes -- hidden 4096, 64 heads of 512,
window 128, CSA 4 / HCA 128, 64 index heads, index top-k 512, 256 routed experts of width 2048 (top-6) -- with a few
layers (``--layers``: compress ratio per layer), so that a full-model cost is the per-layer cost times 43.

For each batch size b and budget D it times ``TreeVerifier.verify`` (eager, op "verify") and the fixed-shape step
``dsv4.verify_step`` (forward + greedy acceptance + commit) captured as one CUDA graph with
``torch.cuda.set_sync_debug_mode("error")`` during warm-up and capture (op "step_graph"; "step_fixed" uncaptured,
``--no-graph`` or on a CPU), median wall time, over b requests that share a ``--context``-token prefix, for the
matched chain and for an EAGLE-like tree of the same D; D=1 is plain decoding (no speculation). One JSONL line per
(op, shape, b, D): tokens = b*D, median_ms, layers, experts, ...

    python benchmark/gpu_verify_cost.py [--out benchmark/results/gpu_verify_cost.jsonl] [--quick]
    python benchmark/cost_model.py benchmark/results/tree_vs_chain_cpu.jsonl \
        --verify-curve benchmark/results/gpu_verify_cost.jsonl

Without CUDA it says so and exits with status 2 (``--allow-cpu`` runs a tiny-shape smoke test of the code path).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_common import git_commit


def flash_like_config(layers: list[int], experts: int, hidden: int, heads: int, moe_inter: int, vocab: int,
                      index_heads: int, index_topk: int) -> dict:
    """DeepSeek-layout config with V4-Flash per-layer dimensions (overridable for a CPU smoke test)."""
    return {
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": len(layers), "num_attention_heads": heads,
        "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 448,
        "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
        "compress_ratios": layers + [0], "index_n_heads": index_heads, "index_head_dim": 128,
        "index_topk": index_topk, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": min(6, experts),
        "moe_intermediate_size": moe_inter, "num_hash_layers": 1, "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "num_nextn_predict_layers": 1, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6,
    }


@torch.no_grad()
def randomize_on_device(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Random values generated where the weights live (a CPU generator would move ~60 GB through the host);
    norms near 1, sinks/positional/HC bases and scales non-degenerate, hash routing a random expert choice."""
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.normal_(1.0, 0.1)
        elif name.endswith((".ape", "attn_sink", ".base")):
            p.normal_(0.0, 0.5)
        elif name.endswith(".scale"):
            p.normal_(1.0, 0.2)
        else:
            p.normal_(0.0, std)
    n_exp = model.cfg.n_routed_experts
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.rand(b.shape[0], n_exp, device=b.device).argsort(dim=1)[:, : b.shape[1]].to(b.dtype))
        elif name.endswith("gate.bias"):
            b.normal_(0.0, 0.1)


def eagle_like(budget: int, topk: int = 4) -> list[int]:
    """Parents of a D-node tree: the root's top-k children, then two children of the two best nodes per level."""
    par, level = [-1], [0]
    while len(par) < budget:
        nxt = []
        for p in (level if len(par) == 1 else level[:2]):
            for _ in range(topk if len(par) == 1 else 2):
                if len(par) < budget:
                    par.append(p)
                    nxt.append(len(par) - 1)
        level = nxt
    return par


def timed_ms(fn, sync, reps: int) -> float:
    fn()  # warm-up (allocator, kernels)
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def captured_step(model, runner, rids, toks, par, d: int, capacity: int, sync, reps: int, capture: bool) -> float:
    """The fixed-shape verify step (``dsv4.verify_step``: forward, greedy acceptance, accepted-path commit) with
    static inputs, warmed up and (on CUDA) captured as one CUDA graph under ``set_sync_debug_mode("error")``, so any
    host synchronisation inside the step raises; returns the median ms of a replay (eager calls without capture).
    Replays are idempotent: each node rewrites its own slot before the commit copies the accepted rows."""
    from sglang_tree_v4.dsv4.storage import StepCaps
    from sglang_tree_v4.dsv4.verify_step import verify_step
    from sglang_tree_v4.tree import DraftTree

    dev = toks.device
    tree = DraftTree.from_parents(toks, par)  # validated here, outside the step
    lens = torch.tensor([runner.lens[r] for r in rids], device=dev)
    scratch = torch.tensor([runner.alloc.alloc(d) for _ in rids], device=dev)
    rid_t = torch.tensor(rids, device=dev)
    caps = StepCaps(capacity)

    def step():
        return verify_step(model, runner.store, runner.req_table, rid_t, lens, tree, scratch, scratch, caps)

    try:
        if not capture:
            return timed_ms(step, sync, reps)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(side):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return timed_ms(graph.replay, sync, reps)
    finally:
        runner.req_table[rid_t[:, None], lens[:, None] + torch.arange(d, device=dev)] = -1
        runner.alloc.release(scratch.flatten().tolist())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmark/results/gpu_verify_cost.jsonl")
    ap.add_argument("--layers", default="0,4,128,4", help="compress ratio per layer (0 = sliding only)")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--moe-inter", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--index-heads", type=int, default=64)
    ap.add_argument("--index-topk", type=int, default=512)
    ap.add_argument("--context", type=int, default=1024, help="shared prefix tokens per request")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--budgets", default="1,5,6,7,8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="batch 1,8,64; budgets 1,8; 5 reps")
    ap.add_argument("--allow-cpu", action="store_true", help="smoke-test the code path on a CPU (tiny shapes)")
    ap.add_argument("--no-graph", action="store_true", help="time the fixed-shape step eagerly, without capture")
    a = ap.parse_args()
    if not torch.cuda.is_available() and not a.allow_cpu:
        print("gpu_verify_cost.py needs a CUDA GPU (none found); nothing measured. "
              "The cost model then uses its stated curve (benchmark/cost_model.py).", file=sys.stderr)
        return 2
    if a.quick:
        a.batch_sizes, a.budgets, a.reps = "1,8,64", "1,8", 5
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    from sglang_tree_v4.dsv4.config import DSV4Config
    from sglang_tree_v4.dsv4.model import DSV4Model
    from sglang_tree_v4.dsv4.tree_state import TreeVerifier
    from sglang_tree_v4.testing.runner import DSV4Runner

    ratios = [int(x) for x in a.layers.split(",")]
    cfg = DSV4Config.from_dict(flash_like_config(ratios, a.experts, a.hidden, a.heads, a.moe_inter, a.vocab,
                                                 a.index_heads, a.index_topk))
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with dev:
        model = DSV4Model(cfg, with_mtp=False).eval()
    torch.set_default_dtype(prev)
    randomize_on_device(model, seed=0)
    batches = [int(x) for x in a.batch_sizes.split(",")]
    budgets = [int(x) for x in a.budgets.split(",")]
    runner = DSV4Runner(model, num_slots=a.context + max(batches) * (max(budgets) + 8) + 64,
                        max_len=a.context + max(budgets) + 8, max_reqs=max(batches))
    base = runner.add_request()
    g = torch.Generator().manual_seed(0)
    for start in range(0, a.context, 512):  # chunked prefill of the shared prefix
        runner.extend([base], [torch.randint(0, a.vocab, (min(512, a.context - start),), generator=g)])
    rids = [base] + [runner.fork(base) for _ in range(max(batches) - 1)]
    tv = TreeVerifier(runner)
    rng = random.Random(0)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as out:
        for d in budgets:
            shapes = {"none": [-1]} if d == 1 else {"chain": [-1] + list(range(d - 1)), "tree": eagle_like(d)}
            for shape, par_list in shapes.items():
                for b in batches:
                    sub = rids[:b]
                    toks = torch.tensor([[rng.randrange(a.vocab) for _ in range(d)] for _ in range(b)], device=dev)
                    par = torch.tensor([par_list] * b, dtype=torch.long, device=dev)
                    nn = torch.full((b,), d, dtype=torch.long, device=dev)

                    def once(sub=sub, toks=toks, par=par, nn=nn):
                        tv.verify(sub, toks, par, nn)
                        for r in sub:
                            tv.rollback(r)

                    graph = dev.type == "cuda" and not a.no_graph
                    timings = {"verify": timed_ms(once, sync, a.reps),
                               "step_graph" if graph else "step_fixed": captured_step(
                                   model, runner, sub, toks, par, d, runner.req_table.shape[1], sync, a.reps,
                                   graph)}
                    for op, ms in timings.items():
                        rec = {"op": op, "shape": shape, "batch_size": b, "budget": d, "tokens": b * d,
                               "median_ms": ms, "layers": len(ratios), "compress_ratios": ratios,
                               "experts": a.experts, "hidden": a.hidden, "context": a.context, "dtype": str(dtype),
                               "device": name, "torch": torch.__version__, "commit": git_commit()}
                        out.write(json.dumps(rec) + "\n")
                        out.flush()
                        print(f"{op:>10} {shape:>5} D={d} b={b:>3} tokens={b * d:>4}: {ms:8.2f} ms", flush=True)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
