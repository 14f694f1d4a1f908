"""The one GPU check: environment, kernels against their references, and one CSA and one HCA decoder layer at
V4-Flash TP4 shapes, each timing beside the floor its bytes set at the measured bandwidth.

Why one script: a GPU is lent rarely and briefly, with torch, Triton and nvcc but no SGLang, FlashInfer or
sgl_kernel. This imports only torch, Triton, numpy and the project (the others are blocked at import, so a stray
dependency fails here, on the CPU, in CI), writes each record as soon as it has it, and goes on past a failure.

    python benchmark/gpu_check.py              # on the GPU: about 5 minutes on an H200
    python benchmark/gpu_check.py --dry-run    # tiny shapes on the CPU under TRITON_INTERPRET=1 (CI)

Records (one JSON line each, to stdout and to ``$OUT/gpu_check.jsonl`` when ``OUT`` is set): ``op`` (``env``,
``copy``, ``kernel:<name>``, ``layer:csa``, ``layer:hca``, ``mtp``), ``shape`` (``tree`` D=8 K=3 S=4-like,
``chain``, ``none``), ``batch``, ``draft_tokens``, ``context``, ``graph`` (captured as a CUDA graph; the dry run
calls eagerly and says so in ``note``), ``median_ms``, ``floor_ms`` (bytes the call must move / measured copy
bandwidth), ``ratio``, ``error`` (null, or why the check failed). Kernels: floor from their traffic declarations
(``sgl_kernel_ext.traffic``); layers: the layer's non-expert weights + the routed experts actually drawn + the
state its queries read (window keys, index keys and selected entries, HCA entries). No autotuning anywhere.
``--break KERNEL`` makes one kernel raise (the negative control: its record carries the error, the rest runs).
"""
from __future__ import annotations

import argparse
import importlib.abc
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

BLOCKED = ("sglang", "flashinfer", "sgl_kernel", "triton_kernels")


