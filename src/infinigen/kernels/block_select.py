"""InfiniGen's layer-capped selection in blocks of slots as one C++ call (`select_blocks`, block_select.cpp beside
it): from a layer's speculated scores to the chosen slots, the packed rows the attention reads and the remainder's
log-sum-exp, what `infinigen_select.choose_blocks` (with the rest of `choose`), `KVStore.select_rows` and
`remainder_lse` make in some hundred torch calls per layer. The disk tier in blocks runs it twice per layer and
step: the speculation one layer ahead and the layer's own query (the correction).

Built on first use by native_build (-O3 -march=native, OpenMP) into the cache. Where it cannot be built,
`available()` is False after one warning line and callers keep the torch path, which is also the reference the
tests compare it with: the same choice, but for blocks whose masses lie within float32 summation order of each
other at the cut.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from . import native_build

_SOURCE = Path(__file__).with_name("block_select.cpp")
enabled = True  # False: callers take the torch path (benchmarks compare the two in one process)


@functools.cache
def _module():
    """The built extension, or None (after one warning line) where it cannot be built or loaded."""
    return native_build.load("block_select", _SOURCE, python_module=True)


def available() -> bool:
    """Whether the kernel is enabled and built (builds it on the first call)."""
    return enabled and _module() is not None


def select_blocks(scores: torch.Tensor, scale: float, alpha: float, total: int, block: int, capacity: int,
                  with_lse: bool, pack: bool = True):
    """scores [B, Hkv, G, n] float32 (one decoding row per batch row over a store's first n slots, every one
    valid; overwritten) -> keep [B, Hkv, n] bool, rows [B, m] and head [B, m] int64 (with `pack`: each batch row's
    kept rows of the flat [B * Hkv * capacity, d] store, head-major in ascending slots; padding: row 0, head -1;
    else [B, 0]), counts [B, Hkv] int64 and lse [B, Hkv, G] float32 (with_lse; else empty): the log-sum-exp of the
    scaled scores left unread.

    Per query head relative = scores * scale - max; a slot qualifies where the group's largest relative exceeds
    -alpha, a block of `block` slots where one of its slots does. A batch row whose qualifying blocks hold more
    than `total` slots keeps its max(1, total // block) blocks with the most mass (the group's weights summed over
    the block; ties to the lower (KV head, block)); else every qualifying block. A kept block is kept whole."""
    return _module().select_blocks(scores, float(scale), float(alpha), int(total), int(block), int(capacity),
                                   bool(with_lse), bool(pack))


def staged_places(held: torch.Tensor, rows: torch.Tensor, head: torch.Tensor, capacity: int, block: int,
                  blocks_per_head: int, unit_rows: int, units: int):
    """Where a packed selection's rows (rows, head [B, m]: `SelectedRows`) lie in a staging buffer of whole units
    (`placement.blocks`: a unit holds `block` slots of one (batch row, KV head) in `unit_rows` rows; id (batch row
    * Hkv + KV head) * blocks_per_head + slot // block, `units` in the layer) whose first units are `held` (ids
    ascending) and whose next ones are to be read -> (the units to read, ids ascending [M]; each packed column's
    row in the buffer [B, m] (padding: the first selected entry's); the selected entries in units to read)."""
    ids, places, missed = _module().staged_places(held, rows, head, int(capacity), int(block), int(blocks_per_head),
                                                   int(unit_rows), int(units))
    return ids, places, int(missed)


def pack_rows(keep: torch.Tensor, capacity: int):
    """keep [B, Hkv, n] bool (every kept slot valid) -> rows, head [B, m] and counts [B, Hkv] int64: the kept slots
    packed as `KVStore.select_rows` packs them (rows of the flat [B * Hkv * capacity, d] store, head-major in
    ascending slots; padding: row 0, head -1), in one call."""
    return _module().pack_rows(keep, int(capacity))


def load_units(fd: int, ids: torch.Tensor, file_base: int, blocks_per_head: int, open_j: int, open: torch.Tensor,
               held: torch.Tensor, held_data: torch.Tensor, dst: torch.Tensor, unit_bytes: int,
               willneed: bool) -> tuple[int, int]:
    """Units `ids` of one layer (within the layer, ascending, int64 [M]) into the first M units of the contiguous
    tensor `dst` (units of `unit_bytes`), each from fast memory where it is there, else from the pool file: an open
    block (id % blocks_per_head == open_j; -1: none) copied from `open` (the layer's open blocks, one unit per
    (batch row, KV head)), a held unit (`held`: ids ascending, their data `held_data`) copied from there, the rest
    read at file unit file_base + id, one positioned read per run of adjacent units, every run announced first
    (POSIX_FADV_WILLNEED, where `willneed`), without the GIL -> (units read from the file, units copied from the
    held ones). A failed read raises OSError."""
    read, copied, err, offset = _module().load_units(int(fd), ids, int(file_base), int(blocks_per_head), int(open_j),
                                                     open, held, held_data, dst, int(unit_bytes), bool(willneed))
    if err == -1:
        raise OSError(f"the KV pool file ended at byte {offset}")
    if err:
        raise OSError(err, os.strerror(err))
    return read, copied


def hold_units(prev: torch.Tensor, prev_data: torch.Tensor, prev_last: torch.Tensor, ids: torch.Tensor,
               added: torch.Tensor, blocks_per_head: int, open_j: int, step: int, hold_steps: int, limit: int,
               unit_bytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`HoldsMisses._hold` of whole units in one call: the units a corrected selection added this step (`ids`,
    ascending, their data the first units of `added`; not an open block, id % blocks_per_head == open_j) merged with
    those held (`prev` ascending, `prev_data`, `prev_last`: the step each was last added), an old one staying while
    not added again and added after step - hold_steps, past `limit` the most recently added first -> the held ids
    (ascending), their data (uint8, `unit_bytes` each) and last steps."""
    return tuple(_module().hold_units(prev, prev_data, prev_last, ids, added, int(blocks_per_head), int(open_j),
                                      int(step), int(hold_steps), int(limit), int(unit_bytes)))
