"""A decoding step's weight products: a few rows times a group-wise 4-bit weight in torch's AVX-512 CPU int4 layout,
as the native op `torch.ops.infinigen.int4_gemv` (int4_gemv.cpp beside it, built on first use: native_build).

Per weight it adds code * x once (bfloat16 activations: `vdpbf16ps`, two inputs per instruction; float32: fused
multiply-adds) and applies each group's scale and base (zero - 8 scale) once per group, where torch's kernel
dequantizes every weight (a multiply-add) before its multiply-add. No activation is quantized: the products of
the codes and the activations are exact in float32, and the sums are float32 as in torch's kernel (a different
order: float32 results agree within its rounding, bfloat16 outputs within one rounding).

`Int4Linear` calls it where it `takes` the call (rows <= MAX_ROWS, outputs in whole 64-row blocks, a CPU
with AVX-512, and with AVX512-BF16 and VBMI for bfloat16 inputs) and torch's `_weight_int4pack_mm_for_cpu`
elsewhere, which is also the reference the tests compare it with. Being an op with a fake implementation, it is
traced into the compiled step like any aten op. Without a build: one warning line, torch's kernel.

`int8_gemv` does the same for an int8 table with one scale per output row (the output layer): each code widened
to float32 once and multiplied with x in float32, the rows' codes prefetched ahead of the arithmetic (what makes it
faster than torch's `_weight_int8pack_mm`, which reads the same bytes), times the row's scale at the end."""
from __future__ import annotations

import functools
import threading
from pathlib import Path

import torch

from ..machine import cpu_flags
from .native_build import load_library

_SOURCE = Path(__file__).with_name("int4_gemv.cpp")
enabled = True  # False: torch's kernel everywhere (read when a call is made or traced; benchmarks compare the two)
MAX_ROWS = 8  # rows beyond this: torch's kernel (a decoding batch of at most 8)
BLOCK_N = 64  # outputs per block of the layout: the kernel takes whole blocks only
ATTEND_MAX_G = 8  # decode_attend: query heads per KV head


_registering = threading.Lock()


@functools.cache
def _dtypes() -> frozenset:
    """The input dtypes this machine's build computes (empty: none, or the build failed), as the source's
    preprocessor tests decide them from -march=native."""
    # The cache does not keep two first callers apart: the lock makes the second wait for the first's build and
    # registration, which it then repeats at no cost (native_build loads the library once per process, and a
    # fake implementation registered again replaces the same one).
    with _registering:
        flags = cpu_flags()
        if "avx512f" not in flags or not load_library("int4_gemv", _SOURCE):
            return frozenset()
        torch.library.register_fake("infinigen::int4_gemv", _fake)
        torch.library.register_fake("infinigen::int8_gemv", _fake_int8)
        torch.library.register_fake("infinigen::decode_attend", _fake_attend)
        bf16 = {"avx512_bf16", "avx512vbmi", "avx512bw"} <= flags
        return frozenset({torch.float32, torch.bfloat16} if bf16 else {torch.float32})


def _fake(x, packed, group, scale_zero):
    return x.new_empty(x.shape[0], packed.shape[0])


def _fake_int8(x, qweight, scales):
    return x.new_empty(x.shape[0], qweight.shape[0])


def _fake_attend(q, keys, values, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def takes(x2: torch.Tensor, out_features: int) -> bool:
    """Whether the native kernel computes x2 [rows, K] times a CPU int4 weight of `out_features` outputs."""
    return (enabled and x2.shape[0] <= MAX_ROWS and out_features % BLOCK_N == 0 and x2.device.type == "cpu"
            and x2.dtype in _dtypes())


def int4_gemv(x2: torch.Tensor, packed: torch.Tensor, group: int, scale_zero: torch.Tensor) -> torch.Tensor:
    """x2 [rows, K] (float32 or bfloat16) times the weight held as `packed` [N, K/2] and `scale_zero`
    [K/group, N, 2] in torch's CPU layout: [rows, N] in x2's dtype."""
    return torch.ops.infinigen.int4_gemv(x2, packed, group, scale_zero)


def takes_int8(x2: torch.Tensor, in_features: int) -> bool:
    """Whether the native kernel computes x2 [rows, K] times an int8 table (one scale per row)."""
    return (enabled and x2.shape[0] <= MAX_ROWS and in_features % 16 == 0 and x2.device.type == "cpu"
            and x2.dtype in _dtypes())


def int8_gemv(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x2 [rows, K] times qweight [N, K] int8 with scales [N] (x2's dtype): [rows, N], each output the float32
    sum of code * x times its row's scale, rounded once to x2's dtype."""
    return torch.ops.infinigen.int8_gemv(x2, qweight, scales)


def takes_attend(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the native kernel attends one token per row, q [B, H, 1, d], over keys [B, Hkv, L, d]: bfloat16 on
    a CPU with AVX512-BF16, a head size of 64 or 128, at most ATTEND_MAX_G query heads per KV head."""
    return (enabled and q.device.type == "cpu" and q.dtype == torch.bfloat16 == keys.dtype
            and q.dim() == 4 and q.shape[2] == 1 and q.shape[3] in (64, 128) and q.shape[1] % keys.shape[1] == 0
            and q.shape[1] // keys.shape[1] <= ATTEND_MAX_G and torch.bfloat16 in _dtypes())


def decode_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One token's attention per row: q [B, H, 1, d] over keys and values [B, Hkv, L, d] (any strides but the
    last; G = H / Hkv query heads share a KV head): softmax(scale * q k^T) v as [B, H, 1, d] in q's dtype, the
    scores, exps and sums in float32 (the products of bfloat16 values exact), rounded once."""
    return torch.ops.infinigen.decode_attend(q, keys, values, scale)


def available(dtype: torch.dtype) -> bool:
    """Whether this machine's build computes inputs of `dtype` (builds it on the first call)."""
    return dtype in _dtypes()
