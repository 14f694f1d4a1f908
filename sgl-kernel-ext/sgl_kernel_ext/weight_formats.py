"""DeepSeek-V4's low-precision weight formats in plain torch: the contract the weight-reading kernels implement and
the reference they are tested against.

* **FP8 block-scaled**: ``weight`` ``float8_e4m3fn [out, in]`` with ``scale [ceil(out/128), ceil(in/128)]``, a power
  of two stored as e8m0 (or float32 in some checkpoints); ``w = fp8 * scale`` per 128 x 128 block.
* **FP4 (e2m1)**: ``weight`` int8/uint8 ``[out, in/2]``, two e2m1 values per byte packed along the input dimension
  (low nibble = even element; bit 3 = sign; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6), with ``scale`` e8m0
  ``[out, in/32]``.

Dequantisation works one block of output rows at a time, so temporaries are bounded by a block, never the whole
weight.
"""

from __future__ import annotations

import torch
from torch import nn

FP8_BLOCK = 128
FP4_GROUP = 32
FP8_DTYPE = torch.float8_e4m3fn
E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 exponents (``float8_e8m0fnu`` or their raw uint8 bytes) -> float32 powers of two ``2^(b - 127)``."""
    if E8M0_DTYPE is not None and scale.dtype == E8M0_DTYPE:
        scale = scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Any power-of-two scale tensor -> its e8m0 bytes (uint8)."""
    if E8M0_DTYPE is not None and scale.dtype == E8M0_DTYPE:
        return scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return scale
    return (torch.log2(scale.float()).round() + 127).clamp(0, 254).to(torch.uint8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``[..., n/2]`` bytes -> ``[..., n]`` float32 e2m1 values (low nibble first)."""
    b = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    # Decoded arithmetically (no lookup table to copy to the device inside a step): magnitude code m in 0..7 is
    # m / 2 below 2, else 2^(e - 1) * (1 + mantissa / 2) with e = m // 2, mantissa = m % 2; bit 3 is the sign.
    m = (codes & 7).float()
    e = torch.floor(m / 2)
    mag = torch.where(m < 2, m * 0.5, torch.exp2(e - 1) * (1 + (m - 2 * e) / 2))
    return torch.where(codes >= 8, -mag, mag)


def pack_fp4(values: torch.Tensor) -> torch.Tensor:
    """Values -> the nearest e2m1 codes, packed: ``[..., n]`` -> ``[..., n/2]`` uint8 (inverse of ``unpack_fp4`` on
    the grid)."""
    codes = (values.unsqueeze(-1) - _E2M1.to(values.device)).abs().argmin(-1).to(torch.uint8)
    codes = torch.where((values == 0) & (codes == 8), torch.zeros_like(codes), codes)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, start: int = 0, stop: int | None = None,
                   offsets: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """float32 rows ``[start, stop)`` of a block-scaled FP8 matrix. ``offsets``: where this tensor's element
    (0, 0) sits inside its first 128 x 128 block -- non-zero for a tensor-parallel shard that does not start on a
    block boundary (its scale then holds every block its rows and columns touch)."""
    w = weight[start:stop].float()
    rows = (torch.arange(start, start + w.shape[0], device=w.device) + offsets[0]) // FP8_BLOCK
    cols = (torch.arange(w.shape[1], device=w.device) + offsets[1]) // FP8_BLOCK
    return w * scale.float()[rows][:, cols]


def _e4m3_as_half(weight: torch.Tensor) -> torch.Tensor:
    """float16 values ``fp8 * 2^-8`` of e4m3fn codes, exact, decoded through their bits (torch's own fp8 -> float
    conversion on the CPU is about ten times slower): a code's sign, 4 exponent and 3 mantissa bits, laid into the
    float16 fields, read with bias 15 instead of 7 -- subnormals included. The NaN codes (all 7 low bits set) get
    an all-ones exponent, so they stay NaN."""
    h = weight.view(torch.int8).to(torch.int16).bitwise_left_shift_(7).bitwise_and_(-16385)  # sign | code << 7
    return h.bitwise_or_((h + 0x80).bitwise_and_(0x4000)).view(torch.float16)  # 0x4000 only where code is NaN


def fp8_block_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     offsets: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """``x W^T`` for a block-scaled FP8 ``W [N, K]`` (``W[n, k] = fp8[n, k] * scale[(n + off_r) // 128,
    (k + off_c) // 128]``, see ``dequantize_fp8``; scale float32, bf16 or e8m0): ``x`` upcast to float32, float32
    products and sums, the result in ``x``'s dtype. The CPU path and the reference for the GPU kernel
    (``sgl_kernel_ext.fp8_linear``).

    Works through the rows one scale block at a time (temporaries bounded by 128 rows of ``W`` in float32): on a
    CPU that beats dequantising the whole matrix first (which writes it once more to memory), and the bitwise fp8
    decode beats torch's conversion. Exact for power-of-two scales below 2^120 (the decode's 2^-8 is folded into
    the scale)."""
    n_out, n_in = weight.shape
    off_r, off_c = offsets
    s = e8m0_to_float(scale) * 256.0
    cols = (torch.arange(n_in, device=weight.device) + off_c) // FP8_BLOCK
    xf = x.reshape(-1, n_in).float()
    out, r = [], 0
    while r < n_out:
        stop = min(n_out, r + FP8_BLOCK - (r + off_r) % FP8_BLOCK)  # the rows sharing scale row (r + off_r) // 128
        w = _e4m3_as_half(weight[r:stop]).float().mul_(s[(r + off_r) // FP8_BLOCK, cols])
        out.append(xf @ w.t())
        r = stop
    y = torch.cat(out, dim=-1) if out else xf.new_zeros(xf.shape[0], 0)
    return y.to(x.dtype).reshape(*x.shape[:-1], n_out)


def dequantize_fp4(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``[out, in]`` of a packed FP4 matrix with per-32 e8m0 scales."""
    return unpack_fp4(weight) * e8m0_to_float(scale).repeat_interleave(FP4_GROUP, -1)


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """A linear's weight as a float matrix, whether it is dense or kept FP8 (``FP8BlockLinear``, or one of
    SGLang's parallel linears holding our FP8 block weights, see ``tp``)."""
    if linear.weight.dtype == FP8_DTYPE:
        return dequantize_fp8(linear.weight, linear.scale, offsets=getattr(linear, "offsets", (0, 0)))
    return linear.weight


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[out, in]`` -> (FP8 e4m3 weight, e8m0 block scales ``[ceil(out/128), ceil(in/128)]``), each scale the
    power of two at or above the block's amax / 448 (DeepSeek's published convention)."""
    o, i = w.shape
    bo, bi = -(-o // FP8_BLOCK), -(-i // FP8_BLOCK)
    padded = torch.zeros(bo * FP8_BLOCK, bi * FP8_BLOCK, dtype=torch.float32)
    padded[:o, :i] = w.float()
    amax = padded.abs().reshape(bo, FP8_BLOCK, bi, FP8_BLOCK).amax(dim=(1, 3)).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    full = scale.repeat_interleave(FP8_BLOCK, 0)[:o].repeat_interleave(FP8_BLOCK, 1)[:, :i]
    return (w.float() / full).to(FP8_DTYPE), e8m0_bytes(scale).view(E8M0_DTYPE)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[out, in]`` -> (packed int8 ``[out, in/2]``, e8m0 scales ``[out, in/32]``): per group of 32 inputs
    the power of two at or above amax / 6, values rounded to the nearest e2m1."""
    o, i = w.shape
    groups = w.float().reshape(o, i // FP4_GROUP, FP4_GROUP)
    scale = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)))
    packed = pack_fp4((groups / scale[..., None]).reshape(o, i))
    return packed.view(torch.int8), e8m0_bytes(scale).view(E8M0_DTYPE)
