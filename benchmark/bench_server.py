"""One SGLang server per speculative configuration, and one measured grid point against it.

Why a real server: users meet TREE_V4 through ``python -m sglang.launch_server``; measuring through it includes the
scheduler, batching and HTTP path they get. Batch size is emulated as SGLang's benchmarks do, as the number of
requests in flight (``--max-concurrency``). Each request streams so that its first-token time is known; its final
``meta_info`` gives completion tokens and target verify passes, so no server counter (cumulative) is needed.
"""
from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from sglang_tree_v4.testing import launcher
from sglang_tree_v4.testing.launcher import Server, wait_healthy  # noqa: F401  (the sweep uses both through this module)


def spec_args(topk: int, num_steps: int, budget: int) -> list[str]:
    """launch_server flags for a shape; topk 0 means no speculation."""
    if topk == 0:
        return []
    return ["--speculative-algorithm", "TREE_V4", "--speculative-num-draft-tokens", str(budget),
            "--speculative-eagle-topk", str(topk), "--speculative-num-steps", str(num_steps)]


def launch(model: str, device: str, extra: list[str], log: Path, env: dict[str, str] | None = None) -> Server:
    """Start a server in its own process group; returns at once (see ``wait_healthy``)."""
    return launcher.launch(model, ["--device", device, *extra], log, env=env)


def _one_request(url: str, text: str, sampling: dict) -> dict:
    """Stream one /generate request; -> {completion_tokens, verify_ct, ttft_s, e2e_s}."""
    t0 = time.perf_counter()
    ttft, meta = None, None
    with requests.post(url + "/generate", json={"text": text, "sampling_params": sampling, "stream": True},
                       stream=True, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line or not line.startswith(b"data:"):
                continue
            body = line[5:].strip()
            if body == b"[DONE]":
                break
            chunk = json.loads(body)
            if ttft is None:
                ttft = time.perf_counter() - t0
            meta = chunk["meta_info"]
    e2e = time.perf_counter() - t0
    if meta is None:
        raise RuntimeError("empty stream")
    return {"completion_tokens": int(meta["completion_tokens"]), "verify_ct": int(meta.get("spec_verify_ct") or 0),
            "ttft_s": ttft if ttft is not None else e2e, "e2e_s": e2e}


def flush_cache(server: Server) -> None:
    """Drop the radix cache so a point's prefill cost does not depend on which points ran before it."""
    try:
        requests.post(server.url + "/flush_cache", timeout=60)
    except requests.RequestException:
        pass


def shape_steps(server: Server) -> dict[str, int]:
    """TREE_V4's cumulative steps per tree shape (``/get_server_info``; empty for other servers)."""
    info = requests.get(server.url + "/get_server_info", timeout=60).json()
    return dict(info["internal_states"][0].get("tree_v4_shape_steps") or {})


def measure(server: Server, texts: list[str], batch_size: int, sampling: dict) -> dict:
    """Run ``texts`` with ``batch_size`` requests in flight; -> the point's metrics.

    accept_length: mean over requests of completion_tokens / target verify passes (accepted drafts + the bonus
    token per pass; 1.0 without speculation). mean_step_ms: mean over requests of the decode time after the first
    token divided by the decode passes the request needed (verify passes, or completion_tokens - 1 without
    speculation), i.e. the wall time of one batched target step as one request saw it.
    """
    flush_cache(server)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=batch_size) as pool:
        results = list(pool.map(lambda t: _one_request(server.url, t, sampling), texts))
    wall = time.perf_counter() - t0
    accept, steps_ms, tpot_ms = [], [], []
    for r in results:
        passes = r["verify_ct"] if r["verify_ct"] > 0 else max(r["completion_tokens"] - 1, 1)
        accept.append(r["completion_tokens"] / r["verify_ct"] if r["verify_ct"] > 0 else 1.0)
        decode_s = max(r["e2e_s"] - r["ttft_s"], 0.0)
        steps_ms.append(1e3 * decode_s / passes)
        tpot_ms.append(1e3 * decode_s / max(r["completion_tokens"] - 1, 1))
    out_tokens = sum(r["completion_tokens"] for r in results)
    return {
        "accept_length": statistics.fmean(accept),
        "output_throughput": out_tokens / wall,
        "mean_step_ms": statistics.fmean(steps_ms),
        "num_requests": len(results),
        "output_tokens": out_tokens,
        "wall_s": wall,
        "median_ttft_ms": 1e3 * statistics.median(r["ttft_s"] for r in results),
        "mean_tpot_ms": statistics.fmean(tpot_ms),
        "verify_passes": sum(r["verify_ct"] for r in results),
    }
