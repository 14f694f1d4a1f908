"""Greedy verification: accept the longest draft path the target's argmax agrees with, then the target's argmax.

This is exactly what greedy decoding of the target would emit: a draft node is accepted iff every token on its
path equals the argmax of the target logits at that token's parent.
"""

from __future__ import annotations

import torch

from .draft_tree import DraftTree
from .verify_result import VerifyResult


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> VerifyResult:
    """Greedy verify of a batch: ``target_logits [B, D, V]`` are the target's logits at every tree node.

    Among equally deep agreeing paths (possible only if siblings share a token) the lowest node index wins.
    """
    return verify_greedy_from_argmax(tree, target_logits.argmax(-1))


def verify_greedy_from_argmax(tree: DraftTree, target_argmax: torch.Tensor) -> VerifyResult:
    """Same as :func:`verify_greedy` from the target's ``[B, D]`` argmax tokens (when only those are at hand)."""
    width = tree.width
    if width == 1:  # one-node trees (no speculation): the root is accepted and its argmax is the token
        root = torch.zeros(tree.batch_size, 1, dtype=torch.long, device=tree.device)
        return VerifyResult(root, target_argmax[:, :1].long(), torch.ones(tree.batch_size, dtype=torch.long,
                                                                           device=tree.device))
    valid = tree.valid_mask()
    expected = target_argmax.gather(1, tree.parents.clamp(min=0))
    agrees = (tree.tokens == expected) & valid
    agrees[:, 0] = True
    # A node is acceptable when no node on its path (ancestors or itself) disagrees.
    acceptable = ~(tree.ancestor_mask() & ~agrees[:, None, :]).any(-1) & valid
    idx = torch.arange(width, device=tree.device)
    key = torch.where(acceptable, tree.depths * width + (width - 1 - idx), -1)
    last = key.argmax(-1)
    bonus = target_argmax.gather(1, last[:, None]).squeeze(1)
    return VerifyResult.from_last_node(tree, last, bonus)
