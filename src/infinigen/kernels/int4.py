"""Packed 4-bit keys for InfiniGen's speculation, and scorers that read them without unpacking the context.

Group-wise asymmetric 4-bit quantization along the last dim (per token, groups of `group` values): each
group stores a scale and a minimum, and x ~= code * scale + min with code in 0..15, two codes per byte.
Per token and KV head at d=64, group 32: 32 B of codes + 2 groups x (2 + 2) B = 40 B, against 256 B of
K and V in 16 bits (15.6%) or 512 B in float32 (7.8%).

`PackedKeys` keeps them for a [B, Hkv, capacity, d] cache in one of two layouts:

  rows      codes [B, Hkv, capacity, d/2] (low nibble first, token-major), float16 scale and min
            [B, Hkv, capacity, d/group]. Any device. Scored by a tiled dequantize + matmul in torch
            (slower on CPU than today's float32 matmul: several passes per tile), or by a Triton kernel
            on CUDA (`int4_triton`, when triton is installed).
  tinygemm  CPU only: the layout of `torch.ops.aten._weight_int4pack_mm_for_cpu` (x @ W^T with a 4-bit W,
            an AVX512 kernel that dequantizes in registers): per (batch, KV head), blocks of 64 tokens,
            codes [d, 32] per block, byte j holding token j (low nibble) and token j + 32 (high nibble);
            scale and zero [d/group, capacity, 2] in bfloat16, x = (code - 8) * scale + zero. One token's
            codes are a column of nibbles, so appends are a masked read-modify-write of d bytes.
            The kernel takes bfloat16 queries and returns bfloat16 scores (accumulated in float32): the
            scores carry bf16 rounding (~0.4% relative), far below the 4-bit rounding of the keys.
            Each score is its own float32 dot product: the same bits whatever n or the other query rows
            of the call (decoding and teacher-forced selections agree). Used where torch packs this way
            (checked once against `_convert_weight_to_int4pack_for_cpu`: AVX512 builds).

layout="auto" takes tinygemm where it is usable and padding the capacity to whole 64-token blocks keeps
the bytes within 2.4% (so under 16% of 16-bit K+V); a capacity that is a multiple of 64 always gets it.

Both layouts are exact references of themselves: `dequantize(n)` gives the float32 keys the scorer
multiplies, and `fake_quantize(x, layout=...)` the same values straight from x (what tests compare with).
"""
from __future__ import annotations

import functools

import torch

from . import fused_select

GROUP = 32
TILE = 1024  # tokens per tile of the torch scorers (measured: smaller tiles cost more in per-op overhead)
_BLOCK = 64  # tokens per block of the tinygemm layout (BLOCK_N of the AVX512 kernel)
_F16 = torch.finfo(torch.float16)


def _group(d: int, group: int) -> int:
    return group if d % group == 0 else d  # a ragged head_dim: one group per token


# ---- codec: quantize / pack / unpack (any group size; reusable by the INT4 KV codec) --------------------

def pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., d] (0..15, any integer dtype, d even) -> uint8 [..., d/2], element 2j in the low nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., d/2] -> codes uint8 [..., d] (inverse of `pack`)."""
    return torch.stack((packed & 15, packed >> 4), -1).flatten(-2)


def quantize(x: torch.Tensor, group: int = GROUP, dtype: torch.dtype = torch.float16):
    """x [..., d] -> (packed codes uint8 [..., d/2], scale [..., d/group], minimum [..., d/group]), scale and
    minimum in `dtype`. The codes are computed against the rounded scale and minimum, so dequantizing
    them is as close to x as the stored numbers allow."""
    d = x.shape[-1]
    group = _group(d, group)
    g = x.float().unflatten(-1, (d // group, group))
    lo, hi = g.amin(-1), g.amax(-1)
    fin = torch.finfo(dtype)
    scale = ((hi - lo) / 15).clamp(min=fin.tiny, max=fin.max).to(dtype)
    lo = lo.clamp(min=fin.min, max=fin.max).to(dtype)
    codes = ((g - lo.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, 15)
    return pack(codes.flatten(-2)), scale, lo


def dequantize(packed: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype = torch.float32):
    """Inverse of `quantize`: codes * scale + minimum, [..., d] in `dtype`."""
    c = unpack(packed)
    ng = scale.shape[-1]
    g = c.unflatten(-1, (ng, c.shape[-1] // ng)).to(dtype)
    return (g * scale.to(dtype)[..., None] + lo.to(dtype)[..., None]).flatten(-2)


def fake_quantize(x: torch.Tensor, group: int = GROUP, layout: str = "rows") -> torch.Tensor:
    """The float32 values `PackedKeys(layout=...)` stores for x [..., d] (quantize-dequantize)."""
    if layout == "tinygemm":
        codes, sz = _quantize_tinygemm(x, group)
        ng = sz.shape[-2]
        g = codes.float().unflatten(-1, (ng, codes.shape[-1] // ng))
        return ((g - 8) * sz[..., 0, None].float() + sz[..., 1, None].float()).flatten(-2)
    return dequantize(*quantize(x, group))


def _quantize_tinygemm(x: torch.Tensor, group: int):
    """x [..., d] -> (codes uint8 [..., d] unpacked, scale-and-zero bf16 [..., d/group, 2]) with
    x ~= (code - 8) * scale + zero, the kernel's convention."""
    d = x.shape[-1]
    g = x.float().unflatten(-1, (d // group, group))
    lo, hi = g.amin(-1), g.amax(-1)
    fin = torch.finfo(torch.bfloat16)
    scale = ((hi - lo) / 15).clamp(min=fin.tiny).bfloat16()
    zero = (lo + 8 * scale.float()).bfloat16()
    base = zero.float() - 8 * scale.float()  # the minimum the kernel will use
    codes = ((g - base[..., None]) / scale.float()[..., None]).round_().clamp_(0, 15)
    return codes.flatten(-2).to(torch.uint8), torch.stack((scale, zero), -1)


def _has_triton() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is not None


def tinygemm_ok(d: int, group: int = GROUP, device="cpu") -> bool:
    """Whether the CPU int4 kernel takes keys of this head_dim and group size, in the layout we write."""
    return (torch.device(device).type == "cpu" and group in (32, 64, 128, 256) and d % group == 0
            and _tinygemm_layout_matches())


@functools.cache
def _tinygemm_layout_matches() -> bool:
    """The kernel's packed layout depends on the CPU build it dispatches to (blocks of 64 rows on AVX512,
    32 on AVX2, row pairs otherwise). We write the AVX512 one in place: check once that torch packs the
    same bytes and that the kernel reads them as we expect; anything else falls back to the rows layout."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (2 * _BLOCK, 64), dtype=torch.int32, generator=g)
        theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        c = codes.to(torch.uint8).view(-1, 2, 32, 64)  # [blocks, nibble, 32, K]
        ours = (c[:, 0] | (c[:, 1] << 4)).transpose(1, 2).reshape(theirs.shape)
        sz = torch.rand(2, 2 * _BLOCK, 2, generator=g).bfloat16()
        x = torch.randn(3, 64, generator=g).bfloat16()
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, ours, 32, sz).float()
        w = (codes.float().view(-1, 2, 32) - 8) * sz[..., 0].T[..., None].float() + sz[..., 1].T[..., None].float()
        want = x.float() @ w.view(-1, 64).T
        return torch.equal(theirs, ours) and bool((got - want).abs().max() <= 1e-2 * want.abs().max())
    except RuntimeError:
        return False


# ---- the packed key cache -------------------------------------------------------------------------------

class PackedKeys:
    """4-bit keys of a [B, Hkv, capacity, d] cache, written at prefill and appended per step at any slot.

    write(start, keys [B, Hkv, T, d])       slots start .. start+T-1 of every (batch, KV head)
    scatter(slots [B, Hkv], rows [B, Hkv, 1, d])   one token per (batch, KV head), at its own slot (pool)
    scores(q [B, Hkv, G, d], n) -> [B, Hkv, G, n] float32: q . key for the first n slots
    dequantize(n) -> [B, Hkv, n, d] float32: the keys the scorer multiplies (reference; materializes)
    nbytes: bytes held (codes + scales + minima)
    """

    def __init__(self, batch: int, heads: int, capacity: int, dim: int, group: int = GROUP,
                 layout: str = "auto", device=None):
        device = torch.device(device or "cpu")
        if dim % 2:
            raise ValueError(f"packed keys need an even head_dim, got {dim}")
        group = _group(dim, group)
        if layout == "auto":
            # the kernel reads whole blocks of 64 tokens: pad only while the bytes stay within 2.4% of the
            # unpadded ones (40 B/token at d 64 stays under 16% of 16-bit K+V); a store whose capacity is a
            # multiple of 64 always gets the fast layout
            padded = -(-capacity // _BLOCK) * _BLOCK
            layout = "tinygemm" if tinygemm_ok(dim, group, device) and padded <= 1.024 * capacity else "rows"
        if layout == "tinygemm" and not tinygemm_ok(dim, group, device):
            raise ValueError(f"the tinygemm layout needs a CPU, group 32/64/128/256 dividing d "
                             f"(d={dim}, group={group})")
        if layout not in ("rows", "tinygemm"):
            raise ValueError(f"unknown layout {layout!r}")
        self.batch, self.heads, self.capacity = batch, heads, capacity
        self.dim, self.group, self.layout = dim, group, layout
        ng = dim // group
        if layout == "rows":
            self.codes = torch.zeros(batch, heads, capacity, dim // 2, dtype=torch.uint8, device=device)
            self.scale = torch.zeros(batch, heads, capacity, ng, dtype=torch.float16, device=device)
            self.lo = torch.zeros(batch, heads, capacity, ng, dtype=torch.float16, device=device)
        else:
            blocks = -(-capacity // _BLOCK)  # the kernel reads whole blocks of 64 tokens
            self.codes = torch.full((batch, heads, blocks, dim, _BLOCK // 2), 0x88, dtype=torch.uint8, device=device)
            self.sz = torch.zeros(batch, heads, ng, blocks * _BLOCK, 2, dtype=torch.bfloat16, device=device)
            self._codes_by_slot = self.codes.view(batch, heads, -1, dim // 2)  # as the scorer reads them

    def rotates(self) -> bool:
        """Whether `scores_rotated` and `scatter_rotated` run here: the int4 kernel's layout, on a CPU, with the
        native build."""
        return self.layout == "tinygemm" and self.codes.device.type == "cpu" and fused_select.available()

    def scores_rotated(self, x: torch.Tensor, rotation: torch.Tensor | None, n: int) -> torch.Tensor:
        """`scores` of x [B, Hkv, G, d] rotated by its KV head's matrix, rotation [Hkv, d, d] float64 (None: x as it
        is), in float64 and rounded to float32 first: one native call (`rotates`)."""
        return fused_select.score_int4(x, self._codes_by_slot, self.sz, self.group, n, rotation=rotation)

    def select_rotated(self, x: torch.Tensor, rotation: torch.Tensor | None, n: int, **cut):
        """`scores_rotated` and InfiniGen's layer cut of them (`cut`: scale, alpha, total, capacity, with_lse) in one
        native call (`fused_select.score_select`): what `fused_select.select_packed` returns."""
        return fused_select.score_select(x, self._codes_by_slot, self.sz, self.group, n, rotation=rotation, **cut)

    def scatter_rotated(self, slots: torch.Tensor, rows: torch.Tensor, rotation: torch.Tensor | None) -> None:
        """`scatter` of rows [B, Hkv, 1, d] rotated as `scores_rotated` rotates: one native call (`rotates`)."""
        fused_select.scatter_int4(self.codes, self.sz, slots, rows, self.group, rotation)

    def write_rotated(self, start: int, keys: torch.Tensor, rotation: torch.Tensor | None) -> None:
        """`write` of keys [B, Hkv, T, d] rotated as `scores_rotated` rotates: one native call (`rotates`)."""
        if start < 0 or start + keys.shape[2] > self.capacity:
            raise IndexError(f"slots {start}..{start + keys.shape[2]} outside capacity {self.capacity}")
        fused_select.write_int4(self.codes, self.sz, start, keys, self.group, rotation)

    @property
    def nbytes(self) -> int:
        ts = (self.codes, self.scale, self.lo) if self.layout == "rows" else (self.codes, self.sz)
        return sum(t.numel() * t.element_size() for t in ts)

    # ---- writes ---------------------------------------------------------------------------------
    def write(self, start: int, keys: torch.Tensor) -> None:
        t = keys.shape[2]
        if start < 0 or start + t > self.capacity:
            raise IndexError(f"slots {start}..{start + t} outside capacity {self.capacity}")
        if self.layout == "rows":
            self.codes[:, :, start:start + t], self.scale[:, :, start:start + t], self.lo[:, :, start:start + t] = \
                quantize(keys, self.group)
            return
        codes, sz = _quantize_tinygemm(keys, self.group)
        self.sz[:, :, :, start:start + t] = sz.transpose(2, 3)
        slots = torch.arange(start, start + t, device=keys.device)
        # two tokens share each byte (slot s and s + 32 of a block): write the low nibbles, then the high
        for half in (0, 1):
            m = (slots % _BLOCK) // 32 == half
            if m.any():
                self._put_codes(slots[m].expand(*keys.shape[:2], -1), codes[:, :, m])

    def scatter(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Token rows [B, Hkv, 1, d] into slots [B, Hkv] (each (batch, KV head) its own slot)."""
        s = slots[:, :, None]
        if self.layout == "rows":
            codes, scale, lo = quantize(rows, self.group)
            # 16-bit floats moved as int16: scatter_ on float16/bfloat16 takes a slow path in torch 2.13
            # (tens of ms for a [8, 3, 8192, 64] buffer, against 4 us for int16)
            for buf, val in ((self.codes, codes), (self.scale.view(torch.int16), scale.view(torch.int16)),
                             (self.lo.view(torch.int16), lo.view(torch.int16))):
                buf.scatter_(2, s[..., None].expand(*s.shape, buf.shape[-1]), val)
            return
        if rows.dtype == torch.float32 and rows.device.type == "cpu" and fused_select.available():
            fused_select.scatter_int4(self.codes, self.sz, slots, rows, self.group)  # the same bytes, one call
            return
        codes, sz = _quantize_tinygemm(rows, self.group)  # [B, Hkv, 1, d], [B, Hkv, 1, ng, 2]
        ng = sz.shape[-2]
        val = sz.permute(0, 1, 3, 2, 4).contiguous().view(torch.int32)  # (scale, zero) as one int32: as above
        self.sz.view(torch.int32).scatter_(3, s[:, :, None, :, None].expand(*s.shape[:2], ng, 1, 1), val)
        self._put_codes(s, codes)

    def _put_codes(self, slots: torch.Tensor, codes: torch.Tensor) -> None:
        """Codes [B, Hkv, T, d] (unpacked) of tokens at slots [B, Hkv, T], no two of them sharing a byte."""
        b, h, t, d = codes.shape
        flat = self.codes.view(b, h, -1)
        k = torch.arange(d, device=codes.device)
        # byte of (slot, k): block * d * 32 + k * 32 + slot % 32; nibble: (slot % 64) // 32
        off = ((slots // _BLOCK) * (d * 32) + slots % 32)[..., None] + k * 32  # [B, Hkv, T, d]
        hi = ((slots % _BLOCK) >= 32)[..., None]
        old = flat.gather(2, off.flatten(2)).view(b, h, t, d)
        new = torch.where(hi, (old & 0x0F) | (codes << 4), (old & 0xF0) | codes)
        flat.scatter_(2, off.flatten(2), new.flatten(2))

    # ---- reads ----------------------------------------------------------------------------------
    def dequantize(self, n: int | None = None) -> torch.Tensor:
        """The float32 keys [B, Hkv, n, d] of the first n slots (reference path: materializes them)."""
        n = self.capacity if n is None else n
        if self.layout == "rows":
            return dequantize(self.codes[:, :, :n], self.scale[:, :, :n], self.lo[:, :, :n])
        b, h, nb, d, half = self.codes.shape
        c = self.codes.transpose(-1, -2)  # [B, Hkv, nb, 32, d]
        c = torch.cat((c & 15, c >> 4), 3).reshape(b, h, nb * _BLOCK, d)[:, :, :n].float()
        sz = self.sz[:, :, :, :n].float()  # [B, Hkv, ng, n, 2]
        ng = sz.shape[2]
        scale = sz[..., 0].transpose(2, 3).repeat_interleave(d // ng, -1)
        zero = sz[..., 1].transpose(2, 3).repeat_interleave(d // ng, -1)
        return (c - 8) * scale + zero

    def default_method(self) -> str:
        """The fastest measured scorer for this layout and device (results/int4_scorer/)."""
        if self.layout == "tinygemm":
            return "tinygemm"
        if self.codes.is_cuda and _has_triton() and self.dim >= 4 and (self.dim // 2) & (self.dim // 2 - 1) == 0:
            return "triton"
        return "tiled"

    def scores(self, q: torch.Tensor, n: int, method: str | None = None) -> torch.Tensor:
        """q [B, Hkv, G, d] -> float32 [B, Hkv, G, n]: q . key of each of the first n slots.
        method: None (`default_method()`), "reference", and per layout "tiled" / "algebraic" / "bf16" /
        "triton" (rows; triton on CUDA, or on CPU under TRITON_INTERPRET=1) or "tinygemm"."""
        method = method or self.default_method()
        if method == "reference":
            return q.float() @ self.dequantize(n).transpose(-1, -2)
        if self.layout == "tinygemm":
            if method != "tinygemm":
                raise ValueError(f"the tinygemm layout has no {method!r} scorer")
            return _score_tinygemm(self, q, n)
        if method == "triton":
            from . import int4_triton  # optional dependency: only imported when asked for
            return int4_triton.scores(self, q, n)
        fn = {"tiled": _score_tiled, "algebraic": _score_algebraic, "bf16": _score_bf16}.get(method)
        if fn is None:
            raise ValueError(f"the rows layout has no {method!r} scorer")
        return fn(self, q, n)


# ---- scorers --------------------------------------------------------------------------------------------

def _score_tiled(pk: PackedKeys, q: torch.Tensor, n: int, tile: int = TILE) -> torch.Tensor:
    """Dequantize TILE tokens at a time (float32, cache-resident) and multiply."""
    q = q.float()
    out = torch.empty(*q.shape[:3], n, dtype=torch.float32, device=q.device)
    for s in range(0, n, tile):
        e = min(n, s + tile)
        k = dequantize(pk.codes[:, :, s:e], pk.scale[:, :, s:e], pk.lo[:, :, s:e])
        torch.matmul(q, k.transpose(-1, -2), out=out[..., s:e])
    return out


def _score_bf16(pk: PackedKeys, q: torch.Tensor, n: int, tile: int = TILE) -> torch.Tensor:
    """Like `_score_tiled` with bfloat16 tiles and queries (AVX512-BF16 matmul), scores rounded to bf16."""
    qb = q.bfloat16()
    out = torch.empty(*q.shape[:3], n, dtype=torch.float32, device=q.device)
    for s in range(0, n, tile):
        e = min(n, s + tile)
        k = dequantize(pk.codes[:, :, s:e], pk.scale[:, :, s:e], pk.lo[:, :, s:e], torch.bfloat16)
        out[..., s:e] = qb @ k.transpose(-1, -2)
    return out


def _score_algebraic(pk: PackedKeys, q: torch.Tensor, n: int, tile: int = TILE) -> torch.Tensor:
    """q . k = sum over groups g of scale_g * (q_g . codes_g) + min_g * sum(q_g): one matmul of a
    group-block-diagonal query [G*ng, d] against the raw codes (even dims from the low nibbles, odd ones
    from the high), then the per-group combination: the tile is never scaled, only converted. (In bf16
    the matmul would round its output to bf16: float32 keeps the scores exact to float rounding.)"""
    b, h, G, d = q.shape
    ng = pk.scale.shape[-1]
    gs = d // ng
    q = q.float()
    # columns: first the d/2 even dims (low nibbles), then the d/2 odd dims (high nibbles)
    qperm = torch.cat((q[..., 0::2], q[..., 1::2]), -1)  # [B, Hkv, G, d]
    grp = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2))).to(q.device) // gs  # group of each column
    mask = (grp[None, :] == torch.arange(ng, device=q.device)[:, None]).float()  # [ng, d]
    qd = (qperm[:, :, :, None, :] * mask).reshape(b, h, G * ng, d)  # block-diagonal per group
    qsum = q.unflatten(-1, (ng, gs)).sum(-1)  # [B, Hkv, G, ng]
    out = torch.empty(b, h, G, n, dtype=torch.float32, device=q.device)
    for s in range(0, n, tile):
        e = min(n, s + tile)
        p = pk.codes[:, :, s:e]
        c = torch.cat((p & 15, p >> 4), -1).float()  # [B, Hkv, T, d] in qperm's column order
        r = qd @ c.transpose(-1, -2)  # [B, Hkv, G*ng, T]
        r = r.view(b, h, G, ng, e - s)
        sc = pk.scale[:, :, s:e].float().transpose(-1, -2)  # [B, Hkv, ng, T]
        lo = pk.lo[:, :, s:e].float().transpose(-1, -2)
        out[..., s:e] = (r * sc[:, :, None]).sum(3) + qsum @ lo
    return out


def _score_tinygemm(pk: PackedKeys, q: torch.Tensor, n: int) -> torch.Tensor:
    """torch's AVX512 int4 kernel, one call per (batch, KV head): q [G, d] bf16 x W [n, d] int4."""
    b, h, G, d = q.shape
    if n == 0:
        return q.new_zeros(b, h, G, 0, dtype=torch.float32)
    nr = min(-(-n // _BLOCK) * _BLOCK, pk.codes.shape[2] * _BLOCK)  # whole blocks (tail slots ignored)
    qb = q.bfloat16().contiguous()
    codes = pk.codes.view(b, h, -1, d // 2)
    if fused_select.available():  # every (batch row, KV head) in one native call
        return fused_select.score_int4(qb, codes, pk.sz, pk.group, n)
    sz = pk.sz[:, :, :, :nr]
    if nr != pk.sz.shape[3]:
        sz = sz.contiguous()  # the kernel indexes scale-and-zero as [ng, nr, 2] contiguous
    codes = codes[:, :, :nr]
    out = torch.empty(b, h, G, n, dtype=torch.float32, device=q.device)
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    for i in range(b):
        for j in range(h):
            out[i, j] = mm(qb[i, j], codes[i, j], pk.group, sz[i, j])[:, :n]
    return out
