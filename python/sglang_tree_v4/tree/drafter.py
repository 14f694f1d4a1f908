"""The contract between tree construction and a draft model (synthetic in tests, DeepSeek-V4 MTP in serving).

Construction feeds the drafter one batch of new nodes per draft step. A node that has been fed owns a *draft slot*:
slot 0 is the root, and the ``n`` nodes fed at step ``s >= 1`` get slots ``1 + (s - 1) * n .. s * n`` in the order
they appear in the step. A drafter that keeps per-node state (the MTP layer's KV) stores it by slot; a new node must
attend the committed prefix plus exactly the slots marked in its ``ancestors`` row (its own slot included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class DraftStep:
    """The nodes fed to the drafter in one draft step, ``n`` per request (the same ``n`` for the whole batch).

    Attributes:
        step: 0 for the root, then 1, 2, ... (one per draft forward).
        tokens: ``[B, n]`` int64 token of each new node.
        positions: ``[B, n]`` int64 position of each new node (prefix length + depth).
        slots: ``[B, n]`` int64 draft slot of each new node (see module docstring).
        parent_slots: ``[B, n]`` int64 draft slot of each node's parent (-1 for the root).
        ancestors: ``[B, n, num_slots]`` bool, ``num_slots = slots.max() + 1``: which fed nodes are ancestors of
            each new node, itself included. Slots fed earlier but not on the node's path are False.
        parent_hidden: ``[B, n, *H]`` the hidden state the drafter returned for each node's parent (for the root:
            whatever the caller passed as ``root_parent_hidden``, e.g. the target's last hidden state for MTP).
    """

    step: int
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    parent_slots: torch.Tensor
    ancestors: torch.Tensor
    parent_hidden: torch.Tensor


class Drafter(Protocol):
    """A draft model: for each fed node, logits of its next token and its hidden state.

    Returns ``(logits [B, n, V], hidden [B, n, *H])``. ``hidden[b, i]`` is handed back as ``parent_hidden`` of the
    children of that node in later steps; construction never looks inside it. Logits are raw (temperature 1):
    construction ranks children by ``log_softmax(logits)``.
    """

    def __call__(self, step: DraftStep) -> tuple[torch.Tensor, torch.Tensor]: ...
