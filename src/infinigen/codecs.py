"""How keys and values are stored: as computed, or group-wise quantized (FlexGen style).

The ground floor: the KV store (`cache`), placement's row layouts (`placement.rows`) and the INT4
policy all use these, so placement never imports a policy.

Each run of `group` consecutive values along head_dim gets its own minimum and scale:
    q = round((x - min) / scale),  scale = (max - min) / (2^bits - 1),  x' = q * scale + min
so every value is off by at most scale / 2. `QuantCodec` writes the dequantized values (fake
quantization on write): attention then reads exactly what a packed store decodes to.
`quantize`/`dequantize` give the packed form (two 4-bit codes per uint8) for the slow tier.
"""
from __future__ import annotations

import torch


class KVCodec:
    """Identity codec: values are stored as computed."""

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, int]:
    """x [..., d] as [..., n, group] in float32; a ragged tail is padded with its last value (which
    changes neither the group's min nor its max). Returns the view and the pad length."""
    d = x.shape[-1]
    g = min(group, d)
    pad = (-d) % g
    x = x.float()
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    return x.reshape(*x.shape[:-1], -1, g), pad


def quantize(x: torch.Tensor, bits: int = 4, group: int = 64):
    """Codes, per-group scale and minimum of x [..., d]. Codes are uint8; for bits <= 4 two codes share
    a byte (low nibble first), so `codes` is [..., n, ceil(group/2)]. scale and min are [..., n, 1]."""
    if not 1 <= bits <= 8:
        raise ValueError("quantize packs 1..8 bits")
    xg, _ = _groups(x, group)
    lo = xg.amin(-1, keepdim=True)
    hi = xg.amax(-1, keepdim=True)
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: every code is 0
    codes = ((xg - lo) / safe).round().clamp(0, levels).to(torch.uint8)
    if bits <= 4:
        if codes.shape[-1] % 2:
            codes = torch.cat([codes, torch.zeros_like(codes[..., :1])], dim=-1)
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, scale, lo


def dequantize(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bits: int, d: int,
               dtype: torch.dtype = torch.float32, group: int = 64) -> torch.Tensor:
    """Inverse of `quantize` for vectors of length d."""
    if bits <= 4:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)
        codes = codes[..., :min(group, d)]
    x = codes.float() * scale + lo
    return x.flatten(-2)[..., :d].to(dtype)


def fake_quantize(x: torch.Tensor, bits: int = 4, group: int = 64) -> torch.Tensor:
    """x rounded to its quantization grid, same shape and dtype (no packing)."""
    if bits >= 16:
        return x
    xg, _ = _groups(x, group)
    lo = xg.amin(-1, keepdim=True)
    hi = xg.amax(-1, keepdim=True)
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((xg - lo) / safe).round().clamp(0, levels)
    return (q * scale + lo).flatten(-2)[..., :x.shape[-1]].to(x.dtype)


class QuantCodec(KVCodec):
    """Group-wise asymmetric quantization on write (the slow tier packs it: `placement.rows`)."""

    def __init__(self, bits: int = 4, group: int = 64):
        self.bits, self.group = bits, group

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quantize(x, self.bits, self.group)
