"""Manifold-constrained hyper-connections (mHC).

The residual stream is ``hc_mult`` parallel streams ``[N, hc, D]``. Around each sub-block (attention, MoE) a small
projection of the flattened, RMS-normalised streams gives three things per token:

* ``pre``  [hc]     -- sigmoid weights collapsing the streams into the sub-block's input,
* ``post`` [hc]     -- 2*sigmoid weights spreading the sub-block's output back over the streams,
* ``comb`` [hc, hc] -- a mixing matrix for the residual, pushed towards doubly stochastic by Sinkhorn iterations
  (rows and columns summing to 1 keeps the residual norm from growing with depth).

New streams = ``post (x) out + comb^T @ streams``. Purely per token: no state crosses tokens.
"""
from __future__ import annotations

import torch
from torch import nn

from sgl_kernel_ext.hyper_connection import hc_post, hc_pre

from .norm import RMSNorm, rms


class HyperConnection(nn.Module):
    """Parameters as DeepSeek names them at block level: ``hc_{attn,ffn}_{fn,base,scale}``; this module holds one
    such triple (``fn``, ``base``, ``scale``). The math is ``sgl_kernel_ext.hyper_connection``'s (one kernel each for
    pre and post on a GPU)."""

    def __init__(self, hc: int, dim: int, iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.hc, self.iters, self.eps, self.norm_eps = hc, iters, eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + hc) * hc, hc * dim))
        self.base = nn.Parameter(torch.zeros((2 + hc) * hc))
        self.scale = nn.Parameter(torch.ones(3))

    def pre(self, streams: torch.Tensor, norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
        """streams [N, hc, D] -> (collapsed [N, D], post [N, hc], comb [N, hc, hc]); with the sub-block's input
        ``norm``, the collapse normalised by it in the same op (one launch for both on a GPU)."""
        if norm is None:
            return hc_pre(streams, self.fn, self.base, self.scale, self.iters, self.eps, self.norm_eps)
        return hc_pre(streams, self.fn, self.base, self.scale, self.iters, self.eps, self.norm_eps,
                      out_weight=norm.weight, out_eps=norm.eps)

    @staticmethod
    def post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return hc_post(out, streams, post, comb)


class HyperHead(nn.Module):
    """Final collapse of the streams to one vector (sigmoid weights, no Sinkhorn): ``hc_head_{fn,base,scale}``."""

    def __init__(self, hc: int, dim: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = nn.Parameter(torch.zeros(hc, hc * dim))
        self.base = nn.Parameter(torch.zeros(hc))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mix = rms(streams.flatten(1).float(), self.norm_eps) @ self.fn.float().t()
        pre = torch.sigmoid(mix * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)
