"""Negative controls for the end-to-end checks, injected into a test server and nowhere else.

A server started with this folder on ``PYTHONPATH`` and ``TREE_V4_TEST_MUTATION=<name>`` imports this file at
interpreter start (Python's ``sitecustomize`` hook) in every process it runs; a module named below is patched right
after it is first imported, before anyone binds its names. The product code carries no hook for this.

* ``wrong_token``: the greedy verifier emits one wrong token: in the first round that verifies a batch of two or
  more requests (not the server's single warm-up request), request 0's bonus token + 1.
* ``leak_aborted``: the KV release of aborted requests is skipped (their slots are never freed).
* ``biased_accept``: stochastic acceptance accepts every draft with probability ``min(1, p + 0.02)``
  (each acceptance coin lowered by 0.02).
* ``short_window``: SGLang is told to keep one page of window rows less than the state reads
  (``sglang_pool.retained_window``).
* ``ring_stored_only``: a block-closing query reads every CSA compressor row from the ring, none from its own
  forward's values, so a prefill that wraps its ring pools rows it overwrote (``compressor``).
* ``stream_off_by_one``: the MTP's catch-ups read each position's target stream from the position before it
  (what a wrong ring-row mapping of the streams would do, ``mtp_drafter``).

Not a fault, a forcing: ``cycle_shapes`` makes the adaptive budget run every shape of its menu in turn ("no
speculation" included), then a run of steps without speculation longer than the MTP's catch-up cap (the largest D),
so a test sees every switch the policy could ever make, resuming after a gap in the MTP's rows included; and every
other prefill round finds the batch "not speculating", so it defers the MTP's rows (``worker._defer_prefill_mtp``).
``never_speculate`` makes it choose "no speculation" at every step (what a step
that does not speculate costs, ``benchmark/none_step_cost.py``).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

MUTATION = os.environ.get("TREE_V4_TEST_MUTATION", "")


def _wrong_token(worker) -> None:
    original = worker.verify_greedy
    done = [False]

    def verify_greedy(tree, logits):
        result = original(tree, logits)
        if not done[0] and tree.tokens.shape[0] >= 2:
            done[0] = True
            last = int(result.accept_lens[0]) - 1
            result.tokens[0, last] = (result.tokens[0, last] + 1) % logits.shape[-1]
        return result

    worker.verify_greedy = verify_greedy


def _leak_aborted(common) -> None:
    original = common.release_kv_cache

    def release_kv_cache(req, tree_cache, *, checkpoint):
        if type(getattr(req, "finished_reason", None)).__name__ == "FINISH_ABORT":
            return  # forget to free the aborted request
        return original(req, tree_cache, checkpoint=checkpoint)

    common.release_kv_cache = release_kv_cache


def _biased_accept(worker) -> None:
    original = worker.verify_sampling

    def verify_sampling(tree, logits, params, generator=None, coins=None, **kwargs):
        coins = worker.VerifyCoins((coins.accept - 0.02).clamp(min=0.0), coins.bonus)
        return original(tree, logits, params, generator, coins, **kwargs)

    worker.verify_sampling = verify_sampling


def _short_window(pool) -> None:
    original = pool.retained_window

    def retained_window(cfg):
        return original(cfg) - pool.state_page_size(cfg)

    pool.retained_window = retained_window


def _ring_stored_only(compressor) -> None:
    def find(values, queries):
        return compressor.torch.zeros_like(queries, dtype=compressor.torch.bool), compressor.torch.zeros_like(queries)

    compressor.find = find


def _stream_off_by_one(drafter) -> None:
    original = drafter._mtp_rows

    def _mtp_rows(model, mtp_store, streams, table, positions, next_ids, last):
        earlier = table.lookup((positions - 1).clamp(min=0)[:, None])[:, 0]

        class Late:
            def read(self, layer, piece, slots):
                return streams.read(layer, piece, earlier)

        return original(model, mtp_store, Late(), table, positions, next_ids, last)

    drafter._mtp_rows = _mtp_rows


class _EveryOtherNotSpeculating(dict):
    """The policy's per-batch-size record of speculating, as the worker's prefill reads it: every other lookup
    answers "not speculating", whatever the batch size."""

    lookups = 0

    def get(self, key, default=None):
        self.lookups += 1
        return self.lookups % 2 == 0


def _cycle_shapes(adaptive) -> None:
    def choose(self, batch, remaining=None):
        self.steps += 1
        cycle = self.menu + [adaptive.NO_SPECULATION] * (max(d for d, _ in self.menu) + 1)
        return cycle[self.steps % len(cycle)]

    init = adaptive.AdaptivePolicy.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.speculating = _EveryOtherNotSpeculating()

    adaptive.AdaptivePolicy.choose = choose
    adaptive.AdaptivePolicy.__init__ = __init__


def _never_speculate(adaptive) -> None:
    adaptive.AdaptivePolicy.choose = lambda self, batch, remaining=None: adaptive.NO_SPECULATION


PATCHES = {
    "wrong_token": ("sglang_tree_v4.speculative.worker", _wrong_token),
    "leak_aborted": ("sglang.srt.mem_cache.common", _leak_aborted),
    "biased_accept": ("sglang_tree_v4.speculative.worker", _biased_accept),
    "short_window": ("sglang_tree_v4.serving.sglang_pool", _short_window),
    "ring_stored_only": ("sglang_tree_v4.dsv4.compressor", _ring_stored_only),
    "stream_off_by_one": ("sglang_tree_v4.speculative.mtp_drafter", _stream_off_by_one),
    "cycle_shapes": ("sglang_tree_v4.speculative.adaptive.policy", _cycle_shapes),
    "never_speculate": ("sglang_tree_v4.speculative.adaptive.policy", _never_speculate),
}


class _PatchAfterImport:
    """A meta-path finder that lets the normal finder locate ``target`` and patches the module once executed."""

    def __init__(self, target: str, patch):
        self.target, self.patch = target, patch

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


if MUTATION:
    if MUTATION not in PATCHES:
        raise SystemExit(f"TREE_V4_TEST_MUTATION: unknown mutation {MUTATION!r}; known: {sorted(PATCHES)}")
    sys.meta_path.insert(0, _PatchAfterImport(*PATCHES[MUTATION]))
