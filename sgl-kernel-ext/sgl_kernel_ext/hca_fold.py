"""The HCA compressor's running-state folds as one op: ``hca_fold``.

Contract
--------
hca_fold(v[N, d], s[N, d], start[N], hit[N], query[N], stored[N, 2d], sweeps) -> [N, 2d] float32 ``[o | lse]``:
every query's state after ``sweeps`` Jacobi sweeps, each folding every query's row ``(v, s)`` onto the state of its
predecessor as the previous sweep left it -- ``state[query[n]]`` where ``hit[n]`` (the predecessor is a query of
this forward), else ``stored[n]``; a block's first position (``start``) takes its row alone:

    lse' = logaddexp(lse, s),    o' = o * exp(lse - lse') + v * exp(s - lse')

The sweeps start from ``(v, s)``. With ``sweeps`` at least the longest chain of queries inside one block, every
state is the one-by-one fold (``dsv4.hca_compressor``). fp32 throughout. The paths agree up to the GPU's exp and log.

Why one op: in torch each sweep is ~7 launches over ``[N, d]`` tensors, and a draft tree needs D sweeps per HCA
layer; the kernel keeps each program's channels for all queries and sweeps in one launch (two scratch copies of
the state, which stay in L2).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import traffic
from .ops import _backend, plain_reference


def hca_fold_ref(v: torch.Tensor, s: torch.Tensor, start: torch.Tensor, hit: torch.Tensor, query: torch.Tensor,
                 stored: torch.Tensor, sweeps: int) -> torch.Tensor:
    d = v.shape[1]
    stored_o, stored_lse = stored[:, :d], stored[:, d:]
    first = start[:, None]
    o, lse = v, s
    for _ in range(sweeps):
        prev_o = torch.where(hit[:, None], o[query], stored_o)
        prev_lse = torch.where(hit[:, None], lse[query], stored_lse)
        new_lse = torch.logaddexp(prev_lse, s)
        new_o = prev_o * torch.exp(prev_lse - new_lse) + v * torch.exp(s - new_lse)
        o, lse = torch.where(first, v, new_o), torch.where(first, s, new_lse)
    return torch.cat([o, lse], dim=1)


@torch.library.custom_op("sgl_kernel_ext::hca_fold", mutates_args=())
def _hca_fold_op(v: torch.Tensor, s: torch.Tensor, start: torch.Tensor, hit: torch.Tensor, query: torch.Tensor,
                 stored: torch.Tensor, sweeps: int, backend: Optional[str] = None) -> torch.Tensor:
    if _backend(backend, v) == "torch":
        return hca_fold_ref(v, s, start, hit, query, stored, sweeps)
    from .triton_hca_fold import hca_fold_triton

    return hca_fold_triton(v, s, start, hit, query, stored, sweeps)


@_hca_fold_op.register_fake
def _(v, s, start, hit, query, stored, sweeps, backend=None):
    return v.new_empty(v.shape[0], 2 * v.shape[1])


@traffic.declare("sgl_kernel_ext::hca_fold")
def hca_fold_traffic(v, s, start, hit, query, stored, sweeps, backend=None) -> traffic.Traffic:
    """Inputs read once, the states written once, and per sweep the previous states read and the new ones written
    (the scratch round trips); one launch."""
    state = v.shape[0] * 2 * v.shape[1] * 4
    read = sum(traffic.nbytes(t) for t in (v, s, start, hit, query, stored)) + sweeps * state
    return traffic.Traffic(read, state + sweeps * state, 1)


def hca_fold(v: torch.Tensor, s: torch.Tensor, start: torch.Tensor, hit: torch.Tensor, query: torch.Tensor,
             stored: torch.Tensor, sweeps: int, *, backend: str | None = None) -> torch.Tensor:
    """The states ``[o | lse]`` of every query (see the module doc)."""
    n, d = v.shape
    if s.shape != (n, d) or stored.shape != (n, 2 * d) or start.shape != (n,) or hit.shape != (n,) \
            or query.shape != (n,):
        raise ValueError(f"hca_fold: v, s [N, d], start, hit, query [N], stored [N, 2d] expected, got "
                         f"{tuple(v.shape)}, {tuple(s.shape)}, {tuple(start.shape)}, {tuple(hit.shape)}, "
                         f"{tuple(query.shape)}, {tuple(stored.shape)}")
    if plain_reference(backend, v, s, stored):
        return hca_fold_ref(v, s, start, hit, query, stored, int(sweeps))
    return torch.ops.sgl_kernel_ext.hca_fold(v, s, start, hit, query, stored, int(sweeps), backend)
