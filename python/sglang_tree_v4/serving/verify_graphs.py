"""CUDA graphs of the target's verify forward, one per (batch bucket, D, context bucket), captured on first use.

Why our own: SGLang's decode graph runner keys its graphs by batch size only, so a graph it captures must serve
every later context, and under its capture our per-query capacities are the model's whole context (at V4-Flash
1,048,576 tokens: 8,192 HCA entries and 262,144 index candidates per query in every replay). Here the live
context's power-of-two bucket (``StepCaps.bucket``) is part of the key, so a replay at an 8K context pads to 8K.

* **Batch buckets**: a batch is padded to its bucket by repeating its last request. A repeated request computes the
  same values and writes them to the same slots as the one it repeats, so padding changes nothing stored or read;
  its outputs are dropped.
* **Bounded**: at most ``max_graphs`` graphs (the least recently used is dropped first); all share one memory pool,
  replayed one at a time, so their memory is about the largest one's. Each capture is logged with the count and
  the pool's bytes.
* The captured function reads only its static inputs, the pools (fixed addresses) and the weights: the request
  table is gathered inside it, cut to the bucket's columns.

``capture`` is injectable: ``cuda_capture`` on a GPU; tests use an eager stand-in to check keys, padding and
eviction on the CPU.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

logger = logging.getLogger(__name__)

# "1" (the default) captures on CUDA, "0" never (--disable-cuda-graph sets it); "force" runs the graph path on any
# device, with ``eager_capture`` off CUDA: how the CPU tests serve through it (keys, padding, static inputs).
GRAPHS_ENV = "SGLANG_TREE_V4_VERIFY_GRAPHS"
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
MAX_GRAPHS = 48


def enabled(device: torch.device | str) -> bool:
    """Whether verify forwards on ``device`` replay captured graphs (CUDA, and not ``--disable-cuda-graph``)."""
    choice = os.environ.get(GRAPHS_ENV, "1")
    return choice == "force" or (torch.device(device).type == "cuda" and choice == "1")


def capture_for(device: torch.device | str):
    return cuda_capture if torch.device(device).type == "cuda" else eager_capture


def batch_bucket(bs: int) -> int:
    """The smallest bucket holding ``bs`` requests (``bs`` itself beyond the largest)."""
    for b in BATCH_BUCKETS:
        if b >= bs:
            return b
    return bs


def pad_rows(t: torch.Tensor, bs: int, padded: int, per_request: int = 1) -> torch.Tensor:
    """``t``'s ``bs`` requests (``per_request`` leading rows each) then its last request repeated up to ``padded``."""
    if padded == bs:
        return t
    last = t[(bs - 1) * per_request:bs * per_request]
    return torch.cat([t, last.repeat((padded - bs,) + (1,) * (t.dim() - 1))])


@dataclass
class Captured:
    graph: object
    inputs: dict[str, torch.Tensor]
    output: torch.Tensor


def cuda_capture(fn: Callable[[dict[str, torch.Tensor]], torch.Tensor], inputs: dict[str, torch.Tensor],
                 pool) -> Captured:
    """Warm up on a side stream (lazy initialisation must not be captured), then capture ``fn`` on static copies of
    ``inputs`` into the shared ``pool``."""
    static = {k: v.clone() for k, v in inputs.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn(static)
    return Captured(graph, static, output)


def eager_capture(fn, inputs, pool) -> Captured:
    """The CPU stand-in: a "graph" whose replay calls ``fn`` on the static inputs."""
    static = {k: v.clone() for k, v in inputs.items()}
    holder: dict[str, torch.Tensor] = {"out": fn(static)}

    class Replay:
        def replay(self):
            holder["out"].copy_(fn(static))

    return Captured(Replay(), static, holder["out"])


class VerifyGraphs:
    """Graphs keyed by ``(batch bucket, D, context bucket)``; ``run(key, inputs)`` replays (capturing first)."""

    def __init__(self, fn: Callable[[dict[str, torch.Tensor], tuple], torch.Tensor], capture=cuda_capture,
                 max_graphs: int = MAX_GRAPHS, pool=None):
        self.fn, self.capture, self.max_graphs = fn, capture, max_graphs
        self.graphs: OrderedDict[tuple, Captured] = OrderedDict()
        self.pool = pool
        self.captures = 0

    def run(self, key: tuple, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        got = self.graphs.get(key)
        if got is None:
            if self.pool is None and self.capture is cuda_capture:
                self.pool = torch.cuda.graph_pool_handle()
            while len(self.graphs) >= self.max_graphs:
                old, _ = self.graphs.popitem(last=False)
                logger.info("TREE_V4 verify graphs: dropped %s (least recently used)", old)
            got = self.capture(lambda static: self.fn(static, key), inputs, self.pool)
            self.graphs[key] = got
            self.captures += 1
            logger.info("TREE_V4 verify graphs: captured (batch %d, D %d, context %d); %d held, %.1f MiB in the pool",
                        *key, len(self.graphs), self.pool_bytes() / 2**20)
        self.graphs.move_to_end(key)
        for name, value in inputs.items():
            got.inputs[name].copy_(value)
        got.graph.replay()  # a fresh capture has not run yet either
        return got.output

    def pool_bytes(self) -> int:
        if self.capture is cuda_capture and torch.cuda.is_available():
            return torch.cuda.memory_reserved()
        return sum(c.output.numel() * c.output.element_size() for c in self.graphs.values())
