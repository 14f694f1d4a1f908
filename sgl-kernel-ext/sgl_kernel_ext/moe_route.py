"""The MoE router as one op (one launch on a GPU instead of about ten): ``moe_route``.

Contract
--------
moe_route(x[N, C], weight[E, C], bias[E] | None, k, scaling, scoring, chosen[N, k] | None)
    -> (idx[N, k] int64, w[N, k] in x's dtype)

``logits = x @ weight^T`` (one rounding to x's dtype, as torch's matmul), ``s = score(logits)`` with ``scoring``
``sqrtsoftplus`` (``sqrt(softplus(l))``, V4's), ``sigmoid`` or ``softmax`` (each elementwise op rounded to x's
dtype, the softmax in fp32 and rounded once); the experts are ``chosen`` where given (a hash layer's table row per
token) and otherwise the top ``k`` of ``s + bias`` (the bias steers the choice only; ties in either order);
``w = s[idx] / (sum(s[idx]) + 1e-20) * scaling``, each step rounded to x's dtype. The kernel computes the logits
with fp32 accumulation in another order, so a rounding of a logit may flip, and with it the order of two nearly
equal scores.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import traffic
from .ops import _backend, plain_reference

SCORINGS = ("sqrtsoftplus", "sigmoid", "softmax")


def score(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits.float(), dim=-1).to(logits.dtype)


def moe_route_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, scaling: float,
                  scoring: str, chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    s = score(x @ weight.t(), scoring)
    if chosen is not None:
        idx = chosen.long()
    else:
        idx = torch.topk(s if bias is None else s + bias, k, dim=-1).indices
    w = s.gather(1, idx)
    return idx, w / (w.sum(-1, keepdim=True) + 1e-20) * scaling


@torch.library.custom_op("sgl_kernel_ext::moe_route", mutates_args=())
def _moe_route_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], k: int, scaling: float,
                  scoring: str, chosen: Optional[torch.Tensor] = None,
                  backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    if _backend(backend, x) == "torch":
        idx, w = moe_route_ref(x, weight, bias, k, scaling, scoring, chosen)
        return idx.contiguous(), w.contiguous()
    from .triton_moe_route import moe_route_triton

    return moe_route_triton(x, weight, bias, k, scaling, scoring, chosen)


@_moe_route_op.register_fake
def _(x, weight, bias, k, scaling, scoring, chosen=None, backend=None):
    return x.new_empty(x.shape[0], k, dtype=torch.long), x.new_empty(x.shape[0], k)


@traffic.declare("sgl_kernel_ext::moe_route")
def moe_route_traffic(x, weight, bias, k, scaling, scoring, chosen=None, backend=None) -> traffic.Traffic:
    """x, the router weight and the bias (or the chosen experts) read once; the experts and their weights written;
    one launch. The weight's tiles are read by every program of BLOCK_M tokens, from L2 after the first."""
    n = x.shape[0]
    read = traffic.nbytes(x) + traffic.nbytes(weight) + traffic.nbytes(bias) + traffic.nbytes(chosen)
    return traffic.Traffic(read, n * k * (8 + x.element_size()), 1)


def moe_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, scaling: float,
              scoring: str = "sqrtsoftplus", chosen: torch.Tensor | None = None, *,
              backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts of each token and their weights (see the module doc)."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [N, C] and weight [E, C], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if chosen is not None and tuple(chosen.shape) != (x.shape[0], k):
        raise ValueError(f"chosen must be [{x.shape[0]}, {k}], got {tuple(chosen.shape)}")
    if not 1 <= k <= weight.shape[0]:
        raise ValueError(f"k must be in [1, {weight.shape[0]}], got {k}")
    if plain_reference(backend, x, weight):
        return moe_route_ref(x, weight, bias, k, scaling, scoring, chosen)
    return torch.ops.sgl_kernel_ext.moe_route(x, weight, bias, int(k), float(scaling), scoring, chosen, backend)
