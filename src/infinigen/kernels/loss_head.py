"""Calibration's loss head after its bfloat16 product (`calibrate.head_nll` over a large vocabulary: Gemma 3's 262144
tokens) as one C++ call (loss_head.cpp beside it): per row of the bfloat16 logits, its largest k, its max and the sum
of exp(logit - max) over the rest, read from the bfloat16 row in two passes, the k and the target's logit recomputed
in float32, and the target's NLL; rows in parallel. The torch path it replaces copies the logits to float32, ranks
them with topk, gathers the weight rows of those it recomputes and takes the log-sum-exp in three more passes.

Built on first use by native_build (-O3 -march=native, OpenMP) into the cache. Where it cannot be built,
`available()` is False after one warning line and `head_nll` keeps the torch path, the reference the tests compare it
with: the same largest logits (where equal logits straddle the k-th, the lower indices), the loss within float32
summation order and a 2-ulp exp (the sum of the rest accumulated in float64 per block of logits).
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from . import native_build

_SOURCE = Path(__file__).with_name("loss_head.cpp")
enabled = True  # False: `head_nll` takes the torch path (benchmarks compare the two in one process)


@functools.cache
def _module():
    """The built extension, or None (after one warning line) where it cannot be built or loaded."""
    return native_build.load("loss_head", _SOURCE, python_module=True)


def available() -> bool:
    """Whether the kernel is enabled and built (builds it on the first call)."""
    return enabled and _module() is not None


def usable(logits: torch.Tensor, cap: float | None) -> bool:
    """Whether `row_nll` takes these logits: bfloat16 rows on the CPU, each contiguous, no softcap, the kernel
    built."""
    return (cap is None and logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and logits.dim() == 2
            and logits.stride(1) == 1 and available())


def row_nll(logits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, k: int):
    """logits [n, vocab] bfloat16 (h @ weight.T as a bfloat16 product), h [n, d] and weight [vocab, d] float32,
    targets [n] -> (nll [n] float32: each row's -log softmax at its target, with its k largest logits and its
    target's recomputed in float32 (h . weight[j]) and the rest as `logits` holds them; top [n, k] int64: those k
    largest logits' indices, larger first, equal ones the lower index first; finite [n] bool: False where a logit of
    the row is infinite or NaN, that row's nll and top then unset)."""
    return _module().row_nll(logits, h, weight, targets, int(k))
