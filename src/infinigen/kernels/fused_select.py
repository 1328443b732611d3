"""A decoding step's attention over the rows a selection packs (`KVStore.select_rows`), as one C++ call, and
InfiniGen's layer-capped selection that packs them straight from the speculated scores (`select_packed`).

For each (batch row, KV head) the kernel reads each chosen key and value row once from the layer's flat
store, scores it against every query head of that KV head and folds it into an online softmax (blocks of
32 rows, float32 accumulation), then reads the token's own row last. It returns the output, the
log-sum-exp of the scaled scores (the remainder is applied from it) and the float32 sum of the past values
read, with no gathered copy of the rows and no [B, H, rows] score or mask tensor.

`select_packed` takes a layer's speculated scores [B, Hkv, G, n] and makes, in one pass per (batch row, KV
head) and a partial selection (no sort) per batch row over its cap, what `_choose` (budget "layer"),
`KVStore.select_rows` and the remainder's log-sum-exp make in some two hundred torch calls.

Built on first use with torch's cpp_extension (-O3, OpenMP through `at::parallel_for`, -march=native so
AVX-512 is used where the CPU has it) into the cache (`cache_dir()/kernels/...`, keyed by the torch
version and the CPU's flags, so a shared cache never serves a build for another CPU). Where no compiler
or build works, `available()` is False after one warning line and callers keep the torch path, which is
also the reference the tests compare this kernel with.

On CUDA tensors `attend_rows` runs the same computation as a Triton kernel (`fused_select_triton`); where
triton is not installed `usable()` is False on CUDA after one warning line, and callers keep the torch path.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from . import native_build

_SOURCE = Path(__file__).with_name("fused_select.cpp")
enabled = True  # False: callers take the torch path (benchmarks compare the two in one process)
packs_selection = True  # False: the selection stays in torch, only the attention is fused (a benchmark's middle row)
scores_with_selection = True  # False: `score_int4` then `select_packed`, two calls (benchmarks compare the two)
# the most rows of one (batch row, KV head) one task attends: longer runs are cut into parts merged by log-sum-exp,
# so one batch row's few KV heads keep every thread busy
ROWS_PER_PART = 256
SLOTS_PER_PART = 2048  # the most slots of one (batch row, KV head) one task scores (whole 64-slot blocks)
_NONE = torch.empty(0)  # an optional tensor argument left out


def build_key() -> str:
    """A short hash of what the native build depends on: torch, the machine, the CPU's flags and the source
    (also what keys a measurement of its speed: policies/crossing.py)."""
    return native_build.build_key(_SOURCE)


@functools.cache
def _module():
    """The built extension, or None (after one warning line) where it cannot be built or loaded."""
    return native_build.load("fused_select", _SOURCE, python_module=True)


def available() -> bool:
    """Whether the kernel is enabled and built (builds it on the first call)."""
    return enabled and _module() is not None


@functools.cache
def _triton_kernel():
    """The Triton module for CUDA tensors, or None (after one warning line) where triton is not installed."""
    try:
        from . import fused_select_triton
        return fused_select_triton
    except ImportError as e:
        print(f"infinigen: the fused selection kernel for CUDA needs triton ({e}); using the torch path",
              file=sys.stderr)
        return None


def usable(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `attend_rows` can take these tensors: one floating dtype, one device, and on the CPU the C++
    kernel built, on CUDA triton installed."""
    if q.dtype != keys.dtype or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if q.is_cpu:  # (the flags, not device objects: this is asked at every selecting layer)
        return keys.is_cpu and available()
    if q.device != keys.device:
        return False
    return q.device.type == "cuda" and enabled and _triton_kernel() is not None


def native_rows(q: torch.Tensor) -> bool:
    """Whether `attend_rows` runs the C++ kernel for q (on a CPU): it then takes q [B, H, 1, d] as it is and mixes a
    remainder in; the Triton kernel (CUDA) takes q [B, H, d] and leaves the remainder to the caller."""
    return not q.is_cuda


