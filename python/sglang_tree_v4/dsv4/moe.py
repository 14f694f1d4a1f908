"""Mixture of experts: routed experts (top-k by score, or by a frozen token->expert table in hash layers) plus
shared expert(s); SwiGLU with clamped pre-activations (gate <= limit, |up| <= limit).

Routing: ``s = score_fn(x W_g^T)`` (sqrt(softplus) for V4); experts chosen by ``topk(s + bias)`` (the bias only
steers the choice) or ``tid2eid[token]``; weights ``s[chosen]`` normalised to sum 1, times
``routed_scaling_factor``. Per token, no cross-token state.
"""
from __future__ import annotations

import torch
from torch import nn

from sgl_kernel_ext.moe_route import moe_route
from sgl_kernel_ext.routed_experts import routed_experts
from sgl_kernel_ext.swiglu import swiglu_op

from .config import DSV4Config


class MLP(nn.Module):
    """Dense SwiGLU (the shared expert): ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)
        self.limit = limit
        self.w13: nn.Module | None = None  # w1 and w3 as one matmul, set by ``checkpoint.fuse``

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is not None:
            gate, up = self.w13(x).split(self.w13.widths, -1)
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(swiglu_op(gate, up, self.limit))


class Gate(nn.Module):
    def __init__(self, cfg: DSV4Config, hashed: bool):
        super().__init__()
        self.hashed, self.k = hashed, cfg.num_experts_per_tok
        self.scoring, self.scaling = cfg.scoring_func, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.k, dtype=torch.long))
        else:
            self.register_buffer("bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [n, k], weights [n, k]): ``sgl_kernel_ext.moe_route``, one kernel on a GPU."""
        if self.hashed:
            return moe_route(x, self.weight, None, self.k, self.scaling, self.scoring, self.tid2eid[input_ids])
        return moe_route(x, self.weight, self.bias, self.k, self.scaling, self.scoring)


class Experts(nn.Module):
    """Routed experts stacked: ``w1, w3 [E, I, D]``, ``w2 [E, D, I]``. ``expert(e)`` gives one expert's float
    weights; a quantized subclass (``quantized_modules.FP4Experts``) keeps them packed and hands them to the kernel
    through ``kernel_weights``. Under expert parallelism a rank holds experts ``first .. first + E - 1`` of the
    model's and adds only their share of each token (the ranks' shares are summed by an all-reduce, see ``tp``).
    The forward is ``sgl_kernel_ext.routed_experts``: it reads only the experts some token is routed to (a Triton
    kernel on CUDA, fixed shapes; on the CPU a loop over the routed experts), and its fake keeps meta working."""

    def __init__(self, n: int, dim: int, inter: int, limit: float, first: int = 0):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(n, inter, dim))
        self.w2 = nn.Parameter(torch.zeros(n, dim, inter))
        self.w3 = nn.Parameter(torch.zeros(n, inter, dim))
        self.limit, self.first = limit, first

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1 [I, D], w3 [I, D], w2 [D, I]) of local expert ``e``."""
        return self.w1[e], self.w3[e], self.w2[e]

    def kernel_weights(self) -> tuple:
        """(format, w1, w3, w2, s1, s3, s2) as ``routed_experts`` takes them; a quantized subclass returns its own."""
        return "dense", self.w1, self.w3, self.w2, None, None, None

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        fmt, w1, w3, w2, s1, s3, s2 = self.kernel_weights()
        return routed_experts(x, idx, w, self.first, fmt, w1, w3, w2, s1, s3, s2, self.limit)


class MoE(nn.Module):
    def __init__(self, cfg: DSV4Config, hashed: bool):
        super().__init__()
        self.gate = Gate(cfg, hashed)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                  cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        idx, w = self.gate(x, input_ids)
        return self.experts(x, idx, w) + self.shared_experts(x)
