"""Which precision a model runs in: the compute dtype and how its weights are held (`resolve_precision`).

  dtype    what the runtime computes in. "auto": bfloat16 where the hardware has it (AVX512-BF16 or AMX
           on the CPU, any CUDA GPU), float32 elsewhere.
  weights  how the projection matrices and the embedding / output table are held: "auto" (as a GGUF file
           stores them where a kernel runs them fast), "int4", "int8", or dense ("bf16", "fp32", ...);
           `loading` says what each means for a file.
"""
from __future__ import annotations

import functools

import torch

from .errors import UserError
from .machine import cpu_flags

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
# weights= names: "auto", the two quantized forms, and dense in a dtype (short and long names)
WEIGHTS = {"auto": "auto", "int4": "int4", "int8": "int8", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16"}
WEIGHT_CHOICES = ("auto", "int4", "int8", "bf16", "fp32")


@functools.cache
def _cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): torch's own probe (cpuinfo),
    else the Linux CPU flags."""
    probes = [getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    probes = [p for p in probes if callable(p)]
    if probes:
        return any(p() for p in probes)
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def auto_dtype(device: str | torch.device = "cpu") -> str:
    """What dtype="auto" means on `device`: bfloat16 on any CUDA GPU and on CPUs with AVX512-BF16 or AMX
    (bfloat16 decodes 1.6x and prefills 3.3x faster than float32 there), float32 elsewhere."""
    if torch.device(device).type == "cuda" or _cpu_has_bf16():
        return "bfloat16"
    return "float32"


def resolve_precision(dtype, weights: str, device: str | torch.device = "cpu") -> tuple[torch.dtype, str]:
    """(compute dtype, weight mode) for load's `dtype` and `weights` arguments. The mode is "file" (as a
    GGUF stores them, where a kernel runs them fast), "int4", "int8" or "dense". dtype None: float32, or
    the dtype a dense `weights` names."""
    if not isinstance(weights, str) or weights.lower() not in WEIGHTS:
        raise UserError(f"unknown weights {weights!r}; choose from {', '.join(WEIGHT_CHOICES)}")
    asked, weights = weights, WEIGHTS[weights.lower()]
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise UserError(f"unsupported dtype {dtype}; choose from {', '.join(DTYPE_CHOICES)}")
        dtype = str(dtype).removeprefix("torch.")
    if dtype is None:
        dtype = weights if weights in DTYPES else "float32"
    if dtype not in DTYPE_CHOICES:
        raise UserError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPE_CHOICES)}")
    if dtype == "auto":
        dtype = weights if weights in DTYPES else auto_dtype(device)
    if weights in DTYPES:
        if weights != dtype:
            raise UserError(f"weights {asked!r} means dense {weights} weights, but the dtype is {dtype!r}: dense "
                            f"weights are held in the compute dtype (give the same dtype, or weights 'auto')")
        return DTYPES[dtype], "dense"
    if weights == "auto":
        return DTYPES[dtype], ("file" if dtype == "bfloat16" else "dense")
    if torch.device(device).type == "cuda" and weights == "int4" and dtype != "bfloat16":
        raise UserError(f"int4 weights on CUDA need dtype bfloat16 (the CUDA int4 kernel computes in it), "
                        f"not {dtype!r}")
    return DTYPES[dtype], weights
