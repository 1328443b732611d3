"""How one KV row (one slot of one KV head of one sequence: its key and its value) is laid out in the
slow tier, and how rows are decoded back into keys and values in the fast tier.

A layout has one or more *planes*; plane p of a layer is a tensor [rows, *shape_p], and row r of every
plane together holds one (slot, batch, KV head) entry. The key and value share a row so that one gather
moves both. Rows are numbered slot-major, r = (slot * B + b) * Hkv + h: the used prefix of a layer's pool
is then one contiguous block (a full-layer copy is a single memcpy, a token's append is one block).
"""
from __future__ import annotations

import torch


class PlainRows:
    """Keys and values as computed (or as a non-packing codec rounds them): one plane [rows, 2, d]."""

    def __init__(self, head_dim: int, dtype: torch.dtype, codec=None):
        self.d, self.dtype, self.codec = head_dim, dtype, codec
        self.planes = [((2, head_dim), dtype)]

    @property
    def row_bytes(self) -> int:
        return sum(_numel(s) * torch.empty((), dtype=t).element_size() for s, t in self.planes)

    def encode(self, kv: torch.Tensor) -> list[torch.Tensor]:
        """kv [N, 2, d] -> the planes' rows."""
        if self.codec is not None:
            kv = self.codec.encode(kv)
        return [kv.to(self.dtype)]

    def decode(self, planes: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """Planes' rows -> kv [N, 2, d] (a view when nothing needs decoding)."""
        return planes[0]


class PackedRows(PlainRows):
    """Group-wise asymmetric quantization packed for real (two 4-bit codes per byte): a codes plane
    [rows, 2, groups, ceil(g/2)] uint8 and a parameter plane [rows, 2, groups, 2] (scale, minimum) in
    float32. Decoding gives exactly what `policies.quant.fake_quantize` writes into an in-memory store."""

    def __init__(self, head_dim: int, dtype: torch.dtype, bits: int, group: int):
        from ..policies.quant import quantize
        self.d, self.dtype, self.codec, self.bits, self.group = head_dim, dtype, None, bits, group
        codes, scale, _ = quantize(torch.zeros(1, head_dim), bits, group)
        groups, per = codes.shape[-2:]
        self.planes = [((2, groups, per), torch.uint8), ((2, groups, 2), scale.dtype)]

    def encode(self, kv: torch.Tensor) -> list[torch.Tensor]:
        from ..policies.quant import quantize
        codes, scale, lo = quantize(kv, self.bits, self.group)
        return [codes, torch.cat([scale, lo], dim=-1)]

    def decode(self, planes: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        from ..policies.quant import dequantize
        codes, par = planes
        kv = dequantize(codes, par[..., 0:1], par[..., 1:2], self.bits, self.d, self.dtype, self.group)
        if out is not None:
            out.copy_(kv)
            return out
        return kv


def layout_for(codec, head_dim: int, dtype: torch.dtype, pack: bool = True) -> PlainRows:
    """Packed rows for a quantizing codec (bits <= 8), plain rows otherwise."""
    bits, group = getattr(codec, "bits", None), getattr(codec, "group", None)
    if pack and bits is not None and group is not None and bits <= 8:
        return PackedRows(head_dim, dtype, bits, group)
    return PlainRows(head_dim, dtype, codec)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
