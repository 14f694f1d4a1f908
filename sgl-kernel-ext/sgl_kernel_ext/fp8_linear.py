"""The FP8 block-scaled linear as one op: ``fp8_block_linear(x, weight, scale, offsets)``.

Contract
--------
fp8_block_linear(x[..., K], weight[N, K] float8_e4m3fn, scale[R, C], offsets=(off_r, off_c)) -> [..., N]
    ``y[..., n] = sum_k x[..., k] * W[n, k]`` with ``W[n, k] = fp8[n, k] * scale[(n + off_r) // 128,
    (k + off_c) // 128]``, x upcast to float32, float32 products and float32 accumulation, the result rounded once
    to x's dtype (bf16, fp16 or fp32). ``scale`` is float32, bf16 or fp16, or e8m0 (``float8_e8m0fnu`` or its
    uint8 bytes, ``2^(b - 127)``); it needs at least ``ceil((N + off_r) / 128)`` rows and ``ceil((K + off_c) / 128)``
    columns, and only those are read (any strides). ``offsets`` (each in [0, 128)) place element (0, 0) of a
    tensor-parallel shard inside its first block; (0, 0) for a whole matrix.

    Agreement: for bf16 / fp16 x and power-of-two scales every product ``x * fp8 * scale`` is exact in fp32, so the
    reference and the kernel differ only in the order of the fp32 additions (and, for a half-precision result, in
    which way a value on a rounding boundary goes); for fp32 x or arbitrary float scales also in one rounding per
    product or per partial sum. The tests hold them to fp32 rounding (fp32 x) and to one unit in the last place of
    the output (bf16 / fp16 x).

Backends ("auto" unless the ``backend`` argument or ``SGL_KERNEL_EXT_BACKEND`` says otherwise): the Triton kernel
(``triton_fp8_linear``) on CUDA tensors of a GPU with native FP8 conversions (sm_89+), else the torch reference
``weight_formats.fp8_block_matmul`` (the CPU path: one block of rows dequantised at a time). "triton" on CPU
tensors runs under ``TRITON_INTERPRET=1``.

The op is the custom op ``torch.ops.sgl_kernel_ext.fp8_block_linear`` (opaque to torch.compile and CUDA-graph
safe; its fake gives shapes on the meta device) with a traffic declaration: it reads x, the weight and the scale
blocks the shard touches once each and writes the output once, in one launch (plus one copy of x when its leading
dimensions cannot be flattened without one).
"""
from __future__ import annotations

import functools
import math
import os

import torch

from . import traffic
from .weight_formats import E8M0_DTYPE, FP8_BLOCK, FP8_DTYPE, fp8_block_matmul

_BACKENDS = ("auto", "torch", "triton", "flashinfer")
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SCALE_DTYPES = tuple(d for d in (torch.float32, torch.bfloat16, torch.float16, torch.uint8, E8M0_DTYPE) if d)


def scale_shape(n: int, k: int, offsets: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """The scale blocks an ``[n, k]`` weight at ``offsets`` touches: ``(ceil((n + off_r) / 128), ceil((k + off_c)
    / 128))``."""
    return -(-(n + offsets[0]) // FP8_BLOCK), -(-(k + offsets[1]) // FP8_BLOCK)


@functools.lru_cache(maxsize=None)
def _native_fp8(device_index: int) -> bool:
    """Triton converts e4m3 natively from sm_89 (Ada, Hopper, Blackwell) on; older GPUs take the reference."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _backend(requested: str | None, x: torch.Tensor) -> str:
    choice = requested or os.environ.get("SGL_KERNEL_EXT_BACKEND", "auto")
    if choice not in _BACKENDS:
        raise ValueError(f"unknown backend {choice!r}; expected one of {_BACKENDS}")
    if choice == "auto":
        return "triton" if x.is_cuda and _native_fp8(x.device.index or 0) else "torch"
    return "torch" if choice == "torch" else "triton"


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, off_r: int, off_c: int) -> None:
    if weight.dim() != 2 or weight.dtype != FP8_DTYPE:
        raise ValueError(f"weight must be [N, K] {FP8_DTYPE}, got {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    if x.dim() < 1 or x.shape[-1] != k or x.dtype not in _X_DTYPES:
        raise ValueError(f"x must be [..., {k}] fp32/bf16/fp16, got {tuple(x.shape)} {x.dtype}")
    if not (0 <= off_r < FP8_BLOCK and 0 <= off_c < FP8_BLOCK):
        raise ValueError(f"offsets must lie in [0, {FP8_BLOCK}), got {(off_r, off_c)}")
    rows, cols = scale_shape(n, k, (off_r, off_c))
    if scale.dim() != 2 or scale.shape[0] < rows or scale.shape[1] < cols or scale.dtype not in _SCALE_DTYPES:
        raise ValueError(f"scale must be at least [{rows}, {cols}] float32/bf16/fp16/e8m0 for weight [{n}, {k}] at "
                         f"offsets {(off_r, off_c)}, got {tuple(scale.shape)} {scale.dtype}")
    if x.device != weight.device or scale.device != weight.device:
        raise ValueError("x, weight and scale must be on one device")


def _flat(x: torch.Tensor) -> torch.Tensor:
    """x as ``[M, K]``: a view when the leading dimensions allow one (the kernel takes any strides), else a copy."""
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])


@torch.library.custom_op("sgl_kernel_ext::fp8_block_linear", mutates_args=())
def _fp8_block_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, off_r: int, off_c: int,
                         backend: str | None = None) -> torch.Tensor:
    n = weight.shape[0]
    if _backend(backend, x) == "torch":
        return fp8_block_matmul(x, weight, scale, (off_r, off_c))
    from .triton_fp8_linear import fp8_block_linear_triton

    return fp8_block_linear_triton(_flat(x), weight, scale, off_r, off_c).view(*x.shape[:-1], n)


@_fp8_block_linear_op.register_fake
def _fp8_block_linear_fake(x, weight, scale, off_r, off_c, backend=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@traffic.declare("sgl_kernel_ext::fp8_block_linear")
def fp8_block_linear_traffic(x, weight, scale, off_r=0, off_c=0, backend=None) -> traffic.Traffic:
    """x, the weight and the touched scale blocks read once; the output written once; one launch, plus a copy of x
    (read and written once more) when its leading dimensions cannot be flattened into a view."""
    n, k = weight.shape
    rows, cols = scale_shape(n, k, (off_r, off_c))
    out_bytes = math.prod(x.shape[:-1]) * n * x.element_size()
    read = traffic.nbytes(x) + traffic.nbytes(weight) + rows * cols * scale.element_size()
    moved = traffic.Traffic(read, out_bytes, 1)
    try:
        x.view(-1, k)
    except RuntimeError:
        moved = moved + traffic.Traffic(traffic.nbytes(x), traffic.nbytes(x), 1)
    return moved


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     offsets: tuple[int, int] = (0, 0), *, backend: str | None = None) -> torch.Tensor:
    """``x W^T`` for a block-scaled FP8 ``W`` (see the module doc for the contract)."""
    off_r, off_c = int(offsets[0]), int(offsets[1])
    _check(x, weight, scale, off_r, off_c)
    if x.device.type == "cpu" and _backend(backend, x) == "torch":  # no op dispatch for the CPU's reference
        return fp8_block_matmul(x, weight, scale, (off_r, off_c))
    return torch.ops.sgl_kernel_ext.fp8_block_linear(x, weight, scale, off_r, off_c, backend)
