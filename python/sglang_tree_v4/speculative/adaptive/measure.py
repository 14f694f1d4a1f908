"""The startup step-time measurement, and its cache file.

At startup the worker times the real pieces of a decode round on private scratch state (its own small slot
stores, never SGLang's pool; zeros cost the same as real state): the MTP draft (catch-up + ``build_draft_tree``
over S steps), or DSpark's block pass and best-first search (``_measure_dspark``), and the target's tree-verify
forward of D tokens per request, at the batch sizes of
``MEASURE_BATCHES`` up to the largest, for the S and D of ``startup_plan`` (on a CPU every S and the D of
``verify_widths``; on a GPU a few, interpolated between). Every point is timed once per pass, in the plan's passes
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
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ...dsv4 import dspark as ds
from ...dsv4.mtp import draft_scratch_rows, new_mtp_store, new_streams_store
from ...dsv4.storage import ForwardBatch
from ...serving.sglang_model import fixed_shapes, verify_caps, verify_table
from ...tree import build_draft_tree
from .. import dspark_drafter
from ..mtp_drafter import MTPTreeDrafter, catch_up
from .config import DEFAULT, PolicyConfig
from .timing import Curve, StepTimes

logger = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class StartupPlan:
    """What the startup measurement times: ``draft_steps`` x ``verify_widths`` at each of ``batches``, in ``passes``
    passes (plus one untimed warm-up point); the draft time of an S not timed is interpolated in S, a D not timed
    in D (``timing.StepTimes.verify_time``)."""

    batches: tuple[int, ...]
    draft_steps: tuple[int, ...]
    verify_widths: tuple[int, ...]
    passes: int

    @property
    def points(self) -> int:
        return len(self.batches) * (len(self.draft_steps) + len(self.verify_widths))

    def describe(self) -> str:
        return (f"{self.points} shapes x {self.passes} passes: batch sizes {list(self.batches)}, draft steps "
                f"{list(self.draft_steps)}, verified tokens {list(self.verify_widths)}")

    def estimate(self, seconds: Callable[[str, int, int], float]) -> float:
        """Seconds the measurement takes, given ``seconds(kind, batch, size)`` of one timed point (``kind`` draft
        with S steps, or verify of D tokens per request)."""
        one_pass = sum(seconds("draft", b, s) for b in self.batches for s in self.draft_steps)
        one_pass += sum(seconds("verify", b, d) for b in self.batches for d in self.verify_widths)
        warm_up = seconds("draft", self.batches[0], 1) + seconds("verify", self.batches[0], 1)
        return warm_up + self.passes * one_pass


def startup_plan(max_tokens: int, topk: int, max_steps: int, max_batch: int, device: torch.device,
                 config: PolicyConfig = DEFAULT, block_drafter: bool = False) -> StartupPlan:
    """On a CPU every S and the D of ``verify_widths`` in ``MEASURE_PASSES`` passes; on a GPU the first, middle
    and last S, D at powers of two and the largest, in ``MEASURE_PASSES_GPU`` passes. A block drafter (DSpark)
    drafts every S in one pass, so its draft is timed once (at the largest S)."""
    batches = tuple(sorted({b for b in config.MEASURE_BATCHES if b <= max_batch} | {max_batch}))
    if torch.device(device).type != "cuda":
        steps = (max_steps,) if block_drafter else tuple(range(1, max_steps + 1))
        return StartupPlan(batches, steps, tuple(verify_widths(max_tokens)), config.MEASURE_PASSES)
    steps = (max_steps,) if block_drafter else tuple(sorted({1, (max_steps + 1) // 2, max_steps}))
    widths = tuple(sorted({d for d in (1, 2, 4, 8, 16, 32, 64, 128) if d <= max_tokens} | {max_tokens}))
    return StartupPlan(batches, steps, widths, config.MEASURE_PASSES_GPU)


@torch.no_grad()
def measure(model, max_tokens: int, topk: int, max_steps: int, max_batch: int, device: torch.device,
            config: PolicyConfig = DEFAULT) -> StepTimes:
    """Time draft(S) and verify(D) on scratch stores as ``startup_plan`` says, at the batch sizes of
    ``MEASURE_BATCHES`` up to ``max_batch`` (and at ``max_batch``)."""
    cfg = model.cfg
    dtype = model.embed.weight.dtype
    context = config.MEASURE_CONTEXT
    dspark = model.dspark is not None
    plan = startup_plan(max_tokens, topk, max_steps, max_batch, device, config, block_drafter=dspark)
    logger.info("TREE_V4 adaptive budget: timing %s", plan.describe())
    batches = list(plan.batches)
    width = context + max_tokens
    slots = max(batches) * width
    store = model.new_store(slots, dtype, device)
    if dspark:
        return _measure_dspark(model, store, plan, width, context, max_tokens, topk, max_steps, device, config)
    mtp_store = new_mtp_store(cfg, slots, dtype, device, max(batches) * draft_scratch_rows(topk, max_steps))
    streams = new_streams_store(cfg, slots, dtype, device)
    times = StepTimes(config=config)
    # One untimed pass first: lazy initialisation (allocator, kernels, caches) must not count as a step.
    _time_batch(model, store, mtp_store, streams, batches[:1], width, context, max_tokens, topk, 1, [1], [1], device,
                StepTimes(config=config), passes=1)
    _time_batch(model, store, mtp_store, streams, batches, width, context, max_tokens, topk, max_steps,
                list(plan.draft_steps), list(plan.verify_widths), device, times, passes=plan.passes)
    return times


def _fastest_timer(fastest: dict[tuple, float], device: torch.device) -> Callable:
    """``timed(key, run)``: runs ``run``, keeps its fastest time under ``key`` in ``fastest`` (the device synced
    before the clock stops) and returns what ``run`` returned."""
    def timed(key, run):
        start = time.perf_counter()
        out = run()
        _sync(device)
        fastest[key] = min(fastest.get(key, float("inf")), time.perf_counter() - start)
        return out
    return timed


def _measure_dspark(model, store, plan: StartupPlan, width: int, context: int, max_tokens: int, topk: int,
                    max_steps: int, device: torch.device, config: PolicyConfig) -> StepTimes:
    """``measure`` for a DSpark drafter. Its round is one block pass (the same at every S: ``draft``) and a best-first
    search whose cost grows with the nodes it pops, so each verify curve point of D is the search of D nodes plus
    the verify forward of D tokens (with the taps the drafter's context needs). A tree of D nodes costs about the
    same whatever its tokens, so the synthetic requests' trees stand for served ones."""
    cfg, dcfg = model.cfg, model.dspark.dcfg
    dtype = model.embed.weight.dtype
    batches = list(plan.batches)
    dstore = ds.new_dspark_store(cfg, dcfg, max(batches) * width, dtype, device,
                                 block_rows=max(batches) * dcfg.block_size)
    taps = tuple(dcfg.target_layer_ids)
    fastest: dict[tuple, float] = {}
    timed = _fastest_timer(fastest, device)

    def one_pass(batch_sizes, widths):
        for bs in batch_sizes:
            table = torch.arange(bs * width, device=device).view(bs, width)
            prefix = torch.full((bs,), context, device=device)
            roots = torch.ones(bs, dtype=torch.long, device=device)
            block = timed(("draft", bs), lambda table=table, prefix=prefix, roots=roots:
                          dspark_drafter.block_pass(model, dstore, table, prefix, roots))
            for d in widths:
                def step(d=d, bs=bs, table=table, prefix=prefix, roots=roots, block=block):
                    tokens = roots[:, None]
                    if d > 1:
                        tokens = dspark_drafter.search(model, block, roots, max_steps, topk, d).tokens
                    return verify_forward(model, store, table, prefix, tokens, tokens.shape[1], taps)
                timed(("verify", bs, d), step)

    one_pass(batches[:1], [1, 2])  # untimed: lazy initialisation must not count as a step
    fastest.clear()
    for _ in range(plan.passes):
        one_pass(batches, plan.verify_widths)
    times = StepTimes(config=config)
    for bs in batches:
        for s in range(1, max_steps + 1):
            times.draft.setdefault(s, Curve()).add(bs, fastest[("draft", bs)])
        seconds = monotone([fastest[("verify", bs, d)] for d in plan.verify_widths])
        for d, t in zip(plan.verify_widths, seconds, strict=True):
            times.verify.setdefault(d, Curve()).add(bs, t)
    return times


def verify_widths(max_tokens: int) -> list[int]:
    """The verified tokens per request timed at startup: every D up to 8, then every fourth, and the largest (the
    model interpolates in D between them)."""
    return sorted({*range(1, min(8, max_tokens) + 1), *range(8, max_tokens + 1, 4), max_tokens})


def _time_batch(model, store, mtp_store, streams, batches, width, context, max_tokens, topk, max_steps, draft_steps,
                verify_sizes, device, times: StepTimes, passes: int) -> None:
    fastest: dict[tuple, float] = {}
    timed = _fastest_timer(fastest, device)

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

            for s in draft_steps:  # the last (the most steps) leaves the tree the verify widths read
                tree = timed(("draft", s, bs), lambda s=s: draft(s))
            for d in verify_sizes:
                tokens = tree.tokens[:, :d] if d > 1 else roots[:, None]
                timed(("verify", bs, d), lambda table=table, prefix=prefix, tokens=tokens, d=d:
                      verify_forward(model, store, table, prefix, tokens, d))
    steps = list(range(1, max(draft_steps) + 1))
    for bs in batches:
        in_steps = Curve({s: fastest[("draft", s, bs)] for s in draft_steps})  # S not timed: interpolated
        for s, seconds in zip(steps, monotone([in_steps(s) for s in steps]), strict=True):
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


def verify_forward(model, store, table: torch.Tensor, prefix: torch.Tensor, tokens: torch.Tensor, d: int,
                   taps: tuple[int, ...] = ()):
    """The target's tree-verify forward of ``d`` nodes per request (as the SGLang adapter runs it), here as a
    chain of the given tokens (the cost depends on the node count, not on the shape); ``taps`` as the adapter's."""
    bs = tokens.shape[0]
    device = tokens.device
    mask = torch.tril(torch.ones(d, d, dtype=torch.bool, device=device)).expand(bs, d, d).flatten()
    out_slots = table[torch.arange(bs, device=device)[:, None], prefix[:, None] + torch.arange(d, device=device)]
    out_slots = out_slots.flatten()
    positions = (prefix[:, None] + torch.arange(d, device=device)).flatten()
    slot_table, entry_out = verify_table(table, prefix, mask, out_slots, d)
    caps = verify_caps(prefix, d, table.shape[1])
    batch = ForwardBatch(tokens.flatten().long(), positions, out_slots, slot_table, caps, entry_out)
    return model(batch, store, taps=taps)


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
