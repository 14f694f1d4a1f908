"""One TREE_V4 verify step with fixed shapes and no host synchronisation: target forward over every node of every
tree, acceptance (greedy or stochastic), accepted-path state writes.

Every shape depends only on the batch (B), the tree width (D), the vocabulary and the capacities in ``caps``
(``StepCaps``: how many compressed entries a query may see), never on values: padding nodes are computed and
ignored, block-closing is a mask, acceptance walks D levels for every request. A step that runs on ``meta`` tensors
(which refuse ``item``, ``tolist``, ``bool``, ``nonzero``, ``unique`` and boolean-mask indexing) therefore has no
host sync, which is what a captured CUDA graph needs; ``test_verify_capturable`` runs it so. Results are read on
the host after the step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree import (
    DraftTree,
    SamplingParams,
    VerifyCoins,
    VerifyResult,
    verify_greedy,
    verify_sampling,
)
from .model import DSV4Model
from .storage import SlotStore, StepCaps
from .tree_state import build_verify_batch, commit


@dataclass
class StepOutput:
    logits: torch.Tensor  # [B, D, V] target logits at every node (padding nodes: meaningless)
    streams: torch.Tensor  # [B, D, hc, hidden] the MTP's hidden input at every node
    verdict: VerifyResult  # accepted nodes, emitted tokens, accept lengths


@torch.no_grad()
def verify_step(model: DSV4Model, store: SlotStore, req_table: torch.Tensor, rids: torch.Tensor,
                lens: torch.Tensor, tree: DraftTree, scratch: torch.Tensor, canonical: torch.Tensor,
                caps: StepCaps, params: SamplingParams | None = None,
                coins: VerifyCoins | None = None) -> StepOutput:
    """Verify ``tree`` (B requests, D nodes each) over committed lengths ``lens`` and commit the accepted paths.

    ``scratch [B, D]``: each node's own slot (padding nodes included); ``canonical [B, D]``: the slots positions
    ``lens .. lens + D - 1`` take once accepted (may overlap ``scratch``); ``req_table`` rows ``rids`` are updated.
    ``params`` None: greedy acceptance; otherwise lossless stochastic acceptance with ``coins``.
    """
    B, D = tree.tokens.shape
    vb = build_verify_batch(req_table, rids, lens, tree.tokens, tree.parents, tree.num_nodes, scratch, caps=caps)
    out = model(vb.fb, store)
    logits = out.logits.view(B, D, -1)
    if params is None:
        verdict = verify_greedy(tree, logits)
    else:
        verdict = verify_sampling(tree, logits, params, coins=coins, fixed_shapes=True)
    commit([store], req_table, rids, lens, verdict.accepted_nodes, scratch, canonical)
    return StepOutput(logits, out.streams.view(B, D, *out.streams.shape[1:]), verdict)
