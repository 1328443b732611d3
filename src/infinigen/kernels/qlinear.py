"""Weight-only quantized linear layers (and the embedding that shares the output layer's int8 table).

At batch 1 a decoding step reads every weight once, so the bytes of the weights are its time. These
modules keep the weights as a quantized file stores them and multiply with torch's weight-only kernels,
which dequantize in registers:

  Int4Linear     group-wise asymmetric 4-bit, w = (code - 8) * scale + zero per group of `group` inputs
                 (tinygemm's convention), codes 0..15.
                 CPU: layout from `aten._convert_weight_to_int4pack_for_cpu`; a decoding batch's call (at most
                 8 rows, whole 64-output blocks) runs the native `int4_gemv` (AVX-512; kernels/int4_gemv.py),
                 any other `aten._weight_int4pack_mm_for_cpu` (AVX512 kernel for bfloat16; its float32 path
                 is scalar, exact but ~20x slower).
                 CUDA: `aten._weight_int4pack_mm` (bfloat16 only), layout from `_convert_weight_to_int4pack`.
  Int8Linear     per-output-row symmetric 8-bit, w = code * scale: a decoding batch's call (at most 8 rows) the
                 native `int8_gemv` (AVX-512), any other `aten._weight_int8pack_mm`.
  Int8Embedding  rows of an Int8Linear's table (a tied embedding and output layer share one table).

GGUF blocks map onto them (`from_gguf_blocks`): Q4_1 stores w = d * q + m with q in 0..15, which is
(q - 8) * d + (m + 8 d): scale d, zero m + 8 d. Q4_0 stores w = d * (q - 8): scale d, zero 0. Both are
exact up to rounding d and the zero to the compute dtype (float16 d to bfloat16: 3 bits). Q8_0 keeps
a scale per 32 inputs, the int8 kernel one per row: its rows are re-quantized (`Int8Linear.quantize`).

The kernels are made for few rows (decoding): at 512 rows the CPU int4 kernel is ~20x slower than a
bfloat16 matmul (AMX). A call with more than `DENSE_ROWS` rows (a prefill, a teacher-forced window)
dequantizes the weight into a transient tensor and runs the dense matmul instead.

`module.weight` is a `DequantizedView`: it has the logical shape, dtype and device and no storage; an
operation on it dequantizes (so `model.dtype`, fingerprints and `torch.equal` work), writing into it is
an error (quantized weights are not edited in place).
"""
from __future__ import annotations

import contextlib
import functools
import threading

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

from . import int4_gemv

GROUP = 32  # GGUF Q4_0/Q4_1/Q8_0 block size; the re-quantization group (K = 576 rules out 128)
GROUPS = (32, 64, 128, 256)  # group sizes the int4 kernels take
DENSE_ROWS = 64  # more input rows than this: dequantize once and run a dense matmul (measured crossover)
_CPU_BLOCK_N = 64  # output rows per block of the AVX512 packed layout
_kept = threading.local()  # .weights: {(layer, dtype): its dense weight} inside `dense_weights_kept`


@contextlib.contextmanager
def dense_weights_kept():
    """Inside: a quantized layer called with more than DENSE_ROWS rows dequantizes its weight once and reuses
    it for every such call (a prefill in row tiles calls each layer once per tile); freed on leaving."""
    outer = getattr(_kept, "weights", None)
    _kept.weights = {} if outer is None else outer
    try:
        yield
    finally:
        _kept.weights = outer


ALONE_ROWS = int4_gemv.MAX_ROWS  # the rows the decoding kernels take: each row computed as a row alone


@contextlib.contextmanager
def rows_as_alone(dense: bool = False):
    """Inside: a quantized layer called with more than ALONE_ROWS rows runs its decoding kernel on chunks of that
    many, so every row's arithmetic is that of the row in a batch of one (above ALONE_ROWS another kernel runs,
    whose rows round apart: results/batch_invariant/batch_invariant.md); the weights are read once per chunk.
    `dense`: a dense weight's `F.linear` (a plain nn.Linear) also runs once per row of its input's first dimension
    (`_DenseRowsAlone`). What `serve --batch-invariant` needs with several requests running."""
    outer = getattr(_kept, "alone", False)
    _kept.alone = True
    try:
        with _DenseRowsAlone() if dense else contextlib.nullcontext():
            yield
    finally:
        _kept.alone = outer


