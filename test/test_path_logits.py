"""Per-node logits processing (``tree.path_logits``) against SGLang's own sampler processing of the same sequence.

The oracle is SGLang 0.5.23's code itself: its four penalizers fed the request's output one token at a time (as its
scheduler does once per decode step), ``SamplingBatchInfo.update_penalties`` and ``apply_logits_bias`` in the forward
copy's mode, on the node's raw logits. Every node of random trees at a tiny vocabulary (tokens repeating along paths
and between the committed output and the paths, siblings sharing tokens) must match bit for bit. Negative control:
the relaxed form (penalties from the committed output only, upstream EAGLE's) must not.
"""

from __future__ import annotations

import types

import pytest
import torch
from sglang.srt.sampling import penaltylib
from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams as SGLangParams

from sglang_tree_v4.tree import DraftTree
from sglang_tree_v4.tree.path_logits import (
    PenaltyState,
    process_path_logits,
    scale_in_place,
    tree_paths,
)

VOCAB = 12
EOS = 11
PENALIZERS = {penaltylib.BatchedFrequencyPenalizer, penaltylib.BatchedMinNewTokensPenalizer,
              penaltylib.BatchedPresencePenalizer, penaltylib.BatchedRepetitionPenalizer}


class _Batch:
    """What the penalizers read of a schedule batch (weak-referenceable, unlike a SimpleNamespace)."""

    def __init__(self, reqs, device="cpu"):
        self.reqs, self.device = reqs, device


def _request(params: dict):
    sp = SGLangParams(**params)
    tokenizer = types.SimpleNamespace(additional_stop_token_ids=None, eos_token_id=EOS)
    return types.SimpleNamespace(sampling_params=sp, eos_token_ids={EOS}, tokenizer=tokenizer)


def sglang_processed(raw: torch.Tensor, output: list[int], params: dict, bias: torch.Tensor | None) -> torch.Tensor:
    """SGLang's processed logits of one request whose output so far is ``output`` (its last token is the input)."""
    batch = _Batch([_request(params)])
    orchestrator = penaltylib.BatchedPenalizerOrchestrator(vocab_size=VOCAB, batch=batch, penalizers=PENALIZERS)
    for t in output:  # one cumulation per decode step, the step's input token
        orchestrator.cumulate_output_tokens(torch.tensor([t]))
    info = types.SimpleNamespace(penalizer_orchestrator=orchestrator, temperatures=torch.ones(1, 1), vocab_size=VOCAB,
                                 acc_additive_penalties=None, acc_scaling_penalties=None, grammar_mask=None,
                                 logit_bias=bias)
    SamplingBatchInfo.update_penalties(info)
    info.penalizer_orchestrator = None  # the forward copy (``copy_for_forward``)
    for name in ("_apply_pre_grammar_logits_transforms", "_apply_post_grammar_logits_transforms"):
        setattr(info, name, types.MethodType(getattr(SamplingBatchInfo, name), info))
    logits = raw.clone()[None]
    SamplingBatchInfo.apply_logits_bias(info, logits)
    return logits[0]


def random_tree(gen: torch.Generator, width: int) -> DraftTree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, width)]
    tokens = torch.randint(0, VOCAB, (1, width), generator=gen)
    if width > 3:
        tokens[0, 3] = tokens[0, 2]  # a repeated token (sibling or on a path)
    return DraftTree.from_parents(tokens, torch.tensor([parents]))


CASES = [
    dict(frequency_penalty=0.8, max_new_tokens=64),
    dict(presence_penalty=0.8, max_new_tokens=64),
    dict(repetition_penalty=1.3, max_new_tokens=64),
    dict(frequency_penalty=-0.7, presence_penalty=1.1, repetition_penalty=0.6, max_new_tokens=64),
    dict(min_new_tokens=7, max_new_tokens=64),
    dict(frequency_penalty=1.9, repetition_penalty=1.7, min_new_tokens=6, stop_token_ids=[3], max_new_tokens=64),
    dict(temperature=0.0, presence_penalty=-1.3, max_new_tokens=64),
]


def _state(outputs: list[list[int]], cases: list[dict], bias: torch.Tensor | None) -> PenaltyState:
    reqs = [_request(c) for c in cases]
    stops = [set(r.sampling_params.stop_token_ids or ()) | {EOS} for r in reqs]
    return PenaltyState.from_outputs(
        outputs, VOCAB, frequency=[r.sampling_params.frequency_penalty for r in reqs],
        presence=[r.sampling_params.presence_penalty for r in reqs],
        repetition=[r.sampling_params.repetition_penalty for r in reqs],
        min_new_tokens=[r.sampling_params.min_new_tokens for r in reqs], stop_tokens=stops, logit_bias=bias)


