"""The TREE_V4 speculative worker: MTP draft of a dynamic tree -> one target verify pass -> accept -> commit.

A decode round, per batch:

1. the MTP catches up on the positions committed since it last ran and drafts the root's children: after a
   prefill over the prompt's last position (the prefill round ran it over the prompt's last window from the streams
   its forward produced, ``catch_up_prefill``); after steps without speculation over the last D positions only (the
   positions it skipped before them are masked out of its window, ``mtp_window_from``), so resuming speculation
   costs a round, not a window's catch-up; ``build_draft_tree`` expands the tree with the MTP over its draft
   scratch rows (EAGLE-2: top-K frontier, S steps, rerank to D nodes);
2. the target verifies all D nodes of every request in one forward (``TARGET_VERIFY``; our model reads each node's
   ancestry from the tree mask, writes only the node's own verify slot);
3. the tree core accepts the longest matching path (greedy) or runs lossless multi-branch speculative sampling
   with each request's sampling parameters;
4. SGLang's accepted-token move copies the accepted nodes' window rows (target, streams, MTP) to the request's
   canonical slots, and the adapter copies the compressed entries of accepted nodes that were in tree scratch to
   their blocks' rows (``commit_tree_entries``): that is the accepted-path state refresh. Rejected rows stay in
   reserved slots (and scratch) that the next round overwrites and the request's release frees.

Overlap scheduling (SGLang's default) launches a round before the previous round's result is processed, so that
round's accepted tokens are read from the batch's ``spec_info`` until they reach ``req.output_ids``
(``_pending_tokens``). A round needs D slots past the committed length, inside SGLang's speculative reservation
(twice max(D, K S) past the committed length it knows, which lags by at most one round's D).

Prefill rounds are plain target forwards, then the MTP over each chunk's last window (``_prefill_mtp``), unless
the adaptive budget is not speculating at the batch size the prefill joins (``_defer_prefill_mtp``).

Without shape flags the budget is adaptive (``speculative.adaptive``): before step 1 the worker picks this step's shape
(D, S), possibly "no speculation" (the root alone is verified, i.e. ordinary decoding, and the MTP skips the step;
its next catch-up covers at most the last D positions, step 1). Outputs keep the server's largest-D layout.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from sglang.srt.distributed import get_tp_group
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_device, get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.ngram_info import NgramVerifyInput
from sglang.srt.speculative.spec_utils import move_accept_tokens_to_target_kvcache

from ..serving import step_graphs
from ..serving.sglang_model import TreeV4DeepseekV4ForCausalLM, accept_index_of, fixed_shapes
from ..tree import (
    DraftTree,
    SamplingParams,
    VerifyCoins,
    verify_greedy,
    verify_sampling,
)
from . import dspark_drafter
from .adaptive import NO_SPECULATION, AdaptivePolicy, measure
from .mtp_drafter import (
    MTPGraphs,
    catch_up,
    catch_up_fixed,
    catch_up_prefill,
    catch_up_start,
    deferred_start,
    draft_tree,
    mtp_window_from,
    prefill_span,
)
from .sampling_rules import SamplingRules
from .server_args import ADAPTIVE_ENV, TreeBudget, checkpoint_score_temperature
from .tp_sync import broadcast_verdict

logger = logging.getLogger(__name__)
ACTIVE: list["TreeV4Worker"] = []  # this scheduler process's worker (read by the server-info hook)
MTP_LEN_ATTR = "tree_v4_mtp_len"  # per request: positions whose MTP rows are current
MTP_FROM_ATTR = "tree_v4_mtp_from"  # per request: the first position the MTP's window may read (rows since then)
PREFILL_LEN_ATTR = "tree_v4_prefill_len"  # per request: its length after its last prefill round
PREFILLED_TO_ATTR = "tree_v4_prefilled_to"  # per request: where its last prefill chunk ended (None once decoding)


def request_score_temperatures(fitted: float, temperatures: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """Per-request draft-score temperature: ``max(fitted, t)`` for a request sampled at temperature ``t``, the fitted
    one for a greedy request (SGLang marks those with ``top_k = 1``).

    The checkpoint's temperature is fitted against greedy acceptance. A sampled request accepts a draft with the
    (processed) target probability of it, which an MTP trained toward the target estimates at the request's own
    temperature; sharper than that would build too deep a tree (on the embedded model, sampling at t = 1 accepted
    3-5 % less with the greedy fit than with raw scores)."""
    sampled = torch.where(top_ks.flatten() == 1, 0.0, temperatures.flatten().float())
    return sampled.clamp(min=fitted)


class TreeV4Worker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        spec = get_spec()
        self.budget = TreeBudget(spec.speculative_num_draft_tokens, spec.speculative_eagle_topk,
                                 spec.speculative_num_steps)
        self.speculative_num_draft_tokens = self.budget.draft_tokens
        self.device = get_device().device
        self.fixed_shapes = fixed_shapes(self.device)  # the GPU's step (no host reads, capturable)
        self.adapter = self.model_runner.model
        if not isinstance(self.adapter, TreeV4DeepseekV4ForCausalLM):
            raise ValueError(f"--speculative-algorithm TREE_V4 needs our DeepSeek-V4 model, got "
                             f"{type(self.adapter).__name__}")
        self.dspark = self.adapter.model.dspark  # DSpark drafts, not the MTP (``dspark_drafter``)
        if len(self.adapter.model.mtp) == 0 and self.dspark is None:
            raise ValueError("--speculative-algorithm TREE_V4 drafts with the checkpoint's MTP layer (mtp.0.*) or "
                             "its DSpark drafter, and this checkpoint has neither")
        self.mtp_graphs: MTPGraphs | None = None  # the MTP's forwards as CUDA graphs (``_mtp_graphs``)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(server_args.random_seed or 0)
        self.score_temperature = checkpoint_score_temperature(server_args.model_path)
        self.tp_group = get_tp_group()
        self.policy = self._adaptive_policy() if os.environ.get(ADAPTIVE_ENV) == "1" else None
        self.shape_counts: dict[str, int] = {}
        self.mtp_prefills = {"run": 0, "deferred": 0}  # prefill chunks whose MTP rows ran / were deferred
        # The last decode round, until the next one starts: (batch size, shape, start, verified, end).
        self._last_round: tuple[int, tuple[int, int], float, float, float] | None = None
        ACTIVE[:] = [self]
        logger.info("TREE_V4 worker: D=%d K=%d S=%d%s, draft score temperature %.3g, %s verify step",
                    *vars(self.budget).values(), " (the largest shape of the adaptive budget)" if self.policy else "",
                    self.score_temperature, "fixed-shape" if self.fixed_shapes else "eager")

    def _adaptive_policy(self) -> AdaptivePolicy:
        """The step-time model from the cache file, or measured now on every rank (the forwards use the TP group);
        rank 0 decides whether the cache is there."""
        limits = (self.budget.draft_tokens, self.budget.topk, self.budget.steps)
        max_batch = self.server_args.max_running_requests or 64
        path = measure.cache_path(self.server_args.model_path, torch.device(self.device), self.tp_group.world_size,
                                  self.adapter.model.embed.weight.dtype, limits + (max_batch,))
        times = measure.read_cache(path) if self.tp_group.rank_in_group == 0 else None
        hit = self._broadcast_ints([int(times is not None)])[0]
        start = time.perf_counter()
        if not hit:
            times = measure.measure(self.adapter.model, *limits, max_batch=max_batch,
                                    device=torch.device(self.device))
            if self.tp_group.rank_in_group == 0:
                measure.write_cache(path, times, time.perf_counter() - start)
        logger.info("TREE_V4 adaptive budget: step times %s in %.1f s (%s)", "read" if hit else "measured",
                    time.perf_counter() - start, path)
        return AdaptivePolicy(*limits, times=times)

    def _broadcast_ints(self, values: list[int]) -> list[int]:
        """Rank 0's integers on every rank."""
        if self.tp_group.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.long, device=self.device)
        return self.tp_group.broadcast(t, src=0).tolist()

    # --- what the scheduler expects of a worker -------------------------------------------------------------
    def alloc_memory_pool(self, **kwargs):
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self._target_worker.get_memory_pool()

    @property
    def draft_worker(self):
        return None

    def clear_cache_pool(self):
        pass

    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None, **kwargs):
        if batch.forward_mode.is_decode():
            return self._decode_round(batch, on_publish)
        return self._prefill_round(batch, on_publish, pp_proxy_tensors)

    # --- prefill -------------------------------------------------------------------------------------------
    def _prefill_round(self, batch, on_publish, pp_proxy_tensors):
        self._last_round = None  # the scheduler's time after the last decode round includes this prefill
        result = self._target_worker.forward_batch_generation(batch, pp_proxy_tensors=pp_proxy_tensors)
        if batch.forward_mode.is_extend() and batch.reqs and self.dspark is not None:
            self._prefill_dspark(batch)
        elif batch.forward_mode.is_extend() and batch.reqs:
            drafts = self._drafts_next()
            (self._prefill_mtp if drafts else self._defer_prefill_mtp)(batch)
            key = "run" if drafts else "deferred"
            self.mtp_prefills[key] += len(batch.reqs)
        bs, D = len(batch.reqs), self.budget.draft_tokens
        accept_tokens = torch.zeros(bs, D, dtype=torch.int32, device=self.device)
        accept_tokens[:, 0] = result.next_token_ids
        accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)
        new_seq_lens = batch.seq_lens.clone()
        if on_publish is not None:
            on_publish(new_seq_lens)
        return GenerationBatchResult(
            logits_output=result.logits_output, next_token_ids=result.next_token_ids,
            can_run_cuda_graph=result.can_run_cuda_graph, accept_lens=accept_lens, new_seq_lens=new_seq_lens,
            next_draft_input=NgramVerifyInput(draft_token_num=D, new_seq_lens=new_seq_lens,
                                              accept_tokens=accept_tokens.flatten(), accept_lens=accept_lens),
            speculative_num_draft_tokens=D)

    def _drafts_next(self) -> bool:
        """Whether the batch this prefill joins is likely to speculate soon: not where the adaptive budget's last
        own choice at its batch size (every request now holding a row of the pool) was "no speculation". Rank 0's
        answer on every rank (only it chooses, and the MTP's forward uses the TP group)."""
        if self.policy is None:
            return True
        pool = self.req_to_token_pool
        drafts = self.policy.speculating.get(pool.size - pool.available_size()) is not False
        return bool(self._broadcast_ints([int(drafts)])[0])

    def _defer_prefill_mtp(self, batch) -> None:
        """In place of ``_prefill_mtp`` where the batch is not expected to speculate (on the CPU the MTP's prefill
        was 1.7 % of a never-speculating server's time at batch 64): each request's MTP starts at the chunk's last D
        positions (``deferred_start``), masked below, so the first draft, if any, catches up on those from the
        streams the prefill left in the ring. A later chunk that runs the MTP starts its own window (not a
        continuation)."""
        C = self.budget.draft_tokens
        for req, a, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, strict=False):
            start = deferred_start(a, a + n, C)
            setattr(req, MTP_FROM_ATTR, start)
            setattr(req, MTP_LEN_ATTR, start)
            setattr(req, PREFILL_LEN_ATTR, a + n)
            setattr(req, PREFILLED_TO_ATTR, None)

    def _prefill_mtp(self, batch) -> None:
        """The MTP's rows over each chunk's last window, from the streams the prefill forward just produced
        (``catch_up_prefill``): the pool keeps a few streams per page, not a window of them. A chunk that does not
        continue the request's previous one (a radix hit, a retraction's new slots) starts the MTP's window at its
        first position's predecessor: the rows below it may never have been computed."""
        model = self.adapter.model
        _, mtp_store, streams = self.adapter.stores()
        chunks = [(a, a + n) for a, n in zip(batch.prefix_lens, batch.extend_lens, strict=False)]
        tokens, spans = [], []
        for req, (a, b) in zip(batch.reqs, chunks, strict=False):
            known = list(req.origin_input_ids) + list(req.output_ids)
            lo, hi = prefill_span(a, b, len(known), model.cfg.window)
            if getattr(req, PREFILLED_TO_ATTR, None) != a:  # not a continuation
                setattr(req, MTP_FROM_ATTR, max(a - 1, 0))
            setattr(req, PREFILLED_TO_ATTR, b)
            setattr(req, MTP_LEN_ATTR, hi)
            setattr(req, PREFILL_LEN_ATTR, b)
            tokens.append(known)
            spans.append((lo, hi))
        req_table = self.req_to_token_pool.req_to_token[batch.req_pool_indices].long()
        req_table = mtp_window_from(req_table, [getattr(req, MTP_FROM_ATTR, 0) for req in batch.reqs])
        own = self.adapter.last_streams
        if own is None or own.shape[0] != sum(b - a for a, b in chunks):
            raise RuntimeError("TREE_V4: the prefill forward's streams do not match the batch's chunks")
        catch_up_prefill(model, mtp_store, streams, req_table, chunks, spans, own, tokens)

    def _prefill_dspark(self, batch) -> None:
        """DSpark's stage keys of every position of the prefill's chunks, from its forward's taps."""
        features = self.adapter.last_features
        counts = torch.tensor(batch.extend_lens, device=self.device)
        if features is None or features.shape[0] != int(counts.sum()):
            raise RuntimeError("TREE_V4: the prefill forward's DSpark taps do not match the batch's chunks")
        starts = torch.tensor(batch.prefix_lens, device=self.device).repeat_interleave(counts)
        first = torch.cumsum(counts, 0) - counts
        positions = starts + torch.arange(int(counts.sum()), device=self.device) - first.repeat_interleave(counts)
        dspark_drafter.prefill_context(self.adapter.model, self.adapter.stores()[1], features, positions,
                                       batch.out_cache_loc.long())

    # --- decode: draft, verify, accept, commit --------------------------------------------------------------
    def _draft_dspark(self, batch, D: int, S: int, pending: list[list[int]], rules: SamplingRules | None,
                      finished: list[int]) -> DraftTree:
        """One DSpark block pass, then the tree over its exact conditionals (``dspark_drafter``)."""
        lens = batch.seq_lens.tolist()
        roots = []
        for i, (req, L, waiting) in enumerate(zip(batch.reqs, lens, pending, strict=True)):
            roots.append(0 if i in finished else _Output(req.output_ids, waiting)[-1])
            if i not in finished:
                _check_reserved(req, L, D)
        req_table = _inert(self.req_to_token_pool.req_to_token[batch.req_pool_indices].long(), finished)
        return dspark_drafter.draft_tree(self.adapter.model, self.adapter.stores()[1], req_table, batch.seq_lens,
                                         torch.tensor(roots, device=self.device), S, self.budget.topk, D,
                                         self._score_temperatures(batch),
                                         None if rules is None else rules.draft_hook)

    def _draft(self, batch, D: int, S: int, pending: list[list[int]], rules: SamplingRules | None,
               finished: list[int]) -> DraftTree:
        if self.dspark is not None:
            return self._draft_dspark(batch, D, S, pending, rules, finished)
        model = self.adapter.model
        _, mtp_store, streams = self.adapter.stores()
        K = self.budget.topk
        req_table = self.req_to_token_pool.req_to_token[batch.req_pool_indices].long()
        lens = batch.seq_lens.tolist()
        window = model.cfg.window
        C = self.budget.draft_tokens
        starts = []
        for i, (req, L) in enumerate(zip(batch.reqs, lens, strict=False)):
            if i in finished:  # an inert row (``_finished_rows``): one position, no state of its own touched
                starts.append(L - 1)
                continue
            start, gap = catch_up_start(getattr(req, MTP_LEN_ATTR, 0), getattr(req, PREFILL_LEN_ATTR, 0), L, window, C)
            if gap:
                setattr(req, MTP_FROM_ATTR, start)
            elif getattr(req, MTP_FROM_ATTR, 0) <= min(start, L - C) - window + 1:
                # The gap has left every window this round's MTP queries read (the earliest of them runs at
                # ``start``, or at ``L - C`` with fixed shapes): no mask, so no masked table to build.
                setattr(req, MTP_FROM_ATTR, 0)
            starts.append(start)
        req_table = mtp_window_from(req_table, [getattr(req, MTP_FROM_ATTR, 0) for req in batch.reqs])
        req_table = _inert(req_table, finished)
        # With fixed shapes (a GPU) the usual round (each request behind by at most the largest D) recomputes the
        # last D positions; after a prefill, and on a CPU, only the missing positions run.
        fixed = self.fixed_shapes and all(L - s <= C <= L for s, L in zip(starts, lens, strict=False))
        next_tokens, roots = [], []
        for i, (req, L, start, waiting) in enumerate(zip(batch.reqs, lens, starts, pending, strict=False)):
            if i in finished:
                next_tokens.append([0] * (C if fixed else L - start))
                roots.append(0)
                continue
            output = _Output(req.output_ids, waiting)
            next_tokens.append(_tokens_between(req.origin_input_ids, output, (L - C if fixed else start) + 1, L + 1))
            roots.append(output[-1])
            setattr(req, MTP_LEN_ATTR, L)
            setattr(req, PREFILLED_TO_ATTR, None)
            _check_reserved(req, L, D)
        graphs = self._mtp_graphs() if self.fixed_shapes else None
        if fixed:
            root_draft = catch_up_fixed(model, mtp_store, streams, req_table, batch.seq_lens,
                                        torch.tensor(next_tokens, device=self.device), graphs)
        else:
            root_draft = catch_up(model, mtp_store, streams, req_table, starts, lens, next_tokens)
        return draft_tree(model, mtp_store, req_table, batch.seq_lens, torch.tensor(roots, device=self.device),
                          root_draft, K, self.budget.steps, S, D, graphs, self._score_temperatures(batch),
                          None if rules is None else rules.draft_hook)

    def _mtp_graphs(self) -> MTPGraphs | None:
        """The MTP's catch-up and draft steps replayed from graphs in the server's ``StepGraphs`` (with the verify
        forward's), where graphs are on (``step_graphs.enabled``)."""
        if self.mtp_graphs is None and step_graphs.enabled(self.device):
            _, mtp_store, streams = self.adapter.stores()
            self.mtp_graphs = MTPGraphs(self.adapter.model, mtp_store, streams,
                                        self.adapter.graphs(torch.device(self.device)))
        return self.mtp_graphs

    @staticmethod
    def _pending_tokens(batch, lens: list[int]) -> list[list[int]]:
        """Each request's tokens that are committed but not yet in ``req.output_ids``.

        With overlap scheduling SGLang launches a round before it has processed the previous round's result, so
        the tokens that round accepted (the batch's ``spec_info``, resolved from the scheduler's future map) reach
        ``output_ids`` one round late; without it, or where the scheduler processed the result first, there are
        none. Which case holds is read from the lengths: the committed length ``L`` plus the uncommitted bonus is
        the whole sequence."""
        info = batch.spec_info
        tokens = getattr(info, "accept_tokens", None)
        counts = getattr(info, "accept_lens", None)
        if tokens is not None and counts is not None and counts.numel() == len(lens):
            rows, counts = tokens.view(len(lens), -1).tolist(), counts.tolist()
        else:
            rows, counts = [[]] * len(lens), [0] * len(lens)
        out = []
        for req, L, row, k in zip(batch.reqs, lens, rows, counts, strict=False):
            have = len(req.origin_input_ids) + len(req.output_ids)
            if have == L + 1:
                out.append([])
            elif have + k == L + 1:
                out.append(row[:k])
            elif _is_finished(req):  # its row is inert (``_finished_rows``)
                out.append([])
            else:
                raise RuntimeError(f"TREE_V4: request {req.rid} has {have} tokens (+{k} from the previous round) "
                                   f"for a committed length of {L}")
        return out

    def _score_temperatures(self, batch) -> float | torch.Tensor:
        info = batch.sampling_info
        if info.is_all_greedy:
            return self.score_temperature
        return request_score_temperatures(self.score_temperature, info.temperatures.flatten(), info.top_ks)

    def _block_slots(self, batch, D: int, finished: list[int]) -> torch.Tensor:
        """``[B, D]``: each request's slots of positions ``L .. L + D - 1`` (the verify block's; finished rows on
        slot 0), read from its row of the request table without copying the whole row."""
        rows = batch.req_pool_indices.long()[:, None]
        cols = batch.seq_lens.long()[:, None] + torch.arange(D, device=self.device)
        return _inert(self.req_to_token_pool.req_to_token[rows, cols], finished)

    def _verify_input(self, batch, tree, finished: list[int]) -> torch.Tensor:
        """The batch set up for the verify forward; -> the block's slots ``[B, D]`` (the commits' too)."""
        D = tree.width
        mask = tree.ancestor_mask().flatten()
        positions = tree.positions(batch.seq_lens.long()).flatten()
        block = self._block_slots(batch, D, finished)
        batch.out_cache_loc = block.flatten().to(torch.int64)
        batch.input_ids = tree.tokens.flatten().to(torch.int64)
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.spec_info = NgramVerifyInput(draft_token=batch.input_ids, custom_mask=mask, positions=positions,
                                           draft_token_num=D)
        return block

    def _accept(self, batch, tree, logits):
        info = batch.sampling_info
        if info.is_all_greedy:
            return verify_greedy(tree, logits)
        params = SamplingParams(temperatures=info.temperatures.flatten().float(), top_ks=info.top_ks.long(),
                                top_ps=info.top_ps.float(), min_ps=info.min_ps.float())
        return verify_sampling(tree, logits, params, coins=self._coins(batch, tree.tokens.shape[1]),
                               fixed_shapes=self.fixed_shapes)

    def _coins(self, batch, width: int) -> VerifyCoins:
        """Random numbers of this verify step. Where SGLang honours per-request seeds (deterministic inference,
        ``sampling_info.sampling_seed`` set), each request draws from (seed, committed length), so a seed reproduces
        its output; otherwise all share the worker's generator, as SGLang's sampler does."""
        seeds = batch.sampling_info.sampling_seed
        if seeds is None:
            return VerifyCoins.draw(len(batch.reqs), width, self.generator, self.device)
        rows = [VerifyCoins.draw(1, width, torch.Generator().manual_seed(int(seed) * 1_000_003 + length))
                for seed, length in zip(seeds.tolist(), batch.seq_lens.tolist(), strict=False)]
        return VerifyCoins(torch.cat([r.accept for r in rows]).to(self.device),
                           torch.cat([r.bonus for r in rows]).to(self.device))

    def _shape(self, batch) -> tuple[int, int]:
        """This step's (D, S): the pinned budget, or the adaptive choice of rank 0 (from each request's tokens still
        to emit, its ``max_new_tokens`` less its output: at most one round's tokens more than it has left under
        overlap scheduling)."""
        if self.policy is None:
            return self.budget.draft_tokens, self.budget.steps
        if self.tp_group.rank_in_group == 0:
            remaining = [(req.sampling_params.max_new_tokens or 1 << 30) - len(req.output_ids) for req in batch.reqs]
            d, s = self.policy.choose(len(batch.reqs), remaining)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("TREE_V4 policy: batch %d, chose D%d S%d; tokens per ms: %s", len(batch.reqs), d, s,
                             self.policy.describe())
        else:
            d, s = NO_SPECULATION
        d, s = self._broadcast_ints([d, s])
        return d, s

    def _decode_round(self, batch, on_publish):
        start = time.perf_counter()
        bs, D_max = len(batch.reqs), self.budget.draft_tokens
        D, S = self._shape(batch)
        pending = self._pending_tokens(batch, batch.seq_lens.tolist())
        rules = SamplingRules.build(batch, pending, self.adapter.model.cfg.vocab_size)
        finished = _finished_rows(batch)
        if S == 0:  # no speculation: the root alone, i.e. one ordinary decode step
            last = [p[-1] if p else req.output_ids[-1] for req, p in zip(batch.reqs, pending, strict=True)]
            roots = torch.tensor(last, device=self.device)
            tree = DraftTree.roots_only(roots)
        else:
            tree = self._draft(batch, D, S, pending, rules, finished)
        D = tree.width
        drafted = time.perf_counter()
        block = self._verify_input(batch, tree, finished)
        result = self._target_worker.forward_batch_generation(batch, is_verify=True)
        verified = time.perf_counter()
        logits_output = result.logits_output
        logits = logits_output.next_token_logits.view(bs, D, -1)
        if rules is not None:  # penalties, min_new_tokens, grammar, logit_bias: each node after its own path
            rules.verify(logits, tree)
        verdict = self._accept(batch, tree, logits)
        if rules is not None:  # a run ends where its grammar terminates, as the scheduler will keep it
            verdict = rules.cut_at_termination(verdict)
        verdict = _root_only(verdict, finished)
        verdict = broadcast_verdict(verdict, self.tp_group)

        accept_index = accept_index_of(verdict.accepted_nodes, D)
        predict = torch.zeros(bs * D, dtype=torch.int64, device=self.device)
        valid = accept_index >= 0
        predict[accept_index[valid]] = verdict.tokens[valid]
        accept_lens = verdict.accept_lens.to(torch.int32)
        if S > 0:  # without speculation the one accepted row (the root's) already sits in its own slot
            move_accept_tokens_to_target_kvcache(batch, accept_index, accept_lens - 1,
                                                 self.token_to_kv_pool_allocator)
            self.adapter.commit_tree_entries(accept_index, block, batch.seq_lens, D)
        if self.dspark is not None:  # the root's and the accepted nodes' stage keys, at their canonical slots
            dspark_drafter.commit_context(self.adapter.model, self.adapter.stores()[1], self.adapter.last_features,
                                          accept_index, block, batch.seq_lens)
        if batch.return_logprob:
            compute_spec_logprobs(batch, logits_output, predict, accept_index=accept_index)
        new_seq_lens = batch.seq_lens + accept_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        batch.forward_mode = ForwardMode.DECODE
        accept_tokens = torch.where(valid, predict[accept_index.clamp(min=0)], 0).to(torch.int32)
        accept_tokens = torch.nn.functional.pad(accept_tokens, (0, D_max - D)).flatten()  # the server's layout
        self._account(bs, (D, S), tree, verdict, (start, drafted, verified))
        return GenerationBatchResult(
            logits_output=logits_output, next_token_ids=accept_tokens, can_run_cuda_graph=False,
            accept_lens=accept_lens, new_seq_lens=new_seq_lens,
            next_draft_input=NgramVerifyInput(draft_token_num=D_max, new_seq_lens=new_seq_lens,
                                              accept_tokens=accept_tokens, accept_lens=accept_lens),
            speculative_num_draft_tokens=D_max)

    def _account(self, bs, shape, tree, verdict, marks) -> None:
        """Counters per shape; for the adaptive budget also this step's acceptance (for every smaller shape) and the
        previous round's time, now that it is known: from its start to this round's start (draft, verify,
        accept/commit, and the scheduler's time after it), into the step-time fit, and all of it but the draft and
        verify into the ``rest`` curve (the startup model has no such term).

        The scheduler's time between two rounds belongs to the first: it processes that round's output (a tree
        round's several tokens per request) before it prepares the next. Charged to the next round, as before, a
        round without speculation after a tree round cost 24.5 against 23.2 ms (median, CPU, ShareGPT batch 16),
        so the baseline looked slower whenever trees ran. Only a round followed at once by one at the same batch
        size is timed: a change of batch size or a prefill in between is not the round's own time."""
        D, S = shape
        key = "none" if S == 0 else f"D{D}_K{self.budget.topk}_S{S}"
        self.shape_counts[key] = self.shape_counts.get(key, 0) + 1
        start, drafted, verified = marks
        end = time.perf_counter()
        previous, self._last_round = self._last_round, (bs, shape, start, verified, end)
        if logger.isEnabledFor(logging.DEBUG):
            gap = start - previous[4] if previous else float("nan")
            logger.debug("TREE_V4 step: batch %d, shape %s, accepted %d, draft %.2f ms, verify %.2f ms, "
                         "accept+commit %.2f ms, scheduler since the last round %.2f ms", bs, key,
                         int(verdict.accept_lens.sum()), 1e3 * (drafted - start), 1e3 * (verified - drafted),
                         1e3 * (end - verified), 1e3 * gap)
        if self.policy is None:
            return
        if S > 0:
            self.policy.learn(tree, verdict.accepted_nodes, verdict.accept_lens, shape)
        if previous is not None:
            p_bs, p_shape, p_start, p_verified, p_end = previous
            if p_bs == bs and start - p_end < 1:
                self.policy.times.observe(bs, p_shape, start - p_start)
                self.policy.times.observe_rest(bs, start - p_verified)