def has_dense_linear(model: nn.Module) -> bool:
    """Whether `model` computes with a plain nn.Linear (dense weights: a checkpoint's, or those no quantized kernel
    took), which `rows_as_alone(dense=True)` must call row by row."""
    return any(type(m) is nn.Linear for m in model.modules())


class _DenseRowsAlone(torch.overrides.TorchFunctionMode):
    """`F.linear` over more than one row of its input's first dimension, one call per row, each the call that row
    makes alone: torch's bfloat16 matmul blocks its reduction by the number of rows, so a row of a batch can round
    apart from the same row alone (SmolLM2's down_proj, 1536 inputs: 1 of 8 and of 12 rows; results/batch_invariant/).
    The weights are read once per row."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and args[0].dim() > 1 and args[0].shape[0] > 1:
            return torch.cat([func(row, *args[1:], **kwargs) for row in args[0].split(1)])
        return func(*args, **kwargs)


def _in_chunks_as_alone(layer, x: torch.Tensor, rows: int) -> torch.Tensor | None:
    """`layer`(x) a chunk of ALONE_ROWS rows at a time, inside `rows_as_alone` where x has more; else None."""
    if rows <= ALONE_ROWS or not getattr(_kept, "alone", False):
        return None
    parts = [layer(part) for part in x.reshape(rows, layer.in_features).split(ALONE_ROWS)]
    return torch.cat(parts).view(*x.shape[:-1], layer.out_features)


def _dense_weight(layer, dtype: torch.dtype) -> torch.Tensor:
    kept = getattr(_kept, "weights", None)
    if kept is None:
        return layer.dequantize(dtype)
    w = kept.get((id(layer), dtype))
    if w is None:
        w = kept[(id(layer), dtype)] = layer.dequantize(dtype)
    return w


# ---- what the kernels take --------------------------------------------------------------------------
def int4_problem(out_features: int, in_features: int, group: int, device) -> str | None:
    """Why the int4 kernel cannot take a weight of this shape on `device` (None: it can)."""
    problem = _int4_shape_problem(out_features, in_features, group, device)
    if problem is None and torch.device(device).type == "cuda" and not _cuda_int4_ok():
        return "the CUDA int4 kernel did not reproduce a reference product with our packing"
    return problem


def _int4_shape_problem(out_features: int, in_features: int, group: int, device) -> str | None:
    dev = torch.device(device).type
    if dev == "cuda" and not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
        return "this torch build has no CUDA int4 kernel"
    if dev == "cpu" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "this torch build has no CPU int4 kernel"
    if dev not in ("cpu", "cuda"):
        return f"no int4 kernel on {dev}"
    if group not in GROUPS:
        return f"group {group} is not one of {GROUPS}"
    if in_features % group:
        return f"in_features {in_features} is not a multiple of the group {group}"
    if dev == "cpu" and out_features % 16:
        return f"out_features {out_features} is not a multiple of 16 (the CPU kernel's packing)"
    if dev == "cuda" and (out_features % 8 or in_features % 32):
        return (f"the CUDA kernel needs out_features % 8 == 0 and in_features % 32 == 0 "
                f"(got {out_features}, {in_features})")
    return None


@functools.cache
def _cuda_int4_ok() -> bool:
    """The CUDA packing (nibble order, tiles) has changed across torch versions: pack known codes once and
    compare the kernel's product with the dequantized reference; any mismatch keeps int4 off CUDA."""
    try:
        g = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (64, 128), dtype=torch.uint8, generator=g)
        scale = torch.rand(64, 4, generator=g) / 8 + 0.01
        zero = torch.randn(64, 4, generator=g) / 8
        m = Int4Linear.from_codes(codes, scale, zero, torch.bfloat16, "cuda")
        sz = m.scale_zero.float().cpu()
        w = (codes.float().view(64, 4, 32) - 8) * sz[..., 0].T[..., None] + sz[..., 1].T[..., None]
        x = torch.randn(2, 128, generator=g).bfloat16()
        want = x.float() @ w.view(64, 128).T
        got = m._kernel(x.cuda()).float().cpu()
        return bool((got - want).abs().max() <= 1e-2 * want.abs().max())
    except (RuntimeError, NotImplementedError, ValueError):
        return False


def int8_problem(device) -> str | None:
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return "this torch build has no int8 weight-only kernel"
    if torch.device(device).type not in ("cpu", "cuda"):
        return f"no int8 kernel on {torch.device(device).type}"
    return None


