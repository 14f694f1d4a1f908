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

from .norm import rms


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Column-normalise, then ``iters - 1`` rounds of row + column normalisation (each sum offset by eps).
    In place when no gradient is needed: at decode sizes these ~60 tiny ops are pure dispatch overhead."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    if torch.is_grad_enabled() and comb.requires_grad:
        for _ in range(iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + eps)
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
        return comb
    e = torch.full((), eps, dtype=comb.dtype, device=comb.device)  # a tensor: no per-op scalar wrapping
    for _ in range(iters - 1):
        comb.div_(comb.sum(-1, keepdim=True).add_(e))
        comb.div_(comb.sum(-2, keepdim=True).add_(e))
    return comb


class HyperConnection(nn.Module):
    """Parameters as DeepSeek names them at block level: ``hc_{attn,ffn}_{fn,base,scale}``; this module holds one
    such triple (``fn``, ``base``, ``scale``)."""

    def __init__(self, hc: int, dim: int, iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.hc, self.iters, self.eps, self.norm_eps = hc, iters, eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + hc) * hc, hc * dim))
        self.base = nn.Parameter(torch.zeros((2 + hc) * hc))
        self.scale = nn.Parameter(torch.ones(3))

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [N, hc, D] -> (collapsed [N, D], post [N, hc], comb [N, hc, hc])."""
        hc = self.hc
        mix = rms(streams.flatten(1).float(), self.norm_eps) @ self.fn.float().t()
        pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([hc, hc, hc * hc])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * s_comb + comb_b.view(hc, hc), dim=-1) + self.eps
        comb = sinkhorn(comb, self.iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)
        return collapsed, post, comb

    @staticmethod
    def post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        dt = streams.dtype
        return post.to(dt).unsqueeze(-1) * out.unsqueeze(1) + comb.to(dt).transpose(1, 2) @ streams


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