class _Blocked(importlib.abc.MetaPathFinder):
    """Stands for a machine without these packages: importing one raises ImportError."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"gpu_check imports nothing from {name.split('.')[0]}")
        return None


sys.meta_path.insert(0, _Blocked())
HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "python", HERE.parent / "sgl-kernel-ext"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402
from bench_common import git_commit  # noqa: E402
from gpu_verify_cost import timed_ms  # noqa: E402

KERNELS = ("tree_sparse_attention", "compress_entries", "fp8_block_linear", "routed_experts_fp4", "hc_pre",
           "hc_pre_norm", "hc_post", "rms_norm", "rms_norm_rope", "indexer_scores", "moe_route", "swiglu")


class Recorder:
    def __init__(self, device: str, commit: str):
        self.device, self.commit = device, commit
        out = os.environ.get("OUT")
        self.file = open(Path(out) / "gpu_check.jsonl", "a") if out else None  # noqa: SIM115
        self.count = 0

    def emit(self, op: str, **fields) -> dict:
        rec = {"op": op, "shape": None, "batch": None, "draft_tokens": None, "context": None, "graph": False,
               "median_ms": None, "floor_ms": None, "ratio": None, "error": None}
        rec.update(fields)
        if rec["median_ms"] and rec["floor_ms"]:
            rec["ratio"] = round(rec["median_ms"] / rec["floor_ms"], 3)
        rec.update(device=self.device, commit=self.commit)
        line = json.dumps(rec)
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()
        self.count += 1
        return rec


def environment(rec: Recorder, dev: torch.device, sync, dry: bool) -> float:
    """The env record, then the copy bandwidth (bytes read + written per second) every floor is measured against."""
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0]}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory
                    / 2**30, 1), cuda=torch.version.cuda)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    rec.emit("env", **info)
    n = (16 << 20) if dry else (2 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), sync, 3 if dry else 20)
    bandwidth = 2 * n / (ms / 1e3)
    rec.emit("copy", median_ms=ms, floor_ms=ms, bytes=2 * n, bytes_per_s=bandwidth)
    return bandwidth


# ---- kernels ---------------------------------------------------------------------------------------------------

def kernel_cases(dev: torch.device, dry: bool) -> dict:
    """name -> (kernel call, reference call, custom-op name, op args, tolerance), at V4-Flash TP4 decode sizes (a
    32-request D=8 tree's 256 nodes) or tiny ones."""
    from sgl_kernel_ext import cases, ops, reference
    from sgl_kernel_ext.fp8_linear import fp8_block_linear
    from sgl_kernel_ext.hyper_connection import hc_post, hc_post_ref, hc_pre, hc_pre_ref
    from sgl_kernel_ext.indexer import indexer_scores, indexer_scores_ref
    from sgl_kernel_ext.moe_route import moe_route, moe_route_ref
    from sgl_kernel_ext.rms_norm import rms_norm, rms_norm_ref
    from sgl_kernel_ext.rms_norm_rope import rms_norm_rope, rms_norm_rope_ref
    from sgl_kernel_ext.routed_experts import routed_experts, routed_experts_ref
    from sgl_kernel_ext.swiglu import swiglu_op, swiglu_ref
    from sgl_kernel_ext.weight_formats import fp8_block_matmul, quantize_fp4, quantize_fp8_block

    bf = torch.bfloat16
    n = 4 if dry else 256
    heads, dim, hidden, inter, experts = (4, 64, 128, 64, 4) if dry else (16, 512, 4096, 2048, 64)
    ihd, iheads, entries = (32, 4, 40) if dry else (128, 64, 2048)
    torch.manual_seed(0)
    out = {}
    a = cases.attention_case(n, heads, dim, 16 if dry else 128, 8 if dry else 512, bf, dev)
    out["tree_sparse_attention"] = (
        lambda: ops.tree_sparse_attention(**a, backend="triton"),
        lambda: reference.tree_sparse_attention_ref(**a), "sgl_kernel_ext::tree_sparse_attention",
        (a["q"], a["kv_a"], a["idx_a"], a["kv_b"], a["idx_b"], a["sink"], a["scale"]), 2e-2)
    c = cases.compress_case(n, "csa", dim, 4, 16 if dry else 64, bf, dev)
    c.pop("out_dtype", None)
    out["compress_entries"] = (
        lambda: ops.compress_entries(**c, backend="triton"), lambda: reference.compress_entries_ref(**c),
        "sgl_kernel_ext::compress_entries", (c["kv_store"], c["score_store"], c["idx"], c["col_off"], c["ape"],
                                             c["norm_w"], c["eps"], c["cos"], c["sin"], bf), 2e-2)
    w8, s8 = quantize_fp8_block(torch.randn(hidden // 4 if dry else 1024, hidden) * 0.05)
    w8, s8 = w8.to(dev), s8.to(dev)
    x = torch.randn(n, hidden, device=dev).to(bf)
    out["fp8_block_linear"] = (
        lambda: fp8_block_linear(x, w8, s8, backend="triton"), lambda: fp8_block_matmul(x, w8, s8),
        "sgl_kernel_ext::fp8_block_linear", (x, w8, s8, 0, 0), 2e-2)
    packs = [[quantize_fp4(torch.randn(o, i) * 0.05) for _ in range(experts)]
             for o, i in ((inter, hidden), (inter, hidden), (hidden, inter))]
    (w1, s1), (w3, s3), (w2, s2) = [(torch.stack([p[0] for p in ps]).to(dev), torch.stack([p[1] for p in ps]).to(dev))
                                    for ps in packs]
    idx = torch.stack([torch.randperm(experts)[:min(6, experts)] for _ in range(n)]).to(dev)
    rw = torch.rand(n, idx.shape[1], device=dev)
    re_args = (x, idx, rw, 0, "fp4", w1, w3, w2, s1, s3, s2, 10.0)
    out["routed_experts_fp4"] = (
        lambda: routed_experts(*re_args, backend="triton"), lambda: routed_experts_ref(*re_args),
        "sgl_kernel_ext::routed_experts", re_args + ("triton",), 2e-2)
    hc = 4
    streams = torch.randn(n, hc, hidden, device=dev).to(bf)
    fn, base, scale = (torch.randn((2 + hc) * hc, hc * hidden, device=dev) * 0.02,
                       torch.randn((2 + hc) * hc, device=dev) * 0.1, torch.rand(3, device=dev) + 0.5)
    pre_args = (streams, fn, base, scale, 20, 1e-6, 1e-6)
    out["hc_pre"] = (lambda: hc_pre(*pre_args, backend="triton"), lambda: hc_pre_ref(*pre_args),
                     "sgl_kernel_ext::hc_pre", pre_args, 2e-2)
    _, post, comb = hc_pre_ref(*pre_args)
    post_args = (x, streams, post, comb)
    out["hc_post"] = (lambda: hc_post(*post_args, backend="triton"), lambda: hc_post_ref(*post_args),
                      "sgl_kernel_ext::hc_post", post_args, 2e-2)
    nw = torch.rand(hidden, device=dev).to(bf) + 0.5
    out["rms_norm"] = (lambda: rms_norm(x, nw, 1e-6, backend="triton"), lambda: rms_norm_ref(x, nw, 1e-6),
                       "sgl_kernel_ext::rms_norm", (x, nw, 1e-6), 2e-2)
    # hc_pre with the sub-block's RMSNorm in the same launch (the model's path; the output's first element)
    out["hc_pre_norm"] = (lambda: hc_pre(*pre_args, out_weight=nw, out_eps=1e-6, backend="triton")[0],
                          lambda: hc_pre_ref(*pre_args, out_weight=nw, out_eps=1e-6)[0], "sgl_kernel_ext::hc_pre",
                          pre_args + (nw, 1e-6), 2e-2)
    # the queries' bare RMSNorm then RoPE: [n, heads, head_dim], the last 64 channels rotated
    qh = torch.randn(n, heads, dim, device=dev).to(bf)
    ang = torch.rand(n, 32, device=dev) * 6.28
    rr_args = (qh, None, 1e-6, ang.cos(), ang.sin())
    out["rms_norm_rope"] = (lambda: rms_norm_rope(*rr_args, backend="triton"), lambda: rms_norm_rope_ref(*rr_args),
                            "sgl_kernel_ext::rms_norm_rope", rr_args, 2e-2)
    q = torch.randn(n, iheads, ihd, device=dev).to(bf)
    wq = torch.randn(n, iheads, device=dev)
    keys = torch.randn(entries * (1 if dry else 8), ihd, device=dev).to(bf)
    rows = torch.randint(-1, keys.shape[0], (n, entries), device=dev)
    ix_args = (q, wq, keys, rows, ihd ** -0.5)
    out["indexer_scores"] = (lambda: indexer_scores(*ix_args, backend="triton"),
                             lambda: indexer_scores_ref(*ix_args), "sgl_kernel_ext::indexer_scores", ix_args, 1e-4)
    # The router: all 256 experts' weights (replicated on every rank), top 6 with V4's bias; the error is the
    # weights' (the experts chosen agree up to a flipped rounding at a near tie).
    gate = (torch.randn(16 if dry else 256, hidden, device=dev) * hidden ** -0.5).to(bf)
    gbias = torch.randn(gate.shape[0], device=dev) * 0.1
    mr_args = (x, gate, gbias, 6, 2.5, "sqrtsoftplus")
    out["moe_route"] = (lambda: moe_route(*mr_args, backend="triton")[1].sort(-1).values,
                        lambda: moe_route_ref(*mr_args)[1].sort(-1).values, "sgl_kernel_ext::moe_route", mr_args,
                        2e-2)
    gate_up = (torch.randn(n, inter, device=dev) * 8).to(bf), (torch.randn(n, inter, device=dev) * 8).to(bf)
    out["swiglu"] = (lambda: swiglu_op(*gate_up, 10.0, backend="triton"), lambda: swiglu_ref(*gate_up, 10.0),
                     "sgl_kernel_ext::swiglu", (*gate_up, 10.0), 2e-2)
    return out


def check_kernels(rec: Recorder, dev, sync, bandwidth: float, dry: bool, broken: str | None) -> None:
    from sgl_kernel_ext import cases, traffic

    try:
        built = kernel_cases(dev, dry)
    except Exception as e:  # noqa: BLE001 - one record, then the layers
        rec.emit("kernel:cases", error=f"{type(e).__name__}: {e}")
        return
    for name in KERNELS:
        try:
            kernel, ref, op_name, args, tol = built[name]
            if name == broken:
                def kernel():
                    raise RuntimeError("broken on purpose (--break)")
            got, want = kernel(), ref()
            got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            errs = []
            for g, w in zip(got, want, strict=True):
                finite = torch.isfinite(w)
                if not torch.equal(finite, torch.isfinite(g)):
                    errs.append(float("inf"))
                else:
                    errs.append(cases.rel_err(g[finite], w[finite]))
            ms = timed_ms(kernel, sync, 3 if dry else 20)
            moved = traffic.declared(op_name, args, {})
            nbytes = moved.read + moved.written
            error = None if max(errs) <= tol else f"relative error {max(errs):.3g} > {tol}"
            rec.emit(f"kernel:{name}", median_ms=ms, floor_ms=nbytes / bandwidth * 1e3, bytes=nbytes,
                     launches=moved.launches, rel_err=max(errs), error=error)
        except Exception as e:  # noqa: BLE001 - recorded; the next check runs
            rec.emit(f"kernel:{name}", error=f"{type(e).__name__}: {e}", trace=traceback.format_exc(limit=3))


# ---- layers ----------------------------------------------------------------------------------------------------

def layer_config(ratio: int, dry: bool) -> dict:
    """One decoder layer at a V4-Flash TP4 rank's shapes (16 of 64 heads, 2 of 8 output groups, 64 of 256 routed
    experts) with a small vocabulary (the layer, not the LM head, is timed), and the MTP layer."""
    from gpu_verify_cost import flash_like_config

    if dry:
        cfg = flash_like_config([ratio if ratio == 4 else 8], 4, 128, 4, 64, 256, 4, 8)
        cfg.update(head_dim=64, qk_rope_head_dim=16, qk_nope_head_dim=48, q_lora_rank=64, o_groups=2,
                   o_lora_rank=32, sliding_window=16, index_head_dim=32)
    else:
        cfg = flash_like_config([ratio], 64, 4096, 16, 2048, 1024, 64, 512)
        cfg.update(o_groups=2)
    cfg["num_hash_layers"] = 0
    return cfg


@torch.no_grad()
def quantized_layer_model(raw: dict, dev: torch.device, dtype: torch.dtype):
    """The model with FP8 linears and FP4 routed experts (the published formats), random values on the device."""
    from gpu_verify_cost import randomize_on_device

    from sglang_tree_v4.checkpoint.quantized_modules import FP4Experts, FP8BlockLinear
    from sglang_tree_v4.checkpoint.swap import Quantization, swap_quantized
    from sglang_tree_v4.dsv4.config import DSV4Config
    from sglang_tree_v4.dsv4.model import DSV4Model

    cfg = DSV4Config.from_dict(raw)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with dev:
        model = DSV4Model(cfg, with_mtp=True).eval()
    torch.set_default_dtype(prev)
    randomize_on_device(model, seed=0)
    swap_quantized(model, Quantization(fp8_linears=True, fp4_experts=True))
    for m in model.modules():
        if isinstance(m, FP8BlockLinear):
            m.weight.copy_((torch.randn(m.weight.shape, device=dev) * 0.5).to(m.weight.dtype))
            m.scale.copy_(torch.full_like(m.scale, 2.0 ** -6))
        elif isinstance(m, FP4Experts):
            for name in ("w1", "w2", "w3"):
                getattr(m, name).copy_(torch.randint(0, 256, getattr(m, name).shape, device=dev).to(torch.uint8))
                sc = getattr(m, name + "_scale")
                sc.copy_(torch.full_like(sc, 127 - 6))
    return model


def layer_floor(model, ratio: int, batch: int, context: int, routed: int) -> int:
    """Bytes a verify forward of this one-layer model must move: its non-expert weights, the routed experts drawn,
    and per request the window keys, the CSA index keys and selected entries or the HCA entries."""
    from sglang_tree_v4.dsv4.moe import Experts

    layer = model.layers[0]
    experts = [m for m in layer.modules() if isinstance(m, Experts)][0]
    expert_ids = {id(t) for t in list(experts.parameters()) + list(experts.buffers())}
    tensors = [t for t in list(layer.parameters()) + list(layer.buffers()) if id(t) not in expert_ids]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    one_expert = sum(t.numel() * t.element_size() for t in list(experts.parameters()) + list(experts.buffers()))
    one_expert //= experts.w1.shape[0]
    cfg, el = model.cfg, 2
    state = min(context, cfg.window) * cfg.head_dim * el
    if ratio == 4:
        state += (context // 4) * cfg.index_head_dim * el + min(cfg.index_topk, context // 4) * cfg.head_dim * el
    else:
        state += (context // ratio) * cfg.head_dim * el
    return weights + routed * one_expert + batch * state


def check_layers(rec: Recorder, dev, sync, bandwidth: float, dry: bool) -> None:
    from gpu_verify_cost import captured_step, eagle_like

    from sglang_tree_v4.dsv4.tree_state import TreeVerifier
    from sglang_tree_v4.testing.runner import DSV4Runner

    dtype = torch.bfloat16
    contexts = (64, 160) if dry else (8192, 65536)
    batches = (1, 2) if dry else (1, 32)
    d = 8
    shapes = {"tree": eagle_like(d, 3), "chain": [-1] + list(range(d - 1)), "none": [-1]}
    reps = 1 if dry else 10
    capture = dev.type == "cuda"
    for ratio, op in ((4, "layer:csa"), (128, "layer:hca")):
        try:
            raw = layer_config(ratio, dry)
            eff_ratio = raw["compress_ratios"][0]
            model = quantized_layer_model(raw, dev, dtype)
        except Exception as e:  # noqa: BLE001
            rec.emit(op, error=f"build: {type(e).__name__}: {e}", trace=traceback.format_exc(limit=4))
            continue
        routed_ids: list[torch.Tensor] = []
        gate = model.layers[0].ffn.gate
        gate.register_forward_hook(lambda m, a, o, ids=routed_ids: ids.append(o[0]))
        for context in contexts:
            try:
                runner = DSV4Runner(model, num_slots=context + max(batches) * (d + 8) + 64,
                                    max_len=context + d + 8, max_reqs=max(batches))
                base = runner.add_request()
                g = torch.Generator().manual_seed(context)
                for start in range(0, context, 512):
                    runner.extend([base], [torch.randint(0, raw["vocab_size"], (min(512, context - start),),
                                                         generator=g)])
                rids = [base] + [runner.fork(base) for _ in range(max(batches) - 1)]
                tv = TreeVerifier(runner)
            except Exception as e:  # noqa: BLE001
                rec.emit(op, context=context, error=f"prefill: {type(e).__name__}: {e}")
                continue
            for shape, parents in shapes.items():
                n_nodes = len(parents)
                for b in batches:
                    sub = rids[:b]
                    toks = torch.randint(0, raw["vocab_size"], (b, n_nodes), device=dev)
                    par = torch.tensor([parents] * b, dtype=torch.long, device=dev)
                    nn_ = torch.full((b,), n_nodes, dtype=torch.long, device=dev)
                    common = dict(shape=shape, batch=b, draft_tokens=n_nodes, context=context)

                    def once(sub=sub, toks=toks, par=par, nn_=nn_, tv=tv):
                        tv.verify(sub, toks, par, nn_)
                        for r in sub:
                            tv.rollback(r)
                    try:
                        routed_ids.clear()
                        once()
                        routed = int(torch.unique(routed_ids[-1]).numel()) if routed_ids else 0
                        floor = layer_floor(model, eff_ratio, b, context, routed) / bandwidth * 1e3
                        rec.emit(op, **common, graph=False, median_ms=timed_ms(once, sync, reps), floor_ms=floor,
                                 routed_experts=routed)
                        ms = captured_step(model, runner, sub, toks, par, n_nodes, runner.req_table.shape[1], sync,
                                           reps, capture)
                        rec.emit(op, **common, graph=capture, median_ms=ms, floor_ms=floor, routed_experts=routed,
                                 note=None if capture else "capture replaced by an eager fixed-shape step")
                    except Exception as e:  # noqa: BLE001
                        rec.emit(op, **common, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc(limit=4))
            if ratio == 4:
                check_mtp(rec, model, runner, rids, sync, bandwidth, context, batches, reps)


def check_mtp(rec: Recorder, model, runner, rids, sync, bandwidth: float, context: int, batches, reps: int) -> None:
    """The MTP's step: one token per request at the end of the context (``none``, eager), and a tree's first draft
    step (``tree``: K = 3 nodes per request at depth 1, the server's ``MTPTreeDrafter``), eager and replayed from
    the server's graph of it (``step_graphs``, captured under ``set_sync_debug_mode("error")`` on CUDA)."""
    from sglang_tree_v4.dsv4.mtp import mtp_forward
    from sglang_tree_v4.dsv4.storage import ForwardBatch, SlotTable

    for b in batches:
        try:
            dev = runner.device
            sub = torch.tensor(rids[:b], device=dev)
            pos = torch.tensor([runner.lens[r] - 1 for r in rids[:b]], device=dev)
            fb = ForwardBatch(torch.randint(0, model.cfg.vocab_size, (b,), device=dev), pos,
                              runner.req_table[sub, pos], SlotTable.for_requests(runner.req_table, sub, pos))
            h = torch.randn(b, model.cfg.hc_mult, model.cfg.hidden_size, device=dev).to(torch.bfloat16)
            ms = timed_ms(lambda fb=fb, h=h: mtp_forward(model, fb, h, runner.mtp_store), sync, reps)
            rec.emit("mtp", shape="none", batch=b, draft_tokens=1, context=context, graph=False, median_ms=ms,
                     floor_ms=mtp_floor(model, b, context) / bandwidth * 1e3,
                     note="eager; the LM head of the small vocabulary included")
        except Exception as e:  # noqa: BLE001
            rec.emit("mtp", shape="none", batch=b, context=context, error=f"{type(e).__name__}: {e}",
                     trace=traceback.format_exc(limit=4))
        for graph in (False, True):
            try:
                ms = draft_step_ms(model, runner, rids[:b], sync, reps, graph)
                rec.emit("mtp", shape="tree", batch=b, draft_tokens=3, context=context, graph=graph and
                         dev.type == "cuda", median_ms=ms, floor_ms=mtp_floor(model, 3 * b, context) / bandwidth * 1e3,
                         note="first draft step, K=3" + ("" if not graph or dev.type == "cuda" else
                                                         "; capture replaced by an eager call"))
            except Exception as e:  # noqa: BLE001
                rec.emit("mtp", shape="tree", batch=b, context=context, graph=graph,
                         error=f"{type(e).__name__}: {e}", trace=traceback.format_exc(limit=4))


def mtp_floor(model, tokens: int, context: int) -> int:
    """Bytes an MTP forward over ``tokens`` queries must move: its weights (the experts ``tokens`` can route to)
    and each query's window keys."""
    blk = model.mtp[0]
    weights = sum(t.numel() * t.element_size() for t in list(blk.parameters()) + list(blk.buffers()))
    experts = blk.ffn.experts
    ex = sum(t.numel() * t.element_size() for t in list(experts.parameters()) + list(experts.buffers()))
    held = experts.w1.shape[0]
    needed = weights - ex + ex * min(held, tokens * model.cfg.num_experts_per_tok) // held
    return needed + tokens * min(context, model.cfg.window) * model.cfg.head_dim * 2


def draft_step_ms(model, runner, rids: list[int], sync, reps: int, graph: bool) -> float:
    """Median ms of a tree's first MTP draft step (K = 3, S = 4) for ``rids``, eager or through a graph."""
    from sglang_tree_v4.dsv4.mtp import draft_scratch_rows, new_mtp_store
    from sglang_tree_v4.serving import step_graphs
    from sglang_tree_v4.speculative.mtp_drafter import MTPGraphs, MTPTreeDrafter
    from sglang_tree_v4.tree import DraftStep

    K, S = 3, 4
    dev, cfg, b = runner.device, model.cfg, len(rids)
    stride = draft_scratch_rows(K, S)
    store = new_mtp_store(cfg, runner.store.num_slots, torch.bfloat16, dev, step_graphs.batch_bucket(b) * stride)
    graphs = None
    if graph:
        capture = step_graphs.capture_for(dev)
        graphs = MTPGraphs(model, store, None, step_graphs.StepGraphs({}, capture))
    rid_t = torch.tensor(rids, device=dev)
    lens = torch.tensor([runner.lens[r] for r in rids], device=dev)
    drafter = MTPTreeDrafter(model, store, runner.req_table[rid_t], lens, K, S, graphs)
    slots = torch.arange(1, K + 1, device=dev).expand(b, K)
    step = DraftStep(step=1, tokens=torch.randint(0, cfg.vocab_size, (b, K), device=dev),
                     positions=(lens + 1)[:, None].expand(b, K), slots=slots,
                     parent_slots=torch.zeros(b, K, dtype=torch.long, device=dev),
                     ancestors=torch.cat([torch.ones(b, K, 1, dtype=torch.bool, device=dev),
                                          torch.eye(K, dtype=torch.bool, device=dev).expand(b, K, K)], -1),
                     parent_hidden=torch.randn(b, K, cfg.hc_mult, cfg.hidden_size, device=dev).to(torch.bfloat16))
    if graph and dev.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")  # a host sync inside the captured step raises
        try:
            drafter(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return timed_ms(lambda: drafter(step), sync, reps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, kernels under the interpreter")
    ap.add_argument("--break", dest="broken", choices=KERNELS, help="make this kernel raise (negative control)")
    ap.add_argument("--skip-layers", action="store_true")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        dev = torch.device("cpu")
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run with --dry-run on a CPU", file=sys.stderr)
        return 2
    else:
        dev = torch.device("cuda")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rec = Recorder(torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (dry run)", git_commit())
    start = time.perf_counter()
    bandwidth = environment(rec, dev, sync, args.dry_run)
    check_kernels(rec, dev, sync, bandwidth, args.dry_run, args.broken)
    if not args.skip_layers:
        if args.dry_run:  # the layers through the kernels, as on the GPU (the CPU default is the references)
            os.environ["SGL_KERNEL_EXT_BACKEND"] = "triton"
        check_layers(rec, dev, sync, bandwidth, args.dry_run)
    rec.emit("done", records=rec.count, seconds=round(time.perf_counter() - start, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
