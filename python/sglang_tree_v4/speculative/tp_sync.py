"""Tensor parallelism: every rank must commit exactly the same tokens.

Our DeepSeek-V4 is replicated on each tensor-parallel rank, so every rank computes the same tree and logits; but
stochastic verification draws random numbers, and any divergence (a different generator state, a non-deterministic
reduction) would make ranks commit different tokens and corrupt each other's state from then on. So rank 0 decides
and broadcasts its verdict; the other ranks adopt it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..tree import VerifyResult


class Broadcaster(Protocol):
    """SGLang's ``GroupCoordinator`` satisfies this (``world_size``, ``broadcast(tensor, src)``)."""

    world_size: int

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor: ...


def broadcast_verdict(verdict: VerifyResult, group: Broadcaster) -> VerifyResult:
    """Rank 0's verdict on every rank (a no-op for a single rank)."""
    if group.world_size == 1:
        return verdict
    packed = torch.cat([verdict.accepted_nodes.long(), verdict.tokens.long(),
                        verdict.accept_lens.long()[:, None]], dim=1).contiguous()
    packed = group.broadcast(packed, src=0)
    width = verdict.accepted_nodes.shape[1]
    return VerifyResult(packed[:, :width], packed[:, width:2 * width], packed[:, 2 * width])
