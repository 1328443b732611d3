"""InfiniGen's re-rank (knob `rerank`) as one C++ call (`rerank_rows`, rerank.cpp beside it): a layer's candidates
(`infinigen_rerank.candidates`) re-ranked by the exact keys and the layer's own query, only their keys read.

Built on first use by native_build (-O3 -march=native, OpenMP) into the cache. Where it cannot be built,
`usable()` is False after one warning line and callers keep the torch path (`infinigen_rerank.rerank_cut`),
which is also the reference the tests compare it with: the same choice, but for candidates whose masses lie within
float32 rounding of each other at the cut.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from . import native_build

_SOURCE = Path(__file__).with_name("rerank.cpp")
enabled = True  # False: callers take the torch path (tests and benchmarks compare the two in one process)


@functools.cache
def _module():
    """The built extension, or None (after one warning line) where it cannot be built or loaded."""
    return native_build.load("rerank", _SOURCE, python_module=True)


def usable(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `rerank_rows` takes these tensors: on a CPU, one floating dtype, the kernel enabled and built."""
    return (enabled and q.is_cpu and keys.is_cpu and q.dtype == keys.dtype
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16) and _module() is not None)


def rerank_rows(cand: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, unread: torch.Tensor, size: torch.Tensor,
                scale: float, capacity: int):
    """cand [B, Hkv, n] bool (the candidates), q [B, Hkv, G, d] (the own query), keys [B, Hkv, >= n, d] (q's dtype),
    unread [B, Hkv, G] float32 (the non-candidates' 4-bit log-mass), size [B] int64 (the pairs each batch row keeps)
    -> keep [B, Hkv, n] bool, rows [B, m] and head [B, m] int64 (the kept rows of the flat [B * Hkv * capacity, d]
    store, head-major in ascending slots; padding: row 0, head -1), counts [B, Hkv] int64, lse [B, Hkv, G] float32
    (unread with the dropped candidates' exact scores added) and beside [B, Hkv] int64 (the candidates dropped).
    A candidate's mass: over its group, exp(q . k * scale) over each query head's sum on the candidates and the
    unread; the `size` with the most are kept, ties to the lower (KV head, slot)."""
    return _module().rerank_rows(cand, q, keys, unread.float(), size.long(), float(scale), int(capacity))