def _inner_k_tiles(k: int) -> int:
    """CUDA tinygemm: K must be a multiple of inner_k_tiles * 16; the largest that divides is fastest."""
    return next(t for t in (8, 4, 2) if k % (t * 16) == 0)


# ---- the view that `module.weight` returns -------------------------------------------------------------
class DequantizedView(torch.Tensor):
    """The logical weight of a quantized module: shape, dtype and device without storage. Any operation
    on it runs on the dequantized weight; an in-place write into it raises."""

    @staticmethod
    def __new__(cls, module, shape, dtype, device):
        view = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        view._module = module
        return view

    def __repr__(self):
        return f"DequantizedView({type(self._module).__name__}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def dequantize(self) -> torch.Tensor:
        return self._module.dequantize(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        specs = func._schema.arguments
        by_name = [(next((a for a in specs if a.name == k), None), v) for k, v in kwargs.items()]
        passed = list(zip(specs, args)) + by_name
        for spec, arg in passed:
            if isinstance(arg, cls) and spec is not None and spec.alias_info is not None and spec.alias_info.is_write:
                raise RuntimeError(f"{func}: quantized weights are read-only "
                                   "(dequantize into a dense module to edit them)")
        unwrap = lambda t: t.dequantize() if isinstance(t, cls) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def _frozen(t: torch.Tensor | None) -> nn.Parameter | None:
    """A parameter that is never trained: counted by `parameters()` (bytes, weight streaming) like any other."""
    return None if t is None else nn.Parameter(t, requires_grad=False)


# ---- int4 ----------------------------------------------------------------------------------------------
class Int4Linear(nn.Module):
    """y = x @ W^T + b with W group-wise 4-bit: w = (code - 8) * scale + zero per group of inputs.

    packed        uint8, the kernel's layout for `device` (CPU: [N, K/2]; CUDA: tinygemm's int32 tiles)
    scale_zero    [K/group, N, 2] in the compute dtype (the kernel reads scales and zeros interleaved)
    bias          [N] in the compute dtype, or None
    """

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, in_features: int, out_features: int,
                 group: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.packed = _frozen(packed)
        self.scale_zero = _frozen(scale_zero)
        self.bias = _frozen(bias)
        self.joins: tuple = ()  # the modules this one joins (`joined`), whose codes are views of its own

    # -- constructors --
    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype,
                   device="cpu", bias: torch.Tensor | None = None) -> "Int4Linear":
        """codes [N, K] (0..15), scale and zero [N, K/group] (float32; rounded here to `dtype`):
        w[n, k] = (codes[n, k] - 8) * scale[n, k // group] + zero[n, k // group]."""
        n, k = codes.shape
        group = k // scale.shape[1]
        problem = _int4_shape_problem(n, k, group, device)
        if problem:
            raise ValueError(f"int4 kernel cannot take a [{n}, {k}] weight: {problem}")
        device = torch.device(device)
        codes = codes.to(device=device, dtype=torch.int32)
        if device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        else:
            if dtype != torch.bfloat16:
                raise ValueError("the CUDA int4 kernel computes in bfloat16 only")
            pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # even inputs in the high nibble
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), _inner_k_tiles(k))
        sz = torch.stack((scale.float(), zero.float()), -1).transpose(0, 1).contiguous()
        bias = None if bias is None else bias.to(device=device, dtype=dtype)
        return cls(packed, sz.to(device=device, dtype=dtype), k, n, group, bias)

    @classmethod
    def quantize(cls, weight: torch.Tensor, group: int = GROUP, dtype: torch.dtype = torch.bfloat16, device=None,
                 bias: torch.Tensor | None = None) -> "Int4Linear":
        """Re-quantize a dense weight [N, K] group-wise (min/max per group): codes against the scale and
        zero as the kernel will read them (rounded to `dtype`), so they are as close as those allow."""
        w = weight.detach().float().cpu()
        n, k = w.shape
        g = w.view(n, k // group, group)
        lo, hi = g.amin(-1), g.amax(-1)
        fin = torch.finfo(dtype)
        scale = ((hi - lo) / 15).clamp(min=fin.tiny).to(dtype).float()
        zero = (lo + 8 * scale).to(dtype).float()
        codes = ((g - (zero - 8 * scale)[..., None]) / scale[..., None]).round_().clamp_(0, 15)
        return cls.from_codes(codes.view(n, k).to(torch.uint8), scale, zero, dtype, device or weight.device, bias)

    @classmethod
    def from_gguf_blocks(cls, raw, qtype: str, dtype: torch.dtype, device="cpu", bias=None) -> "Int4Linear":
        """GGUF Q4_0 or Q4_1 rows [N, K/32 * block bytes] (uint8, as `gguf.GGUFReader` gives them)."""
        codes, scale, zero = decode_q4(raw, qtype)
        return cls.from_codes(codes, scale, zero, dtype, device, bias)

    @classmethod
    def joined(cls, parts: tuple) -> "Int4Linear | None":
        """One module whose single kernel call gives every part's outputs, concatenated (a layer's q, k and v;
        gate and up): where each part is a multiple of 64 outputs in the CPU's AVX512 layout, the packed codes
        of the parts laid end to end are the joined weight's, so they are concatenated once and each part's
        codes become a view of them (no second copy; the scales, a quarter of the codes' bytes, are copied).
        Its `joins` are the parts. None where the parts differ in inputs, group, dtype or bias, or where
        the layout is another (CUDA's tiles, a last block of fewer than 64 rows)."""
        first = parts[0]
        if (first.packed.device.type != "cpu" or not _cpu_layout_known()
                or any(p.out_features % _CPU_BLOCK_N for p in parts)
                or any((p.in_features, p.group, p.scale_zero.dtype, p.bias is None)
                       != (first.in_features, first.group, first.scale_zero.dtype, first.bias is None)
                       for p in parts)):
            return None
        packed = torch.cat([p.packed for p in parts])
        scale_zero = torch.cat([p.scale_zero for p in parts], 1)
        bias = None if first.bias is None else torch.cat([p.bias for p in parts])
        out = cls(packed, scale_zero, first.in_features, sum(p.out_features for p in parts), first.group, bias)
        start = 0
        for p in parts:
            p.packed = _frozen(packed[start:start + p.out_features])  # [N, K/2]: rows are outputs
            start += p.out_features
        out.joins = tuple(parts)
        return out

    # -- reading --
    @property
    def weight(self) -> DequantizedView:
        return DequantizedView(self, (self.out_features, self.in_features), self.scale_zero.dtype, self.packed.device)

    def codes(self) -> torch.Tensor:
        """uint8 [N, K] codes 0..15 (unpacked from the kernel's layout)."""
        if self.packed.device.type == "cpu" and _cpu_layout_known():
            return _unpack_cpu(self.packed, self.out_features, self.in_features)
        raise NotImplementedError("codes() reads the AVX512 CPU layout only")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [N, K] in `dtype` (default: the compute dtype), computed in float32 as the kernel does."""
        dtype = dtype or self.scale_zero.dtype
        n, k, g = self.out_features, self.in_features, self.group
        if self.packed.device.type == "cpu" and _cpu_layout_known():
            # code * scale is exact in float32 and one rounding adds the base (zero - 8 scale: a GGUF's m):
            # a Q4_1 file's own d * q + m, within a float32 ulp of the kernel's (code - 8) * scale + zero.
            # In-place ops: ~3x faster here than an addcmul broadcasting a scale over each group
            sz = self.scale_zero.float()
            scale = sz[..., 0].T.contiguous()[..., None]
            base = (sz[..., 1] - 8 * sz[..., 0]).T.contiguous()[..., None]
            w = _unpack_cpu(self.packed, n, k).view(n, k // g, g).float().mul_(scale).add_(base)
            return w.view(n, k).to(dtype)
        # any other layout: the kernel itself against the identity (one nonzero term per output: exact
        # in its float32 accumulation, then rounded to the compute dtype)
        eye = torch.eye(k, dtype=self.scale_zero.dtype, device=self.packed.device)
        return self._kernel(eye).T.to(dtype).contiguous()

    # -- compute --
    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        if self.packed.device.type == "cpu":
            if int4_gemv.takes(x2, self.out_features) and _cpu_layout_known():
                return int4_gemv.int4_gemv(x2, self.packed, self.group, self.scale_zero)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scale_zero)
        return torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group, self.scale_zero)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(self, x, self.scale_zero)
        rows = x.numel() // self.in_features
        chunked = _in_chunks_as_alone(self, x, rows)
        if chunked is not None:
            return chunked
        if rows > DENSE_ROWS and (self.packed.device.type != "cpu" or _cpu_layout_known()):
            return F.linear(x, _dense_weight(self, x.dtype), self.bias)
        y = self._kernel(x.reshape(rows, self.in_features).contiguous())
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, "
                f"dtype={self.scale_zero.dtype}, bias={self.bias is not None}")


def _unpack_cpu(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Codes [N, K] from `_convert_weight_to_int4pack_for_cpu`'s AVX512 layout: blocks of 64 output rows,
    [K, 32] bytes each, byte j holding row j (low nibble) and row j + 32 (high); a last block of 16, 32
    or 48 rows holds row pairs (2i low, 2i + 1 high) [K, rows/2]."""
    flat = packed.reshape(-1)
    full = n // _CPU_BLOCK_N * _CPU_BLOCK_N
    parts = []
    if full:
        q = flat[: full * k // 2].view(full // _CPU_BLOCK_N, k, 32)
        parts.append(torch.stack((q & 15, q >> 4), 1).transpose(2, 3).reshape(full, k))
    if n > full:
        t = n - full
        q = flat[full * k // 2:].view(k, t // 2)
        parts.append(torch.stack((q & 15, q >> 4), -1).reshape(k, t).T)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@functools.cache
def _cpu_layout_known() -> bool:
    """Whether this torch build packs int4 weights in the AVX512 layout `_unpack_cpu` reads (AVX2 and
    scalar builds use other layouts): checked once on a block of 64 rows plus a tail of 16."""
    if not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        return False
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (80, 64), dtype=torch.int32, generator=g)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    except RuntimeError:
        return False
    return packed.numel() * 2 == codes.numel() and torch.equal(_unpack_cpu(packed, 80, 64).int(), codes)


def _check_input(module, x: torch.Tensor, ref: torch.Tensor) -> None:
    if x.dtype != ref.dtype or x.device != ref.device:
        raise RuntimeError(f"{type(module).__name__} holds {ref.dtype} scales on {ref.device}; "
                           f"got a {x.dtype} input on {x.device}")


# ---- int8 ----------------------------------------------------------------------------------------------
class Int8Linear(nn.Module):
    """y = x @ W^T + b with W per-row symmetric 8-bit: w = code * scale[row], codes in -127..127.

    qweight  int8 [N, K];  scales [N] in the compute dtype;  bias [N] or None
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.qweight = _frozen(qweight)
        self.scales = _frozen(scales)
        self.bias = _frozen(bias)

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16, device=None,
                 bias: torch.Tensor | None = None) -> "Int8Linear":
        """Per output row: scale = max|w| / 127 (rounded to `dtype`), code = round(w / scale)."""
        w = weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp(min=torch.finfo(dtype).tiny).to(dtype).float()
        q = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        device = device or weight.device
        bias = None if bias is None else bias.to(device=device, dtype=dtype)
        return cls(q.to(device), scale.to(device=device, dtype=dtype), bias)

    @classmethod
    def from_gguf_blocks(cls, raw, qtype: str, dtype: torch.dtype, device="cpu", bias=None) -> "Int8Linear":
        """GGUF Q8_0 rows: one scale per 32 inputs in the file, one per row in the kernel: re-quantized."""
        return cls.quantize(decode_q8_0(raw), dtype, device, bias)

    @property
    def weight(self) -> DequantizedView:
        return DequantizedView(self, (self.out_features, self.in_features), self.scales.dtype, self.qweight.device)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.scales.dtype
        return (self.qweight.float() * self.scales.float()[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(self, x, self.scales)
        rows = x.numel() // self.in_features
        chunked = _in_chunks_as_alone(self, x, rows)
        if chunked is not None:
            return chunked
        if rows > DENSE_ROWS or not _int8_kernel_ok(x.device.type):
            return F.linear(x, _dense_weight(self, x.dtype), self.bias)
        flat = x.reshape(rows, self.in_features).contiguous()
        if int4_gemv.takes_int8(flat, self.in_features):
            y = int4_gemv.int8_gemv(flat, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.scales.dtype}, "
                f"bias={self.bias is not None}")


@functools.cache
def _int8_kernel_ok(device_type: str) -> bool:
    """Whether `_weight_int8pack_mm` runs here (CUDA support depends on the build): tried once."""
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return False
    try:
        dt = torch.bfloat16
        x = torch.ones(1, 32, dtype=dt, device=device_type)
        y = torch.ops.aten._weight_int8pack_mm(x, torch.ones(8, 32, dtype=torch.int8, device=device_type),
                                               torch.ones(8, dtype=dt, device=device_type))
        return bool((y.float() == 32).all())
    except (RuntimeError, NotImplementedError):
        return False


class Int8Embedding(nn.Module):
    """Rows of an int8 table: embedding(ids) = qweight[ids] * scales[ids]. Built on an `Int8Linear`, whose
    parameters it shares (a tied embedding and output layer hold one table)."""

    def __init__(self, table: Int8Linear):
        super().__init__()
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.qweight, self.scales = table.qweight, table.scales

    @property
    def weight(self) -> DequantizedView:
        return DequantizedView(self, (self.num_embeddings, self.embedding_dim), self.scales.dtype, self.qweight.device)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.scales.dtype
        return (self.qweight.float() * self.scales.float()[:, None]).to(dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight[ids].float() * self.scales[ids].float()[..., None]
        return rows.to(self.scales.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.scales.dtype}"


# ---- GGUF blocks ---------------------------------------------------------------------------------------
# ggml block layouts (little-endian): Q4_0 = f16 d, 16 bytes of nibbles; Q4_1 = f16 d, f16 m, 16 bytes;
# Q8_0 = f16 d, 32 int8. In a 4-bit block, byte j holds element j (low nibble) and element j + 16 (high).
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # per block of 32 weights
_Q4_BYTES = {k: v for k, v in BLOCK_BYTES.items() if k != "Q8_0"}
_Q8_0_BYTES = BLOCK_BYTES["Q8_0"]


def _rows(raw) -> torch.Tensor:
    """uint8 [N, row bytes] as a writable torch tensor (GGUFReader hands out read-only memory maps)."""
    t = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)) if not isinstance(raw, torch.Tensor) else raw
    if t.dtype != torch.uint8 or t.dim() != 2:
        raise ValueError(f"expected uint8 rows [N, bytes], got {t.dtype} {tuple(t.shape)}")
    return t.cpu().contiguous()


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> float32 [...]."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def decode_q4(raw, qtype: str):
    """GGUF Q4_0/Q4_1 rows -> (codes uint8 [N, K], scale [N, K/32], zero [N, K/32]) in tinygemm's
    convention w = (code - 8) * scale + zero (float32, exact: d and m are float16)."""
    if qtype not in _Q4_BYTES:
        raise ValueError(f"not a 4-bit GGUF type: {qtype}")
    rows = _rows(raw)
    size = _Q4_BYTES[qtype]
    if rows.shape[1] % size:
        raise ValueError(f"{qtype} rows of {rows.shape[1]} bytes are not whole blocks of {size}")
    b = rows.view(rows.shape[0], -1, size)
    d = _f16(b[..., 0:2])
    qs = b[..., size - 16:]
    codes = torch.cat((qs & 15, qs >> 4), -1).flatten(1)  # elements 0..15 low nibbles, 16..31 high
    zero = _f16(b[..., 2:4]) + 8 * d if qtype == "Q4_1" else torch.zeros_like(d)
    return codes, d, zero


def decode_q8_0(raw) -> torch.Tensor:
    """GGUF Q8_0 rows -> float32 weights [N, K] (d * q, exact)."""
    rows = _rows(raw)
    if rows.shape[1] % _Q8_0_BYTES:
        raise ValueError(f"Q8_0 rows of {rows.shape[1]} bytes are not whole blocks of {_Q8_0_BYTES}")
    b = rows.view(rows.shape[0], -1, _Q8_0_BYTES)
    q = b[..., 2:].contiguous().view(torch.int8).float()
    return (q * _f16(b[..., 0:2])[..., None]).flatten(1)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage counted once (tied tables, shared views)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def parameter_count(module: nn.Module) -> int:
    """Parameters as the model defines them (a quantized weight counts its N x K entries, not its packed
    bytes and scales), tied tensors once."""
    stored, tables, total = set(), set(), 0
    for m in module.modules():
        if isinstance(m, Int4Linear):
            parts = (m.packed, m.scale_zero)
            if m.joins:  # its entries are its parts'
                stored.update(id(p) for p in (*parts, m.bias))
                continue
        elif isinstance(m, (Int8Linear, Int8Embedding)):
            parts = (m.qweight, m.scales)
        else:
            continue
        stored.update(id(p) for p in parts)
        if id(parts[0]) not in tables:  # a tied embedding and output layer share one table
            tables.add(id(parts[0]))
            total += m.weight.shape.numel()
    return total + sum(p.numel() for p in module.parameters() if id(p) not in stored)
