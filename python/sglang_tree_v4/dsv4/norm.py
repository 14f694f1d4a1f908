"""RMSNorm, weighted and unweighted (V4 uses both: learned norms on q_lora/kv/blocks; a bare one per q head and
inside the hyper-connection projections). The math is ``sgl_kernel_ext.rms_norm``'s (one kernel on a GPU)."""
from __future__ import annotations

import torch
from torch import nn

from sgl_kernel_ext.rms_norm import rms_norm


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, None, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