def _batch(seed: int, width: int = 7):
    """A batch of one request per case: committed outputs of 1-6 tokens, random trees, raw logits, a bias row for
    some requests."""
    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(gen, width) for _ in CASES]
    outputs = [torch.randint(0, VOCAB, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist()
               for _ in CASES]
    for out, tree in zip(outputs, trees, strict=False):
        tree.tokens[0, 0] = out[-1]  # the root is the last committed token
    raw = torch.randn(len(CASES), width, VOCAB, generator=gen) * 3
    bias = torch.zeros(len(CASES), VOCAB)
    bias[::2, 5] = -100.0
    bias[1::3, 2] = 4.5
    tokens = torch.cat([t.tokens for t in trees])
    tree = DraftTree.from_parents(tokens, torch.cat([t.parents for t in trees]))
    return tree, outputs, raw, bias


def _node_outputs(tree: DraftTree, outputs: list[list[int]]) -> list[list[list[int]]]:
    path = tree.path_nodes(tree.width - 1)
    return [[outputs[b] + [int(tree.tokens[b, j]) for j in path[b, i].tolist()[1:] if j >= 0]
             for i in range(tree.width)] for b in range(tree.batch_size)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("scale", [scale_in_place, apply_scaling_penalties], ids=["torch", "sglang"])
def test_every_node_equals_sglang_after_its_path(seed, scale):
    tree, outputs, raw, bias = _batch(seed)
    paths, valid = tree_paths(tree.tokens, tree.ancestor_mask(), tree.depths)
    got = process_path_logits(raw.clone(), paths, valid, _state(outputs, CASES, bias), scale=scale)
    for b, nodes in enumerate(_node_outputs(tree, outputs)):
        for i, seq in enumerate(nodes):
            want = sglang_processed(raw[b, i], seq, CASES[b], bias[b])
            assert torch.equal(got[b, i], want), (seed, b, i, CASES[b], seq)


def test_min_new_tokens_boundary_inside_the_tree():
    """A node at output length min_new_tokens - 1 holds EOS back, its child does not (exact per depth)."""
    tree = DraftTree.from_parents(torch.tensor([[4, 5, 6, 7]]), torch.tensor([[-1, 0, 1, 2]]))
    raw = torch.zeros(1, 4, VOCAB)
    state = _state([[1, 2, 4]], [dict(min_new_tokens=5, max_new_tokens=64)], None)
    paths, valid = tree_paths(tree.tokens, tree.ancestor_mask(), tree.depths)
    got = process_path_logits(raw, paths, valid, state)
    assert got[0, :, EOS].tolist() == [float("-inf"), float("-inf"), 0.0, 0.0]


def test_relaxed_penalties_differ():
    """Negative control: penalties from the committed output alone (every path column invalid) miss nodes."""
    mismatched = 0
    for seed in range(6):
        tree, outputs, raw, bias = _batch(seed)
        paths, valid = tree_paths(tree.tokens, tree.ancestor_mask(), tree.depths)
        relaxed = process_path_logits(raw.clone(), paths, torch.zeros_like(valid), _state(outputs, CASES, bias))
        for b, nodes in enumerate(_node_outputs(tree, outputs)):
            for i, seq in enumerate(nodes):
                mismatched += not torch.equal(relaxed[b, i], sglang_processed(raw[b, i], seq, CASES[b], bias[b]))
    assert mismatched > 20


def test_draft_paths_equal_tree_paths():
    """The drafter's form (paths as explicit token lists, all valid) gives the tree form's logits."""
    tree, outputs, raw, bias = _batch(3)
    paths, valid = tree_paths(tree.tokens, tree.ancestor_mask(), tree.depths)
    state = _state(outputs, CASES, bias)
    want = process_path_logits(raw.clone(), paths, valid, state)
    node_paths = tree.path_nodes(tree.width - 1)[:, :, 1:]
    tokens = tree.tokens.gather(1, node_paths.clamp(min=0).flatten(1)).view_as(node_paths)
    got = process_path_logits(raw.clone(), tokens, node_paths >= 0, state)
    assert torch.equal(got, want)


def test_runs_on_meta_without_host_reads():
    """Fixed shapes: the processing of a [64, 8, 129280] verify block runs on the meta device (no host read)."""
    B, D, V = 64, 8, 129280
    meta = torch.device("meta")
    state = PenaltyState(
        frequency=torch.empty(B, device=meta), presence=torch.empty(B, device=meta),
        repetition=torch.empty(B, device=meta), frequency_sums=torch.empty(B, V, device=meta),
        present=torch.empty(B, V, dtype=torch.bool, device=meta), output_lens=torch.empty(B, dtype=torch.long,
                                                                                           device=meta),
        min_new_tokens=torch.empty(B, dtype=torch.long, device=meta),
        stop_tokens=torch.empty(B, V, dtype=torch.bool, device=meta), logit_bias=torch.empty(B, V, device=meta),
        uses=frozenset({"additive", "scaling", "min_new", "bias"}))
    tokens = torch.empty(B, D, dtype=torch.long, device=meta)
    out = process_path_logits(torch.empty(B, D, V, device=meta), tokens[:, None, :].expand(B, D, D),
                              torch.empty(B, D, D, dtype=torch.bool, device=meta), state)
    assert out.shape == (B, D, V) and out.device.type == "meta"
