"""The adaptive budget's startup step-time measurement, and its cache file.

At startup the worker times the real pieces of a decode round on private scratch state (its own small slot
stores, never SGLang's pool): the MTP draft (catch-up + ``build_draft_tree`` over S steps, for each S) and the
target's tree-verify forward (for each number of verified tokens per request in ``verify_widths``), at batch sizes
1 .. max running requests.
The state is zeros, which costs the same as real state. Every point is timed once per pass, in ``PASSES``
passes over the whole grid, and keeps its fastest: a stretch of contention (on the CPU, other servers starting
next to this one) lasts seconds, so repeats taken back to back share it, while passes seconds apart mostly do
not. (Measured: a startup next to four other starting servers, two back-to-back repeats, timed one draft depth
at 5x its neighbours.) At each batch size the times are then made non-decreasing in D and in S (``monotone``):
more verified tokens or more draft steps never cost less, so a point above a larger one is noise. Both steps
matter for the choice among trees, which turns on a few percent: with 3 passes and no such fit, three
measurements in one CPU process put D=4 at batch 1 at 14.2, 11.0 and 11.3 ms and D=8 at 15.7, 11.9 and 11.3 ms,
and a server's startup timed D=4 at 15.8 ms against 12.6 for D=8 -- that server then ran D=7-8 trees, whose
verification it took for the cheaper; with 10 passes the three measurements agreed within 3 % (D=4 9.8-10.1, D=8
10.2-10.6 ms). The result is the model that ``adaptive_budget.StepTimes`` corrects with served steps.
It is written to ``~/.cache/sglang-tree-v4/step_times/<key>.json`` (``$XDG_CACHE_HOME`` honoured), keyed by the
checkpoint (path and config), the device, the TP size, the dtype, the shape limits and the kind of verify step
(eager or fixed-shape, which cost differently), and read back on the next start instead of measuring again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import torch

from ..dsv4.mtp import draft_scratch_rows, new_mtp_store, new_streams_store
from ..serving.sglang_model import fixed_shapes, verify_caps, verify_table
from ..dsv4.storage import ForwardBatch
from ..tree import build_draft_tree
from .adaptive_budget import Curve, StepTimes
from .mtp_drafter import MTPTreeDrafter, catch_up

BATCHES = (1, 4, 16, 64)
CONTEXT = 96  # committed tokens per synthetic request (crosses CSA and HCA blocks of the embedded model)
PASSES = 10
# Part of the cache key: 2 = verification per verified tokens per request, over the batch size; 3 = 10 passes and
# times non-decreasing in D and S (a cache of an earlier layout is measured again).
CACHE_LAYOUT = 3


def cache_path(model_path: str, device: torch.device, tp: int, dtype: torch.dtype, limits: tuple) -> str:
    try:
        with open(os.path.join(model_path, "config.json"), "rb") as f:
            config = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        config = ""
    name = (torch.cuda.get_device_name(device) if device.type == "cuda" else
            f"cpu{os.cpu_count()}x{torch.get_num_threads()}")
    step = "fixed" if fixed_shapes(device) else "eager"
    key = json.dumps([os.path.realpath(model_path), config, name, tp, str(dtype), list(limits), step,
                      torch.__version__, CACHE_LAYOUT])
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "sglang-tree-v4", "step_times", hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure(model, max_tokens: int, topk: int, max_steps: int, max_batch: int, device: torch.device) -> StepTimes:
    """Time draft(S) and verify(D) on scratch stores at the batch sizes of ``BATCHES`` up to ``max_batch``."""
    cfg = model.cfg
    dtype = model.embed.weight.dtype
    batches = sorted({b for b in BATCHES if b <= max_batch} | {max_batch})
    width = CONTEXT + max_tokens
    slots = max(batches) * width
    store = model.new_store(slots, dtype, device)
    mtp_store = new_mtp_store(cfg, slots, dtype, device, max(batches) * draft_scratch_rows(topk, max_steps))
    streams = new_streams_store(cfg, slots, dtype, device)
    times = StepTimes()
    verify_sizes = verify_widths(max_tokens)
    # One untimed pass first: lazy initialisation (allocator, kernels, caches) must not count as a step.
    _time_batch(model, store, mtp_store, streams, batches[:1], width, max_tokens, topk, 1, [1], device, StepTimes(),
                passes=1)
    _time_batch(model, store, mtp_store, streams, batches, width, max_tokens, topk, max_steps, verify_sizes, device,
                times)
    return times


def verify_widths(max_tokens: int) -> list[int]:
    """The verified tokens per request timed at startup: every D up to 8, then every fourth, and the largest (the
    model interpolates in D between them)."""
    return sorted({*range(1, min(8, max_tokens) + 1), *range(8, max_tokens + 1, 4), max_tokens})


def _time_batch(model, store, mtp_store, streams, batches, width, max_tokens, topk, max_steps, verify_sizes, device,
                times: StepTimes, passes: int = PASSES) -> None:
    fastest: dict[tuple, float] = {}

    def timed(key, run):  # -> what ``run`` returned; its time into ``fastest``
        start = time.perf_counter()
        out = run()
        _sync(device)
        fastest[key] = min(fastest.get(key, float("inf")), time.perf_counter() - start)
        return out

    for _ in range(passes):
        for bs in batches:
            table = torch.arange(bs * width, device=device).view(bs, width)
            prefix = torch.full((bs,), CONTEXT, device=device)
            roots = torch.ones(bs, dtype=torch.long, device=device)

            def draft(s):
                root = catch_up(model, mtp_store, streams, table, [CONTEXT - 3] * bs, [CONTEXT] * bs,
                                [[1, 2, 3]] * bs)
                drafter = MTPTreeDrafter(model, mtp_store, table, prefix, topk, max_steps)
                return build_draft_tree(roots, prefix, drafter, s, topk, max_tokens, root_draft=root)

            for s in range(1, max_steps + 1):
                tree = timed(("draft", s, bs), lambda: draft(s))
            for d in verify_sizes:
                tokens = tree.tokens[:, :d] if d > 1 else roots[:, None]
                timed(("verify", bs, d), lambda: verify_forward(model, store, table, prefix, tokens, d))
    steps = list(range(1, max_steps + 1))
    for bs in batches:
        for s, seconds in zip(steps, monotone([fastest[("draft", s, bs)] for s in steps])):
            times.draft.setdefault(s, Curve()).add(bs, seconds)
        for d, seconds in zip(verify_sizes, monotone([fastest[("verify", bs, d)] for d in verify_sizes])):
            times.verify.setdefault(d, Curve()).add(bs, seconds)


def monotone(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent violators: a run of
    points that decreases is replaced by its mean), for times over a size that cannot cost less when it grows."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(n)]


def verify_forward(model, store, table: torch.Tensor, prefix: torch.Tensor, tokens: torch.Tensor, d: int):
    """The target's tree-verify forward of ``d`` nodes per request (as the SGLang adapter runs it), here as a
    chain of the given tokens (the cost depends on the node count, not on the shape)."""
    bs = tokens.shape[0]
    device = tokens.device
    mask = torch.tril(torch.ones(d, d, dtype=torch.bool, device=device)).expand(bs, d, d).flatten()
    out_slots = table[torch.arange(bs, device=device)[:, None], prefix[:, None] + torch.arange(d, device=device)]
    out_slots = out_slots.flatten()
    positions = (prefix[:, None] + torch.arange(d, device=device)).flatten()
    slot_table, entry_out = verify_table(table, prefix, mask, out_slots, d)
    batch = ForwardBatch(tokens.flatten().long(), positions, out_slots, slot_table, verify_caps(prefix, d, table.shape[1]),
                         entry_out)
    return model(batch, store)


def read_cache(path: str) -> StepTimes | None:
    try:
        with open(path) as f:
            return StepTimes.from_json(json.load(f)["times"])
    except (OSError, ValueError, KeyError):
        return None


def write_cache(path: str, times: StepTimes, seconds: float) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"times": times.to_json(), "measured_s": round(seconds, 3)}, f)
    os.replace(tmp, path)
