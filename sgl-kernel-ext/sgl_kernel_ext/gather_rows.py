"""Reading a pool's rows as one op (one launch on a GPU instead of five): ``gather_rows(buf, rows, off, width)``.

Contract
--------
gather_rows(buf[R, C], rows[...] int, off, width) -> [..., width] in buf's dtype: ``buf[rows, off:off + width]``,
zeros where ``rows < 0`` (no row). Only the listed rows' ``width`` columns are read.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import traffic
from .ops import _backend, plain_reference


def gather_rows_ref(buf: torch.Tensor, rows: torch.Tensor, off: int, width: int) -> torch.Tensor:
    got = buf[rows.clamp(min=0).reshape(-1), off:off + width].reshape(*rows.shape, width)
    return torch.where((rows >= 0).unsqueeze(-1), got, torch.zeros((), dtype=got.dtype, device=got.device))


@torch.library.custom_op("sgl_kernel_ext::gather_rows", mutates_args=())
def _gather_rows_op(buf: torch.Tensor, rows: torch.Tensor, off: int, width: int,
                    backend: Optional[str] = None) -> torch.Tensor:
    if _backend(backend, buf) == "torch":
        return gather_rows_ref(buf, rows, off, width)
    from .triton_gather_rows import gather_rows_triton

    return gather_rows_triton(buf, rows, off, width)


@_gather_rows_op.register_fake
def _(buf, rows, off, width, backend=None):
    return buf.new_empty(*rows.shape, width)


@traffic.declare("sgl_kernel_ext::gather_rows")
def gather_rows_traffic(buf, rows, off, width, backend=None) -> traffic.Traffic:
    """The row list and each listed row's ``width`` columns read, the result written; one launch."""
    out = math.prod(rows.shape) * width * buf.element_size()
    return traffic.Traffic(traffic.nbytes(rows) + out, out, 1, ((0, out),))


def gather_rows(buf: torch.Tensor, rows: torch.Tensor, off: int, width: int, *,
                backend: str | None = None) -> torch.Tensor:
    """Rows of a pool's column range (see the module doc)."""
    if buf.dim() != 2 or not 0 <= off <= off + width <= buf.shape[1]:
        raise ValueError(f"buf must be [R, C] with columns {off}..{off + width} inside, got {tuple(buf.shape)}")
    if rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be int32 or int64, got {rows.dtype}")
    if plain_reference(backend, buf):
        return gather_rows_ref(buf, rows, off, width)
    return torch.ops.sgl_kernel_ext.gather_rows(buf, rows, int(off), int(width), backend)
