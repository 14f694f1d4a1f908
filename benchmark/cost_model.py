"""Predicted GPU throughput of tree vs matched chain vs no speculation from measured accept lengths.

Why: the CPU sweep measures accept lengths faithfully (they depend on model and data, not on hardware) but its
timings are CPU timings, where a pass costs roughly in proportion to the tokens it carries. On a GPU a pass costs
about the same for 1 or 100 tokens until weight reads stop dominating, so the throughput trade-off differs. This
model turns accept lengths into predicted throughput with a stated cost of one pass as a function of its tokens.

    python benchmark/cost_model.py benchmark/results/tree_vs_chain_cpu.jsonl [--verify-curve gpu_verify_cost.jsonl]
        [--png benchmark/results/cost_model_gpu.png] [--json benchmark/results/cost_model_gpu.jsonl]
        [--accept tree=3.41,chain=2.84]

Step time of one decode step for a batch of b requests at budget D:

    step = verify(b*D tokens, b requests) + drafting + draft catch-up
    tree:  drafting = draft(b) + (S-1) * draft(b*K)        (EAGLE-2: the root, then K expanded nodes per level)
    chain: drafting = (D-1) * draft(b)
    both:  draft catch-up = draft(b*A)                     (the MTP layer consumes the accepted tokens)
    no speculation: step = verify(b, b), A = 1;  throughput = b * A / step

A pass over N tokens costs ``overhead + max(bytes(N) / bandwidth, flops(N) / compute)`` (a roofline). The stated
curve (``GpuAssumptions``) is DeepSeek-V4-Flash on 4 x H200 with tensor parallelism 4 (the public Hopper
recipe): 284B parameters, 13B active, 43 layers of 256 routed experts (top-6, hidden 4096, expert width 2048, FP4
weights run as W4A16 at the BF16 rate, since Hopper has no FP4 math) plus one shared expert and attention in FP8.
Routed-expert bytes grow with the distinct experts N tokens touch, E * (1 - (1 - k/E)^N) per layer under uniform
routing: this is why even at batch 1 a D=8 pass reads several
times the expert weights of a 1-token pass. These are public architecture numbers and datasheet peaks with an
assumed efficiency, not measurements; ``--verify-curve`` replaces the verify cost by the per-layer curve that
``benchmark/gpu_verify_cost.py`` measures (scaled to 43 layers).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402


@dataclass
class GpuAssumptions:
    gpus: int = 4                      # TP4
    hbm_tb_s: float = 4.8              # per H200 (datasheet)
    tflops: float = 989.0              # per H200, dense BF16 (datasheet): Hopper has no FP4 math, so FP4 experts
                                       # run as W4A16 (Marlin, as in the public recipe) at the BF16 rate
    efficiency: float = 0.3            # fraction of peak compute reached by the MoE/attention kernels (assumed)
    bw_efficiency: float = 0.75        # fraction of peak bandwidth reached (assumed)
    layers: int = 43
    experts: int = 256
    experts_per_token: int = 6
    expert_params: float = 3 * 4096 * 2048
    expert_bytes_per_param: float = 0.5  # FP4 experts
    active_params: float = 13e9
    head_params: float = 129280 * 4096
    attn_flops_per_token_layer: float = 2 * 2 * 64 * 640 * 512  # QK and PV over 64 heads x (window + top-k)
    kv_bytes_per_request_layer: float = (128 + 512) * 512  # window + CSA top-k entries of 512 FP8 values
    pass_overhead_ms: float = 1.0      # launches + 2 all-reduces per layer under CUDA graphs (assumed)
    draft_overhead_ms: float = 0.15

    @property
    def dense_params(self) -> float:
        """Parameters every token reads: attention, shared experts, embeddings/head (active minus routed)."""
        return self.active_params - self.layers * self.experts_per_token * self.expert_params

    def distinct_experts(self, tokens: float) -> float:
        return self.experts * (1.0 - (1.0 - self.experts_per_token / self.experts) ** tokens)

    def _pass_ms(self, layers: float, dense_bytes: float, tokens: float, requests: float, flops: float) -> float:
        bytes_ = (dense_bytes + layers * self.distinct_experts(tokens) * self.expert_params
                  * self.expert_bytes_per_param + requests * layers * self.kv_bytes_per_request_layer)
        mem_ms = bytes_ / (self.gpus * self.hbm_tb_s * 1e12 * self.bw_efficiency) * 1e3
        cmp_ms = flops / (self.gpus * self.tflops * 1e12 * self.efficiency) * 1e3
        return max(mem_ms, cmp_ms)

    def verify_ms(self, tokens: float, requests: float) -> float:
        """One target pass over ``tokens`` query tokens from ``requests`` requests."""
        flops = (2 * self.active_params + self.layers * self.attn_flops_per_token_layer) * tokens
        return self.pass_overhead_ms + self._pass_ms(self.layers, self.dense_params, tokens, requests, flops)

    def draft_ms(self, tokens: float, requests: float) -> float:
        """One MTP pass: one layer's share of the dense weights and its experts, plus the LM head."""
        dense = self.dense_params / self.layers + self.head_params
        flops = (2 * (self.active_params / self.layers + self.head_params) + self.attn_flops_per_token_layer) * tokens
        return self.draft_overhead_ms + self._pass_ms(1, dense, tokens, requests, flops)


