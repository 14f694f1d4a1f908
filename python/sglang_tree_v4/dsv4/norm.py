"""RMSNorm, weighted and unweighted (V4 uses both: learned norms on q_lora/kv/blocks; a bare one per q head and
inside the hyper-connection projections)."""
from __future__ import annotations

import torch
from torch import nn


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms(x, self.eps)
