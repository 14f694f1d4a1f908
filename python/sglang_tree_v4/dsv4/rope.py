"""Partial, interleaved rotary embedding as V4 uses it.

Only the LAST ``rope_dim`` channels of a vector rotate, in consecutive pairs (2i, 2i+1). Two frequency tables
exist: ``main`` (plain RoPE at ``rope_theta``, used by sliding-window-only layers and the MTP layer) and
``compress`` (``compress_rope_theta`` with YaRN, used for everything inside CSA/HCA layers: q, the window key, the
compressed entries and the indexer's q and keys). V4's reference never scales cos/sin; a config may still carry a
YaRN ``attention_factor`` (transformers multiplies both cos and sin by it, in every use), and then so does ``Rope``.

Because V = K carries the key's rotation, the attention output's rope slice is rotated back by the query position
(``rotate(x, cos, sin, inverse=True)``) before the output projection.
"""
from __future__ import annotations

import math

import torch

from sgl_kernel_ext.rms_norm_rope import rms_norm_rope
from sgl_kernel_ext.rope import rope_rotate

from .config import DSV4Config


def inv_freq(rope_dim: int, theta: float, yarn: dict | None = None) -> torch.Tensor:
    """One inverse frequency per rotated pair (``rope_dim // 2`` values), float32."""
    base = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    plain = 1.0 / base
    if not yarn:
        return plain
    factor = float(yarn["factor"])
    orig = float(yarn["original_max_position_embeddings"])
    fast = float(yarn.get("beta_fast") or 32)
    slow = float(yarn.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the pair index whose wavelength fits `rotations` times into `orig`
        return rope_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(math.floor(dim_of(fast)), 0)
    hi = min(math.ceil(dim_of(slow)), rope_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # 1: high-frequency pairs keep their frequency; 0: low-frequency pairs are divided by `factor`
    return plain / factor * (1 - keep) + plain * keep


class Rope:
    """cos/sin lookup for one frequency table. Positions are absolute token positions (may be any long tensor)."""

    def __init__(self, rope_dim: int, theta: float, yarn: dict | None = None):
        self.rope_dim = rope_dim
        self.inv_freq = inv_freq(rope_dim, theta, yarn)
        self.scale = float((yarn or {}).get("attention_factor") or 1.0)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ang = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(positions.device)
        if self.scale == 1.0:
            return ang.cos(), ang.sin()
        return ang.cos() * self.scale, ang.sin() * self.scale

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the trailing ``rope_dim`` channels of ``x`` (``[T, D]``, or ``[T, H, D]`` with cos/sin unsqueezed
        to ``[T, 1, rope_dim/2]``) in fp32, returned in x's dtype: ``sgl_kernel_ext.rope``'s op (one kernel on a
        GPU). ``inverse``: the rotation back (by ``-sin``)."""
        if x.dim() == 3:
            return rope_rotate(x, cos[:, 0], sin[:, 0], inverse)
        return rope_rotate(x[:, None], cos, sin, inverse)[:, 0]

    def norm_rotate(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor:
        """``rotate(rms_norm(x, weight, eps), cos, sin)``, shapes as ``rotate``'s: ``sgl_kernel_ext.rms_norm_rope``
        (one kernel on a GPU for what V4 always does back to back to its queries, keys and HCA entries)."""
        if x.dim() == 3:
            return rms_norm_rope(x, weight, eps, cos[:, 0], sin[:, 0])
        return rms_norm_rope(x[:, None], weight, eps, cos, sin)[:, 0]


def ropes_for(cfg: DSV4Config) -> dict[str, Rope]:
    return {
        "main": Rope(cfg.rope_dim, cfg.rope_theta, None),
        "compress": Rope(cfg.rope_dim, cfg.compress_rope_theta, cfg.rope_scaling),
    }