def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
                counts: torch.Tensor, own: torch.Tensor | None, scale: float, part_rows: int | None = None,
                remainder=None, far=None):
    """q [B, H, d]; keys, values [N, d] (a layer's flat store); rows [B, n] int64, each batch row's selected rows
    head-major (`SelectedRows.rows`: KV head 0's run first, padding after the last run); counts [B, Hkv] the
    runs' lengths; own [B, Hkv] the token's own row, read after the run (None: no own row).
    Returns out [B, H, d] (q's dtype), lse [B, H] and read_sum [B, Hkv, d] (float32; past rows only).
    A (batch row, KV head) that reads nothing gets a zero output and a log-sum-exp of -inf. A run longer than
    `part_rows` (None: `ROWS_PER_PART`) is attended in parts (by both threads at batch 1) merged by log-sum-exp;
    the parts depend on the counts alone. `remainder` (CPU only): a `selection.Remainder` of one decoding row per
    batch row (lse [B, Hkv, G, 1], sums [B, Hkv, d], counts [B, Hkv]) mixed into out as
    `runtime.attention.with_remainder` mixes it, in the same call (lse and read_sum stay those of what was read).
    On CUDA tensors the Triton kernel computes it (indices unchecked there: a check would wait on the device); there
    `far` (keys, values, split) names a second source, read from row `split` on (`HandedRows.far`)."""
    if q.is_cuda:
        if remainder is not None:
            raise ValueError("the Triton kernel does not mix a remainder in")
        return _triton_kernel().attend_rows(q, keys, values, rows, counts, own, scale, far=far)
    if far is not None:
        raise ValueError("a far source is read by the Triton kernel (CUDA) only")
    own = rows.new_empty(0) if own is None else own
    part_rows = part_rows or ROWS_PER_PART
    lse, sums, cached = (_NONE, _NONE, _NONE) if remainder is None else remainder
    return _module().attend_rows(q, keys, values, rows, counts, own, float(scale), int(part_rows), lse, sums,
                                 cached)


def gather_rows(near: torch.Tensor, far: torch.Tensor, split: int, index: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `index` of `near`, an index of `split` or more reading row (index - split) of `far` (`HandedRows.far`:
    pinned host memory, which the GPU reads over the bus): the Triton kernel's gather, for a caller that gathers a
    far source's rows before attending."""
    return _triton_kernel().gather_rows(near, far, split, index, out)


def score_int4(q: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, group: int, n: int,
               part_slots: int | None = None, rotation: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hkv, G, d] (any floating dtype, rounded to bfloat16 as the int4 kernel takes it) against 4-bit keys in
    torch's CPU int4 layout (codes [B, Hkv, blocks * 64, d / 2] uint8, scale-and-zero sz [B, Hkv, d / group,
    capacity, 2] bfloat16; kernels/int4.py "tinygemm") -> float32 [B, Hkv, G, n]: that kernel's scores of the first
    n slots, every (batch row, KV head) in one parallel region instead of a call each from Python (the same bits),
    each cut into tasks of `part_slots` slots (None: `SLOTS_PER_PART`). `rotation` [Hkv, d, d] float64: q is first
    rotated by its KV head's matrix in float64 and rounded to float32 (InfiniGen's skew,
    `speculation.SpeculationKeys.rotate`), in the same call."""
    return _module().score_int4(q, codes, sz, int(group), int(n), int(part_slots or SLOTS_PER_PART),
                                _NONE if rotation is None else rotation)


def score_select(q: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, group: int, n: int, scale: float,
                 alpha: float, total: int, capacity: int, with_lse: bool, rotation: torch.Tensor | None = None,
                 part_slots: int | None = None):
    """`score_int4` then `select_packed` in one call: the scores scaled and each query head's max taken as they are
    written, in the scorer's tasks, then the same selection from them (the same rows, to the bit), no scores tensor
    made. Returns what `select_packed` returns."""
    return _module().score_select(q, codes, sz, int(group), int(n), int(part_slots or SLOTS_PER_PART),
                                  _NONE if rotation is None else rotation, float(scale), float(alpha), int(total),
                                  int(capacity), bool(with_lse))


def scatter_int4(codes: torch.Tensor, sz: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, group: int,
                 rotation: torch.Tensor | None = None) -> None:
    """One token's key per (batch row, KV head), rows [B, Hkv, 1, d] float32 (or any floating dtype with a
    `rotation` [Hkv, d, d] float64: rotated first in float64, rounded to float32, as `score_int4` rotates q),
    quantized and written in place into slots [B, Hkv] of 4-bit keys in torch's CPU int4 layout (codes [B, Hkv,
    blocks, d, 32] uint8, sz [B, Hkv, d / group, capacity, 2] bfloat16): the codes, scale and zero
    `int4.PackedKeys.scatter` writes, in one call."""
    _module().scatter_int4(codes, sz, slots, rows, int(group), _NONE if rotation is None else rotation)


def write_int4(codes: torch.Tensor, sz: torch.Tensor, start: int, keys: torch.Tensor, group: int,
               rotation: torch.Tensor | None = None) -> None:
    """A prompt's keys [B, Hkv, T, d] (any floating dtype), rotated as `scatter_int4` rotates, quantized and written
    into slots start .. start+T-1 of every (batch row, KV head) of the same layout: the bytes T `scatter_int4`
    calls write, in one call (in parallel over 64-slot blocks)."""
    _module().write_int4(codes, sz, int(start), keys, int(group), _NONE if rotation is None else rotation)


def appends(k: torch.Tensor, *store: torch.Tensor) -> bool:
    """Whether `append_token` stores k into a layer's store tensors (keys, values, valid, pos): on a CPU, contiguous,
    k of the keys' dtype, the kernel loaded already (the torch copies store the same bytes, so a first run's decode
    does not wait for the build)."""
    keys, values, valid, pos = store
    return (enabled and k.is_cpu and keys.is_cpu and k.dtype == keys.dtype and keys.is_contiguous()
            and values.is_contiguous() and valid.is_contiguous() and pos.is_contiguous()
            and native_build.loaded("fused_select") and available())


def append_token(keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, pos: torch.Tensor, slot: int,
                 k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
    """One decoding token's k, v [B, Hkv, 1, d] stored at `slot` of a layer's store (keys, values [B, Hkv, capacity,
    d], valid and pos [B, Hkv, capacity], contiguous), its valid mark set and its position (positions [B]) written:
    `KVStore.append`'s copies in one call."""
    _module().append_token(keys, values, valid, pos, int(slot), k, v, positions)


