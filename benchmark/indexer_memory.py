"""Peak temporary bytes of the lightning indexer's top-k selection at a long context, one pass vs in chunks.

    python benchmark/indexer_memory.py [--context 131072] [--queries 8] \
        [--out benchmark/results/indexer_memory_cpu.jsonl]

Runs ``dsv4.compressor.Indexer.select`` on the CPU at V4-Flash indexer shapes (64 heads, head dim 128, top-k 512,
hidden 4096, q rank 1024) for ``--queries`` queries at the end of a ``--context``-token sequence (one index key per
4 tokens), once with the whole context in one chunk (the algorithm before chunking) and once with the default
chunk, then in chunks with fixed shapes (every query scores ``--capacity / 4`` entries, the ones past its context
masked, as a captured step does), and records the peak of the bytes held by tensors created inside the call (a
``TorchDispatchMode`` that
follows every op's outputs until they are freed). The temporaries grow with queries x entries x (heads + head dim)
in one pass and stay at the chunk's size in chunks, padded or not; the selected entries are checked to be the same.
"""

from __future__ import annotations

import argparse
import json
import weakref

import torch
from bench_common import git_commit, write_records
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakBytes(TorchDispatchMode):
    """Bytes of live tensors produced inside the mode (their storages counted once), and their peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.live and storage.nbytes() > 0:
                    self.live[key] = storage.nbytes()
                    weakref.finalize(storage, self.live.pop, key, None)
        self.peak = max(self.peak, sum(self.live.values()))
        return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=262144,
                    help="context capacity of the fixed-shape run (entries padded up to capacity / 4)")
    ap.add_argument("--out", default="benchmark/results/indexer_memory_cpu.jsonl")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from sglang_tree_v4.dsv4 import compressor
    from sglang_tree_v4.dsv4.rope import Rope
    from sglang_tree_v4.dsv4.storage import (
        ForwardBatch,
        LayerLayout,
        SlotStore,
        SlotTable,
        StepCaps,
    )

    heads, ihd, topk, dim, q_rank = 64, 128, 512, 4096, 1024
    g = torch.Generator().manual_seed(0)
    indexer = compressor.Indexer(dim, q_rank, heads, ihd, topk, 1e-6)
    with torch.no_grad():
        for p in indexer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    n, L = args.queries, args.context
    store = SlotStore([LayerLayout.of([("ientry", ihd)])], L + n)
    store.write(0, "ientry", torch.arange(L + n), torch.randn(L + n, ihd, generator=g))
    positions = torch.arange(L, L + n)
    table = SlotTable.for_requests(torch.arange(L + n)[None], torch.zeros(n, dtype=torch.long), positions)
    rope = Rope(64, 160000.0)
    cos, sin = rope.cos_sin(positions)
    x, q_res = torch.randn(n, dim, generator=g), torch.randn(n, q_rank, generator=g)
    records, chosen = [], {}
    chunk = compressor.INDEXER_CHUNK_ELEMENTS
    fixed = StepCaps(max(args.capacity, L + n))
    for mode, elements, caps in (("one pass", 1 << 62, None), ("chunks", chunk, None),
                                 ("chunks, fixed shapes", chunk, fixed)):
        compressor.INDEXER_CHUNK_ELEMENTS = elements
        fb = ForwardBatch(torch.zeros(n, dtype=torch.long), positions, positions, table, caps)
        tracker = PeakBytes()
        with torch.no_grad(), tracker:
            idx, score = indexer.select(indexer.weights_proj(x), q_res, fb, store, 0, rope, cos, sin)
        chosen[mode] = torch.where(score > float("-inf"), idx, -1).sort(-1).values
        entries = L // 4 if caps is None else caps.entries(4)
        records.append({"bench": "indexer_memory", "mode": mode, "context": L, "entries": entries, "queries": n,
                        "capacity": None if caps is None else caps.max_context,
                        "chunk_entries": min(indexer.chunk_entries(n), entries), "peak_temp_bytes": tracker.peak,
                        "peak_temp_bytes_per_query": tracker.peak // n, "commit": git_commit()})
        print(json.dumps(records[-1]), flush=True)
    for mode in ("chunks", "chunks, fixed shapes"):
        assert torch.equal(chosen["one pass"], chosen[mode]), f"{mode}: selection differs"
    write_records(args.out, records)


if __name__ == "__main__":
    main()