class MeasuredVerify:
    """Verify cost from ``gpu_verify_cost.py`` records: per-layer ms vs tokens per pass, linearly interpolated and
    scaled to the full layer count; the draft keeps the stated model."""

    def __init__(self, path: Path, base: GpuAssumptions):
        rows = [r for r in bc.load_records(path) if r.get("median_ms") is not None]
        by_tokens: dict[int, list[float]] = {}
        for r in rows:  # tree, chain and no-spec passes of the same size are averaged
            by_tokens.setdefault(r["tokens"], []).append(r["median_ms"] / r["layers"])
        self.points = sorted((n, sum(v) / len(v)) for n, v in by_tokens.items())
        self.base = base

    def verify_ms(self, tokens: float, requests: float) -> float:
        pts = self.points
        if tokens <= pts[0][0]:
            per_layer = pts[0][1]
        elif tokens >= pts[-1][0]:
            (x0, y0), (x1, y1) = pts[-2], pts[-1]
            per_layer = y1 + (tokens - x1) * (y1 - y0) / max(x1 - x0, 1)
        else:
            for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
                if x0 <= tokens <= x1:
                    per_layer = y0 + (tokens - x0) * (y1 - y0) / max(x1 - x0, 1)
                    break
        return self.base.pass_overhead_ms + self.base.layers * per_layer

    def draft_ms(self, tokens: float, requests: float) -> float:
        return self.base.draft_ms(tokens, requests)


def step_ms(cost, shape: str, budget: int, topk: int, steps: int, batch: int, accept: float) -> float:
    if shape == "none":
        return cost.verify_ms(batch, batch)
    if shape == "chain":
        drafting = (budget - 1) * cost.draft_ms(batch, batch)
    else:
        drafting = cost.draft_ms(batch, batch) + (steps - 1) * cost.draft_ms(batch * topk, batch)
    return cost.verify_ms(batch * budget, batch) + drafting + cost.draft_ms(batch * accept, batch)


def predict(cost, accepts: dict[tuple[str, int, str], float], batch_sizes: list[int]) -> list[dict]:
    """One row per (dataset, budget, shape, batch size) with predicted step ms and tokens/s."""
    rows = []
    for (ds, d, shape), a in sorted(accepts.items()):
        k, s = bc.tree_shape(d) if shape == "tree" else bc.chain_shape(d)
        for b in batch_sizes:
            ms = step_ms(cost, shape, d, k, s, b, a)
            rows.append({"dataset": ds, "budget": d, "shape": shape, "batch_size": b, "accept_length": a,
                         "step_ms": ms, "throughput": b * a / ms * 1e3})
    for ds in sorted({k[0] for k in accepts}):
        for b in batch_sizes:
            ms = step_ms(cost, "none", 1, 0, 0, b, 1.0)
            rows.append({"dataset": ds, "budget": 1, "shape": "none", "batch_size": b, "accept_length": 1.0,
                         "step_ms": ms, "throughput": b / ms * 1e3})
    return rows


def markdown(rows: list[dict], budget: int) -> str:
    sizes = sorted({r["batch_size"] for r in rows})
    val = {(r["dataset"], r["budget"], r["shape"], r["batch_size"]): r["throughput"] for r in rows}
    lines = [f"| dataset | shape (D={budget}) | " + " | ".join(f"bs {b}" for b in sizes) + " |",
             "|---|---|" + "---|" * len(sizes)]
    for ds in sorted({r["dataset"] for r in rows}):
        for shape, d in (("none", 1), ("chain", budget), ("tree", budget)):
            cells = [val.get((ds, d, shape, b)) for b in sizes]
            if any(c is None for c in cells):
                continue
            lines.append(f"| {ds} | {shape} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
        t = [val.get((ds, budget, "tree", b)) for b in sizes]
        c = [val.get((ds, budget, "chain", b)) for b in sizes]
        if all(t) and all(c):
            ratios = " | ".join(f"**{x / y:.2f}**" for x, y in zip(t, c, strict=True))
            lines.append(f"| {ds} | tree/chain | {ratios} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, budget: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plot import save_batch_panels
    datasets = sorted({r["dataset"] for r in rows})
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 3.6), squeeze=False)
    for ax, ds in zip(axes[0], datasets, strict=False):
        for shape, d, color in (("tree", budget, "tab:green"), ("chain", budget, "tab:blue"), ("none", 1, "gray")):
            pts = sorted((r["batch_size"], r["throughput"]) for r in rows
                         if r["dataset"] == ds and r["shape"] == shape and r["budget"] == d)
            if pts:
                ax.plot(*zip(*pts, strict=False), "o-", color=color, label=f"{shape}" + (f" D={d}" if d > 1 else ""))
        ax.set_title(f"{ds} (predicted, 4xH200)")
    save_batch_panels(fig, axes, path, "output tokens/s", "batch size")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl", nargs="?", help="sweep JSONL (accept lengths)")
    ap.add_argument("--accept", default=None, help="manual accept lengths instead: tree=3.41,chain=2.84 (D=8)")
    ap.add_argument("--budget", type=int, default=8, help="budget shown in the table and plot")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=list(bc.BATCH_SIZES))
    ap.add_argument("--verify-curve", default=None, help="gpu_verify_cost.py JSONL")
    ap.add_argument("--png", default=None)
    ap.add_argument("--json", default=None, help="write the predicted rows as JSONL")
    a = ap.parse_args()
    base = GpuAssumptions()
    cost = MeasuredVerify(Path(a.verify_curve), base) if a.verify_curve else base
    if a.accept:
        accepts = {("manual", a.budget, k): float(v) for k, v in (p.split("=") for p in a.accept.split(","))}
    else:
        from plot import grid_records, pooled_accept
        accepts = pooled_accept(grid_records(bc.load_records(a.jsonl)))
    rows = predict(cost, accepts, a.batch_sizes)
    print(markdown(rows, a.budget))
    if a.png:
        plot(rows, Path(a.png), a.budget)
    if a.json:
        with open(a.json, "w") as f:
            f.writelines(json.dumps({**r, "commit": bc.git_commit()}) + "\n" for r in rows)


if __name__ == "__main__":
    main()