def add_values(sums: torch.Tensor, counts: torch.Tensor, v: torch.Tensor) -> None:
    """A layer's running value sums [B, Hkv, d] float32 and counts [B, Hkv] int64 advanced by one decoding token's
    values v [B, Hkv, 1, d] in place: `sums.add_(v[:, :, 0])` and `counts.add_(1)` (the same bits) in one call where
    the kernel is loaded and the tensors are on a CPU (sums and counts contiguous), else those two adds."""
    if (enabled and sums.is_cpu and v.is_cpu and sums.is_contiguous() and counts.is_contiguous()
            and native_build.loaded("fused_select") and available()):
        _module().add_values(sums, counts, v)
        return
    sums.add_(v[:, :, 0])  # (in float32)
    counts.add_(1)


def select_packed(scores: torch.Tensor, scale: float, alpha: float, total: int, capacity: int, with_lse: bool):
    """scores [B, Hkv, G, n] float32 (the speculated q . k of one decoding row per batch row over a store's first
    n slots, every one valid; overwritten) -> keep [B, Hkv, n] bool, rows [B, m] and head [B, m] int64 (each batch
    row's kept rows of the flat [B * Hkv * capacity, d] store, head-major in ascending slots; padding: row 0, head
    -1), counts [B, Hkv] int64 and lse [B, Hkv, G] float32 (with_lse; else empty): the log-sum-exp of the scaled
    scores left unread, -inf where none is (or each is below e^-87.3 of its head's max: an exp that counts 0).

    Per query head relative = scores * scale - max; a slot is kept where the group's largest relative exceeds
    -alpha; a batch row keeping more than `total` (KV head, slot) pairs keeps exactly the `total` with the most
    mass (sum over the group of exp(relative) / its head's sum), ties to the lower (KV head, slot)."""
    return _module().select_packed(scores, float(scale), float(alpha), int(total), int(capacity), bool(with_lse))


def select_packed_rows(scores: torch.Tensor, totals: torch.Tensor, scale: float, alpha: float, capacity: int,
                       with_lse: bool):
    """`select_packed` with one cap per batch row (totals [B] int64): teacher-forced rows of one sequence as a
    batch, each row's slots past its own length scored -inf (never kept, no mass)."""
    return _module().select_packed_rows(scores, totals, float(scale), float(alpha), int(capacity), bool(with_lse))
