"""CUDA graphs of a round's fixed-shape forwards, captured on first use per key, under a count and a memory cap.

What is captured, and its key:

* the target's **verify** forward: (batch bucket, D, context bucket);
* the MTP's **catch-up** (the committed rows and the root's draft, ``mtp_drafter.catch_up_fixed``): (batch bucket,
  C);
* each MTP **draft** step of the tree (``MTPTreeDrafter``): (batch bucket, K, depth).

Why our own: SGLang's decode graph runner keys its graphs by batch size only, so a graph it captures must serve
every later context, and under its capture our per-query capacities are the model's whole context (at V4-Flash
1,048,576 tokens: 8,192 HCA entries and 262,144 index candidates per query in every replay). Here the live
context's power-of-two bucket (``StepCaps.bucket``) is part of the verify key, so a replay at an 8K context pads to
8K. The MTP is a sliding-window layer: its forwards read a window-wide slice of the request table
(``mtp_drafter.window_table``), so their keys need no context.

* **Batch buckets**: a batch is padded to its bucket by repeating its last request. A repeated request computes the
  same values and writes them to the same slots as the one it repeats (or, drafting, to scratch rows of its own),
  so padding changes nothing stored or read; its outputs are dropped.
* **Bounded**: at most ``max_graphs`` graphs (the least recently used is dropped first), sharing one memory pool
  and replayed one at a time. Each capture adds what the pool grew by to ``pool_bytes``; once that reaches
  ``max_bytes`` (``GRAPH_MEMORY_ENV``, MiB) shapes not yet captured run eagerly, with the same fixed shapes.
  Captures, drops and the cap are logged with the count and the bytes.
* A captured function reads only its static inputs, the pools (fixed addresses) and the weights.

``capture`` is injectable: ``cuda_capture`` on a GPU; tests use an eager stand-in to check keys, padding, eviction
and the cap on the CPU.
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
GRAPHS_ENV = "SGLANG_TREE_V4_CUDA_GRAPHS"
GRAPH_MEMORY_ENV = "SGLANG_TREE_V4_GRAPH_MEMORY_MB"  # the cap on the graphs' memory pool
DEFAULT_GRAPH_MEMORY_MB = 4096
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
MAX_GRAPHS = 64

Key = tuple  # (kind, (name, value), ...), e.g. ("verify", ("batch", 4), ("D", 8), ("context", 8192))
Outputs = torch.Tensor | tuple[torch.Tensor, ...]


def enabled(device: torch.device | str) -> bool:
    """Whether fixed-shape forwards on ``device`` replay captured graphs (CUDA, and not ``--disable-cuda-graph``)."""
    choice = os.environ.get(GRAPHS_ENV, "1")
    return choice == "force" or (torch.device(device).type == "cuda" and choice == "1")


def capture_for(device: torch.device | str):
    return cuda_capture if torch.device(device).type == "cuda" else eager_capture


def memory_cap_bytes() -> int:
    return int(float(os.environ.get(GRAPH_MEMORY_ENV, DEFAULT_GRAPH_MEMORY_MB)) * 2**20)


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


def describe(key: Key) -> str:
    return f"{key[0]} ({', '.join(f'{name} {value}' for name, value in key[1:])})"


@dataclass
class Captured:
    graph: object
    inputs: dict[str, torch.Tensor]
    outputs: tuple[torch.Tensor, ...]
    bytes: int = 0


def _as_tuple(out: Outputs) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def cuda_capture(fn: Callable[[dict[str, torch.Tensor]], Outputs], inputs: dict[str, torch.Tensor],
                 pool) -> Captured:
    """Warm up on a side stream (lazy initialisation must not be captured), then capture ``fn`` on static copies of
    ``inputs`` into the shared ``pool``; ``bytes``: what the process's reserved memory grew by."""
    static = {k: v.clone() for k, v in inputs.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(static)
    torch.cuda.current_stream().wait_stream(side)
    before = torch.cuda.memory_reserved()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = _as_tuple(fn(static))
    return Captured(graph, static, outputs, max(torch.cuda.memory_reserved() - before, 0))


def eager_capture(fn, inputs, pool) -> Captured:
    """The CPU stand-in: a "graph" whose replay calls ``fn`` on the static inputs; its bytes are its outputs'."""
    static = {k: v.clone() for k, v in inputs.items()}
    outputs = _as_tuple(fn(static))

    class Replay:
        def replay(self):
            for held, new in zip(outputs, _as_tuple(fn(static)), strict=True):
                held.copy_(new)

    return Captured(Replay(), static, outputs, sum(t.numel() * t.element_size() for t in outputs))


class StepGraphs:
    """Graphs by key; ``run(key, inputs)`` replays (capturing first) the function ``fns[key[0]](inputs, key)`` and
    returns its outputs, which the next replay of the same graph overwrites (callers copy what they keep). One
    instance per server, so every kind of graph shares the pool and the caps."""

    def __init__(self, fns: dict[str, Callable[[dict[str, torch.Tensor], Key], Outputs]], capture=cuda_capture,
                 max_graphs: int = MAX_GRAPHS, max_bytes: int | None = None, pool=None):
        self.fns, self.capture, self.max_graphs = fns, capture, max_graphs
        self.max_bytes = memory_cap_bytes() if max_bytes is None else max_bytes
        self.graphs: OrderedDict[Key, Captured] = OrderedDict()
        self.pool = pool
        self.captures = 0
        self.pool_bytes = 0  # what captures grew the shared pool by (dropping a graph returns blocks to the pool)
        self.eager: set[Key] = set()  # keys run eagerly because the memory cap was reached

    def run(self, key: Key, inputs: dict[str, torch.Tensor]) -> Outputs:
        got = self.graphs.get(key)
        if got is None:
            if self.pool_bytes >= self.max_bytes:
                if key not in self.eager:
                    self.eager.add(key)
                    logger.info("TREE_V4 graphs: %s runs eagerly: the graphs' memory, %.1f MiB, is at its cap of "
                                "%.0f MiB (%s)", describe(key), self.pool_bytes / 2**20, self.max_bytes / 2**20,
                                GRAPH_MEMORY_ENV)
                return self.fns[key[0]](inputs, key)
            got = self._capture(key, inputs)
        self.graphs.move_to_end(key)
        for name, value in inputs.items():
            got.inputs[name].copy_(value)
        got.graph.replay()  # a fresh capture has not run yet either
        return got.outputs if len(got.outputs) > 1 else got.outputs[0]

    def run_padded(self, key: Key, inputs: dict[str, torch.Tensor], bs: int, padded: int) -> Outputs:
        """``run`` with ``key``'s batch bucket ``padded`` added: every input has ``bs`` leading rows (one per
        request), padded by repeating the last; the outputs' first ``bs`` rows, copied."""
        out = self.run(key[:1] + (("batch", padded),) + key[1:],
                       {k: pad_rows(v, bs, padded) for k, v in inputs.items()})
        return tuple(t[:bs].clone() for t in out) if isinstance(out, tuple) else out[:bs].clone()

    def _capture(self, key: Key, inputs: dict[str, torch.Tensor]) -> Captured:
        if self.pool is None and self.capture is cuda_capture:
            self.pool = torch.cuda.graph_pool_handle()
        while len(self.graphs) >= self.max_graphs:
            old, _ = self.graphs.popitem(last=False)
            logger.info("TREE_V4 graphs: dropped %s (least recently used)", describe(old))
        got = self.capture(lambda static: self.fns[key[0]](static, key), inputs, self.pool)
        self.graphs[key] = got
        self.captures += 1
        self.pool_bytes += got.bytes
        logger.info("TREE_V4 graphs: captured %s; %d held, %.1f MiB in the pool (cap %.0f MiB)", describe(key),
                    len(self.graphs), self.pool_bytes / 2**20, self.max_bytes / 2**20)
        return got
