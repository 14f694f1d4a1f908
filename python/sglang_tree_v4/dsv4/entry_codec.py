"""Compressed entries and window keys as upstream's fp8 bytes (``--kv-cache-dtype fp8_e4m3``): the codec and which
pieces use it.

Why: at V4-Flash shapes the entries are almost all of the state a token keeps for ever, and the window keys most of
what a running request holds; upstream SGLang keeps both as fp8 (584 bytes per entry or key, 132 per index key,
against 1,024 and 256 in bf16). The store (``storage``) encodes a coded piece on write and decodes it on read;
everything else it holds (compressor rows and states, the MTP's keys and input streams) stays in its own dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import DSV4Config

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
ENTRY_FORMATS = ("fp8_e4m3",)  # --kv-cache-dtype values our entries can be kept in besides the model's dtype


@dataclass(frozen=True)
class Fp8Codec:
    """How a piece is kept as bytes: its first ``dim - rope`` channels as e4m3 in tiles of ``tile`` channels with
    one power-of-two scale per tile (a UE8M0 exponent byte, or a float32 where ``scale_bytes == 4``), its last
    ``rope`` channels in bf16, then ``pad`` zero bytes. At V4-Flash shapes these are upstream's fp8 entry (448 e4m3
    + 64 bf16 + 7 scales + 1 pad = 584 B) and index key (128 e4m3 + a 4-byte scale = 132 B). Power-of-two scales
    make the scaling exact: a decoded value is the e4m3 value times its tile's scale, whatever the device."""

    dim: int
    rope: int
    tile: int
    scale_bytes: int
    pad: int = 0

    @property
    def quantized(self) -> int:
        return self.dim - self.rope

    @property
    def tiles(self) -> int:
        return -(-self.quantized // self.tile)

    @property
    def nbytes(self) -> int:
        return self.quantized + 2 * self.rope + self.tiles * self.scale_bytes + self.pad

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, dim]`` float -> ``[n, nbytes]`` uint8."""
        n, q = x.shape[0], self.quantized
        x = x.float()
        tiles = F.pad(x[:, :q], (0, self.tiles * self.tile - q)).view(n, self.tiles, self.tile)
        exponent = torch.ceil(torch.log2(tiles.abs().amax(-1).clamp(min=1e-8) / E4M3_MAX))
        scale = torch.exp2(exponent)
        e4m3 = (tiles / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        parts = [e4m3.view(n, self.tiles * self.tile)[:, :q].view(torch.uint8),
                 x[:, q:].to(torch.bfloat16).view(torch.uint8),
                 (exponent + 127).to(torch.uint8) if self.scale_bytes == 1 else scale.view(torch.uint8),
                 torch.zeros(n, self.pad, dtype=torch.uint8, device=x.device)]
        return torch.cat(parts, 1)

    def decode(self, b: torch.Tensor) -> torch.Tensor:
        """``[..., nbytes]`` uint8 -> ``[..., dim]`` float32 (all-zero bytes decode to zeros)."""
        lead, q = b.shape[:-1], self.quantized
        b = b.reshape(-1, self.nbytes)
        n, s0 = b.shape[0], q + 2 * self.rope
        scales = b[:, s0:s0 + self.tiles * self.scale_bytes].contiguous()
        scale = torch.exp2(scales.float() - 127) if self.scale_bytes == 1 else scales.view(torch.float32)
        vals = F.pad(b[:, :q].contiguous().view(torch.float8_e4m3fn).float(), (0, self.tiles * self.tile - q))
        vals = (vals.view(n, self.tiles, self.tile) * scale[..., None]).view(n, self.tiles * self.tile)[:, :q]
        rope = b[:, q:s0].contiguous().view(torch.bfloat16).float()
        return torch.cat([vals, rope], 1).reshape(*lead, self.dim)


def entry_codecs(cfg: DSV4Config, entry_format: str | None) -> dict[str, Fp8Codec]:
    """How the entries and the target layers' window keys are kept: in the store's dtype (None), or ``fp8_e4m3``
    as upstream keeps them (``Fp8Codec``: entries' and keys' non-rope channels in e4m3 tiles of 64 with UE8M0
    scales and rope channels in bf16, index keys wholly e4m3 with one float32 scale per 128 channels). A piece is
    coded where a layout asks for it by name (``storage.paged_layouts``, ``token_layout``)."""
    if entry_format is None:
        return {}
    if entry_format not in ENTRY_FORMATS:
        raise ValueError(f"--kv-cache-dtype {entry_format}: DeepSeek-V4's entries are kept in the model's dtype "
                         f"or as {', '.join(ENTRY_FORMATS)}")
    entry = Fp8Codec(cfg.head_dim, cfg.rope_dim, 64, 1, pad=1)
    return {"entry": entry, "k": entry, "ientry": Fp8Codec(cfg.index_head_dim, 0, 128, 4)}