def _is_finished(req) -> bool:
    finished = getattr(req, "finished", None)
    return bool(finished()) if callable(finished) else False


def _finished_rows(batch) -> list[int]:
    """Rows of requests that finished before this round ran (a grammar batch's previous result is processed
    between forming the batch and running it, so a request can finish and free its slots in between). Their
    round is discarded by the scheduler; they must not touch slots they no longer own."""
    return [i for i, req in enumerate(batch.reqs) if _is_finished(req)]


def _check_reserved(req, L: int, D: int) -> None:
    """A round verifies D nodes in the slots of positions ``L .. L + D - 1``, which SGLang must have reserved."""
    if req.kv.kv_allocated_len < L + D:
        raise RuntimeError(f"TREE_V4: fewer reserved KV slots than the verify block needs (request {req.rid}: "
                           f"{req.kv.kv_allocated_len} reserved, {req.kv.kv_committed_len} committed, "
                           f"length {L}, D {D})")


def _inert(table: torch.Tensor, dead: list[int]) -> torch.Tensor:
    """``table`` (rows per request, slot indices) with the ``dead`` rows on slot 0, SGLang's padding slot."""
    if not dead:
        return table
    table = table.clone()
    table[dead] = 0
    return table


def _root_only(verdict, dead: list[int]):
    """The ``dead`` (finished) rows accept nothing (no move, no commit of their rows)."""
    if not dead:
        return verdict
    accepted, tokens, lens = verdict.accepted_nodes.clone(), verdict.tokens.clone(), verdict.accept_lens.clone()
    accepted[dead, 1:] = -1
    tokens[dead, 1:] = -1
    lens[dead] = 1
    return type(verdict)(accepted, tokens, lens)


class _Output:
    """A request's output tokens followed by its ``pending`` ones (``_pending_tokens``), read by position without
    copying the whole output every round."""

    def __init__(self, output, pending: list[int]):
        self.output, self.pending = output, pending

    def __len__(self) -> int:
        return len(self.output) + len(self.pending)

    def __getitem__(self, i: int) -> int:
        return self.slice(len(self) + i, len(self) + i + 1)[0] if i < 0 else self.slice(i, i + 1)[0]

    def slice(self, lo: int, hi: int) -> list[int]:
        n = len(self.output)
        return list(self.output[lo:min(hi, n)]) + self.pending[max(lo - n, 0):max(hi - n, 0)]


def _tokens_between(prompt, output: _Output, lo: int, hi: int) -> list[int]:
    """Tokens at positions ``[lo, hi)`` of prompt + output, without copying the whole history every round."""
    n = len(prompt)
    return list(prompt[lo:min(hi, n)]) + output.slice(max(lo - n, 0), max(hi - n, 0))
