"""TREE_V4 as an SGLang speculative algorithm: the registry entry and the scheduler-facing description.

SGLang 0.5.23's scheduler has two relay shapes for speculative results, NGRAM-shaped and EAGLE-shaped. TREE_V4
keeps its draft state inside the model's per-slot rows rather than a separate draft KV pool, so it takes the NGRAM
shape: one worker, verify slots reserved by the scheduler, no draft hidden states relayed between rounds.
"""

from __future__ import annotations

import os

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from ..serving.sglang_pool import TREE_V4

NAME = TREE_V4
SERVER_INFO_TARGET = ("sglang.srt.managers.scheduler_components.internal_state."
                      "SchedulerInternalStateController._add_speculative")
REQUEST_CHECK_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"


class TreeV4Algorithm(CustomSpecAlgo):
    def is_ngram(self) -> bool:
        return True

    def has_draft_kv(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def carries_draft_hidden_states(self) -> bool:
        return False

    def get_platform_worker_cls(self):
        return None

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                          needs_confidence_relay: bool = False):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    def handle_server_args(self, server_args) -> None:
        from . import server_args as args
        from .model_override import OWN_MODEL_ENV

        args.handle_server_args(server_args)
        os.environ[OWN_MODEL_ENV] = "1"  # inherited by the scheduler processes


def add_shape_counters(result, controller, state: dict) -> None:
    """AFTER hook on the scheduler's speculative server-info section: steps per tree shape (``none`` = decoded
    without speculation), whether the budget is adaptive, and the prefill chunks whose MTP rows ran or were
    deferred (``worker._defer_prefill_mtp``), in ``/get_server_info``'s ``internal_states``."""
    from .worker import ACTIVE

    if ACTIVE:
        state["tree_v4_shape_steps"] = dict(ACTIVE[0].shape_counts)
        state["tree_v4_mtp_prefills"] = dict(ACTIVE[0].mtp_prefills)
        state["tree_v4_adaptive"] = ACTIVE[0].policy is not None


def _check_request(manager, obj, *args, **kwargs):
    """Requests TREE_V4 cannot serve exactly get a 400 naming the field (``sampling_rules.refusal``)."""
    from .sampling_rules import check_request

    return check_request(manager, obj, *args, **kwargs)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import _REGISTRY

    if NAME in _REGISTRY:
        return
    HookRegistry.register(SERVER_INFO_TARGET, add_shape_counters, HookType.AFTER)
    HookRegistry.register(REQUEST_CHECK_TARGET, _check_request, HookType.BEFORE)

    @SpeculativeAlgorithm.register(NAME, supports_overlap=True, spec_class=TreeV4Algorithm)
    def _worker_class(server_args):
        from .worker import TreeV4Worker

        return TreeV4Worker
