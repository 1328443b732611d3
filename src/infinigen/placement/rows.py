"""How the slow tier lays out cached keys and values, and how rows decode back in the fast tier.

Keys and values are kept apart (so fetched keys are contiguous [B,Hkv,n,d] for attention's matmul; a
row stride of 2d made CPU matmuls 4x slower). Each is one or more *planes*: plane p of a layer is a
tensor [rows, *shape_p]; row r of every plane together holds one (slot, batch, KV head) vector. Rows are
numbered slot-major, r = (slot * B + b) * Hkv + h, so the used prefix of a layer's pool is one
contiguous block (a full-layer copy is a single memcpy, a token's append is one block).
"""
from __future__ import annotations

import torch

from ..codecs import dequantize, quantize


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class PlainRows:
    """Vectors as computed (or as a non-packing codec rounds them): one plane [rows, d]."""

    packed = False

    def __init__(self, head_dim: int, dtype: torch.dtype, codec=None):
        self.d, self.dtype, self.codec = head_dim, dtype, codec
        self.planes = [((head_dim,), dtype)]

    @property
    def row_bytes(self) -> int:
        """Bytes of one key (or one value) vector in the slow tier."""
        return sum(_numel(s) * torch.empty((), dtype=t).element_size() for s, t in self.planes)

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [N, d] -> the planes' rows."""
        if self.codec is not None:
            x = self.codec.encode(x)
        return [x.to(self.dtype)]

    def decode(self, planes: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """The planes' rows -> [N, d] (the plane itself: nothing to decode)."""
        return planes[0]


class PackedRows(PlainRows):
    """Group-wise asymmetric quantization packed for real (two 4-bit codes per byte): a codes plane
    [rows, groups, ceil(g/2)] uint8 and a parameter plane [rows, groups, 2] (scale, minimum) in float32.
    Decoding gives exactly what `codecs.fake_quantize` writes into an in-memory store."""

    packed = True

    def __init__(self, head_dim: int, dtype: torch.dtype, bits: int, group: int):
        self.d, self.dtype, self.codec, self.bits, self.group = head_dim, dtype, None, bits, group
        codes, scale, _ = quantize(torch.zeros(1, head_dim), bits, group)
        groups, per = codes.shape[-2:]
        self.planes = [((groups, per), torch.uint8), ((groups, 2), scale.dtype)]

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        codes, scale, lo = quantize(x, self.bits, self.group)
        return [codes, torch.cat([scale, lo], dim=-1)]

    def decode(self, planes: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        codes, par = planes
        x = dequantize(codes, par[..., 0:1], par[..., 1:2], self.bits, self.d, self.dtype, self.group)
        if out is not None:
            out.copy_(x)
            return out
        return x


def layout_for(codec, head_dim: int, dtype: torch.dtype, pack: bool = True) -> PlainRows:
    """Packed rows for a quantizing codec (bits <= 8), plain rows otherwise."""
    bits, group = getattr(codec, "bits", None), getattr(codec, "group", None)
    if pack and bits is not None and group is not None and bits <= 8:
        return PackedRows(head_dim, dtype, bits, group)
    return PlainRows(head_dim, dtype, codec)
