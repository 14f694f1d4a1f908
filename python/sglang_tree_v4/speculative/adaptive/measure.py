"""The startup step-time measurement, and its cache file.

At startup the worker times the real pieces of a decode round on private scratch state (its own small slot
stores, never SGLang's pool; zeros cost the same as real state): the MTP draft (catch-up + ``build_draft_tree``
over S steps, for each S) and the target's tree-verify forward (for each D of ``verify_widths``), at the batch
sizes of ``MEASURE_BATCHES`` up to the largest. Every point is timed once per pass, in ``MEASURE_PASSES`` passes
over the whole grid, and keeps its fastest; then, per batch size, the times are made non-decreasing in D and in S
(``monotone``): more verified tokens or draft steps never cost less, so a point above a larger one is noise. The
choice among trees turns on a few percent, so both steps matter. The result is the model that
``timing.StepTimes`` corrects with served steps.

It is cached under ``~/.cache/sglang-tree-v4/step_times/`` (``$XDG_CACHE_HOME`` honoured), keyed by everything the
times depend on: the checkpoint (path and config), the device, the TP size, the dtype, the shape limits and the kind
of verify step (eager or fixed-shape), and read back on the next start instead of measuring again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import torch

from ...dsv4.mtp import draft_scratch_rows, new_mtp_store, new_streams_store
from ...dsv4.storage import ForwardBatch
from ...serving.sglang_model import fixed_shapes, verify_caps, verify_table
from ...tree import build_draft_tree
from ..mtp_drafter import MTPTreeDrafter, catch_up
from .config import DEFAULT, PolicyConfig
from .timing import Curve, StepTimes

# Part of the cache key, raised with every change to the file's layout or to how it is measured, so that an older
# file is measured again (3: verification per D over the batch size, in passes, non-decreasing in D and S).
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
def measure(model, max_tokens: int, topk: int, max_steps: int, max_batch: int, device: torch.device,
            config: PolicyConfig = DEFAULT) -> StepTimes:
    """Time draft(S) and verify(D) on scratch stores at the batch sizes of ``MEASURE_BATCHES`` up to ``max_batch``
    (and at ``max_batch``)."""
    cfg = model.cfg
    dtype = model.embed.weight.dtype
    context = config.MEASURE_CONTEXT
    batches = sorted({b for b in config.MEASURE_BATCHES if b <= max_batch} | {max_batch})
    width = context + max_tokens
    slots = max(batches) * width
    store = model.new_store(slots, dtype, device)
    mtp_store = new_mtp_store(cfg, slots, dtype, device, max(batches) * draft_scratch_rows(topk, max_steps))
    streams = new_streams_store(cfg, slots, dtype, device)
    times = StepTimes(config=config)
    verify_sizes = verify_widths(max_tokens)
    # One untimed pass first: lazy initialisation (allocator, kernels, caches) must not count as a step.
    _time_batch(model, store, mtp_store, streams, batches[:1], width, context, max_tokens, topk, 1, [1], device,
                StepTimes(config=config), passes=1)
    _time_batch(model, store, mtp_store, streams, batches, width, context, max_tokens, topk, max_steps, verify_sizes,
                device, times, passes=config.MEASURE_PASSES)
    return times


def verify_widths(max_tokens: int) -> list[int]:
    """The verified tokens per request timed at startup: every D up to 8, then every fourth, and the largest (the
    model interpolates in D between them)."""
    return sorted({*range(1, min(8, max_tokens) + 1), *range(8, max_tokens + 1, 4), max_tokens})


def _time_batch(model, store, mtp_store, streams, batches, width, context, max_tokens, topk, max_steps, verify_sizes,
                device, times: StepTimes, passes: int) -> None:
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
            prefix = torch.full((bs,), context, device=device)
            roots = torch.ones(bs, dtype=torch.long, device=device)

            def draft(s, bs=bs, table=table, prefix=prefix, roots=roots):
                root = catch_up(model, mtp_store, streams, table, [context - 3] * bs, [context] * bs,
                                [[1, 2, 3]] * bs)
                drafter = MTPTreeDrafter(model, mtp_store, table, prefix, topk, max_steps)
                return build_draft_tree(roots, prefix, drafter, s, topk, max_tokens, root_draft=root)

            for s in range(1, max_steps + 1):
                tree = timed(("draft", s, bs), lambda s=s: draft(s))
            for d in verify_sizes:
                tokens = tree.tokens[:, :d] if d > 1 else roots[:, None]
                timed(("verify", bs, d), lambda table=table, prefix=prefix, tokens=tokens, d=d:
                      verify_forward(model, store, table, prefix, tokens, d))
    steps = list(range(1, max_steps + 1))
    for bs in batches:
        for s, seconds in zip(steps, monotone([fastest[("draft", s, bs)] for s in steps]), strict=False):
            times.draft.setdefault(s, Curve()).add(bs, seconds)
        verify_seconds = monotone([fastest[("verify", bs, d)] for d in verify_sizes])
        for d, seconds in zip(verify_sizes, verify_seconds, strict=True):
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
    caps = verify_caps(prefix, d, table.shape[1])
    batch = ForwardBatch(tokens.flatten().long(), positions, out_slots, slot_table, caps, entry_out)
    return model(batch, store)


def read_cache(path: str, config: PolicyConfig = DEFAULT) -> StepTimes | None:
    """The cached model, or None where there is none or it is of another layout (then it is measured again)."""
    try:
        with open(path) as f:
            return StepTimes.from_json(json.load(f)["times"], config)
    except (OSError, ValueError, KeyError):
        return None


def write_cache(path: str, times: StepTimes, seconds: float) -> None:
    """Written to a temporary file and renamed, so that a reader never sees half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"times": times.to_json(), "measured_s": round(seconds, 3)}, f)
    os.replace(tmp, path)
