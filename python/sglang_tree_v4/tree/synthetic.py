"""Synthetic drafters for tests and benchmarks: cheap, deterministic stand-ins for a draft model."""

from __future__ import annotations

import math

import torch

from .drafter import DraftStep


class PathHashDrafter:
    """A drafter whose logits depend only on the tokens of the path root..node, like a real language model.

    The hidden state is a scalar hash of the path (updated from the parent's hash and the node's token), and the
    logits are a fixed pseudo-random function of that hash. Calling it on the same path always gives the same
    logits, whatever else is in the batch, so a simple per-node reference can replay it.
    """

    def __init__(self, vocab: int, seed: int = 0, sharpness: float = 4.0, device: torch.device | str = "cpu"):
        gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.freq = (torch.rand(vocab, generator=gen, dtype=torch.float64) * 997 + 3).to(device)
        self.phase = torch.rand(vocab, generator=gen, dtype=torch.float64).to(device)
        self.sharpness = sharpness

    def root_hidden(self, root_tokens: torch.Tensor) -> torch.Tensor:
        """``[B, 1]`` a root ``parent_hidden`` derived from the root token (stands in for the target's state)."""
        return (root_tokens.double()[:, None] * 0.1372) % 1.0

    def __call__(self, step: DraftStep) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = (step.parent_hidden * 7.31 * (1 + math.sqrt(5)) / 2 + step.tokens.double()[..., None] * 0.7548776662
                  + 0.2113) % 1.0
        angle = 2 * math.pi * (hidden * self.freq + self.phase)
        logits = (self.sharpness * torch.sin(angle)).float()
        return logits, hidden


class FixedLogitsDrafter:
    """Returns the same pre-drawn logits at every step (for timing the tree core without a model)."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits  # [B, n_max, V]

    def __call__(self, step: DraftStep) -> tuple[torch.Tensor, torch.Tensor]:
        n = step.tokens.shape[1]
        return self.logits[:, :n], step.parent_hidden


def random_parents(batch: int, width: int, shape: str, generator: torch.Generator, arity: int = 2) -> torch.Tensor:
    """``[B, D]`` parent indices of a tree shape in topological (breadth-first for the regular ones) order.

    ``shape``: ``"chain"``, ``"star"`` (all nodes children of the root), ``"kary"`` (full ``arity``-ary tree) or
    ``"random"`` (each node's parent uniform among the earlier nodes).
    """
    idx = torch.arange(width)
    if shape == "chain":
        parents = idx - 1
    elif shape == "star":
        parents = torch.where(idx > 0, 0, -1)
    elif shape == "kary":
        parents = torch.where(idx > 0, (idx - 1) // arity, -1)
    elif shape == "random":
        draws = torch.rand(batch, width, generator=generator)
        parents = (draws * idx).long()
        parents[:, 0] = -1
        return parents
    else:
        raise ValueError(f"unknown tree shape {shape!r}")
    return parents.expand(batch, width).clone()


def distinct_tokens(batch: int, width: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """``[B, D]`` tokens, all different within a request (so siblings never share a token); needs vocab >= D."""
    return torch.rand(batch, vocab, generator=generator).argsort(-1)[:, :width]
