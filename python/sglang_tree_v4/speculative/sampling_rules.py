"""A round's logits processing for every sampling parameter SGLang's sampler honours, per tree node.

Plain decoding processes a request's logits with its penalties (repetition, frequency, presence), ``min_new_tokens``,
its grammar's vocabulary mask and ``logit_bias`` (``SamplingBatchInfo.apply_logits_bias``) before temperature,
top-k/top-p/min-p. ``SamplingRules`` does the same for each tree node after that node's own path
(``tree.path_logits``): on the verified logits, so acceptance (greedy or stochastic) and returned logprobs see
exactly plain decoding's distribution, and on the drafter's logits, so drafts are tokens the target can accept
(a grammar's forbidden token, a banned ``logit_bias`` token or an early EOS is never drafted).

What cannot be served exactly is refused before it reaches a round (``refusal``): a custom logit processor and a
returned sampling mask (per request, a 400 naming the field), the watermark (at startup).
"""

from __future__ import annotations

import torch

from ..tree import DraftTree, VerifyResult
from ..tree.path_logits import PenaltyState, process_path_logits, tree_paths
from .grammar_paths import GrammarPaths, grammar_paths


def _sglang_scaling():
    """SGLang's own (compiled) repetition scaling, so the float arithmetic is the sampler's."""
    from sglang.srt.sampling.penaltylib.repetition_penalty import (
        apply_scaling_penalties,
    )

    return apply_scaling_penalties


def stop_token_ids(req) -> set[int]:
    """The tokens ``min_new_tokens`` holds back for ``req``: what SGLang's min-new-tokens penalizer masks (the
    request's stop token ids, its EOS ids, the tokenizer's additional stop ids and its EOS id)."""
    tokenizer = getattr(req, "tokenizer", None)
    ids = set(req.sampling_params.stop_token_ids or ()) | set(req.eos_token_ids or ())
    if tokenizer is not None:
        ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.add(tokenizer.eos_token_id)
    return {int(t) for t in ids if t is not None}


def _needs_penalties(params) -> bool:
    return (params.frequency_penalty != 0 or params.presence_penalty != 0 or params.repetition_penalty != 1
            or params.min_new_tokens > 0)


class SamplingRules:
    """One round's processing: the batch's penalty state after its committed outputs, and its grammars."""

    def __init__(self, penalties: PenaltyState | None, grammars: GrammarPaths | None):
        self.penalties = penalties
        self.grammars = grammars
        self.scale = _sglang_scaling()

    @classmethod
    def build(cls, batch, pending: list[list[int]], vocab: int) -> "SamplingRules | None":
        """From the batch's requests (``pending``: each one's committed tokens not yet in ``output_ids``); None
        where no request uses anything beyond temperature / top-k / top-p / min-p."""
        reqs = batch.reqs
        info = batch.sampling_info
        bias = getattr(info, "logit_bias", None)
        penalties = None
        if bias is not None or any(_needs_penalties(r.sampling_params) for r in reqs):
            outputs = [list(r.output_ids) + list(p) if _needs_penalties(r.sampling_params) else []
                       for r, p in zip(reqs, pending, strict=False)]
            lens = [len(r.output_ids) + len(p) for r, p in zip(reqs, pending, strict=False)]
            params = [r.sampling_params for r in reqs]
            penalties = PenaltyState.from_outputs(
                outputs, vocab, frequency=[p.frequency_penalty for p in params],
                presence=[p.presence_penalty for p in params], repetition=[p.repetition_penalty for p in params],
                min_new_tokens=[p.min_new_tokens for p in params],
                stop_tokens=[stop_token_ids(r) if r.sampling_params.min_new_tokens > 0 else set() for r in reqs],
                logit_bias=None if bias is None else bias[:, :vocab], output_lens=lens, device=batch.seq_lens.device)
        grammars = grammar_paths(reqs, pending, getattr(info, "vocab_size", vocab))
        if penalties is None and grammars is None:
            return None
        return cls(penalties, grammars)

    def process(self, logits: torch.Tensor, paths: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``logits [B, n, V]`` in place for nodes whose paths below the root are ``paths``/``valid [B, n, P]``."""
        mask = None if self.grammars is None else self.grammars.mask_fn(paths, valid)
        return process_path_logits(logits, paths, valid, self.penalties, mask, self.scale)

    def draft_hook(self, logits: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
        """For ``build_draft_tree``: the drafter's logits processed as the target's will be."""
        logits = logits.float().clone()
        return self.process(logits, paths, torch.ones(paths.shape, dtype=torch.bool, device=paths.device))

    def verify(self, logits: torch.Tensor, tree: DraftTree) -> None:
        """The verified logits ``[B, D, V]`` (a view of the forward's output) processed in place."""
        paths, valid = tree_paths(tree.tokens, tree.ancestor_mask(), tree.depths)
        self.process(logits, paths, valid)

    def cut_at_termination(self, verdict: VerifyResult) -> VerifyResult:
        """Each run cut after the first accepted node whose token terminates the request's grammar (after
        ``verify``). Plain decoding ends the request with that token; SGLang's scheduler keeps exactly that much
        of a speculative run, so the committed length must stop there too (the bonus token after it is dropped)."""
        if self.grammars is None:
            return verdict
        accepted = verdict.accepted_nodes
        width = accepted.shape[1]
        idx = torch.arange(width, device=accepted.device)
        ends = (accepted > 0) & self.grammars.terminal.gather(1, accepted.clamp(min=0))
        first = torch.where(ends.any(-1), ends.int().argmax(-1), width)  # its index j: tokens of nodes 1..j
        lens = torch.minimum(verdict.accept_lens, first)
        keep = idx[None, :] < lens[:, None]
        return VerifyResult(torch.where(keep, accepted, -1), torch.where(keep, verdict.tokens, -1), lens)


def refusal(obj) -> str | None:
    """Why a generate request cannot be served exactly by TREE_V4 (None: it can). Checked by the tokenizer manager
    before the request is scheduled, so the client gets a 400 naming the field."""
    if getattr(obj, "custom_logit_processor", None):
        return ("custom_logit_processor is not supported with --speculative-algorithm TREE_V4 (its output could "
                "differ from plain decoding); serve it without speculation")
    if getattr(obj, "return_sampling_mask", None):
        return "return_sampling_mask is not supported with --speculative-algorithm TREE_V4"
    return None


def check_request(manager, obj, *args, **kwargs):
    """BEFORE hook on ``TokenizerManager._validate_one_request``: a ValueError there becomes the client's 400."""
    spec = getattr(getattr(manager, "server_args", None), "speculative_algorithm", None)
    if spec == "TREE_V4":
        reason = refusal(obj)
        if reason:
            raise ValueError(reason)
    return None
