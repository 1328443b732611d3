"""The disk tier in blocks: a KV pool file read with positioned reads of whole pages, never through a mapping.

Layout. One file for every layer. A *unit* is a block of `block` consecutive slots of one (layer, batch row,
KV head): their keys, then their values, padded to whole pages, so a unit starts on a page and one read
brings both. Units are numbered (layer, batch row * KV heads + KV head, block), so a (batch row, KV head)'s
blocks follow one another in the file and a run of chosen blocks is one read:

    offset(layer, bh, j) = ((layer * B * Hkv + bh) * blocks_per_head + j) * unit_bytes

Writes. The block a sequence is filling (slot `length // block`, the *open* block) lives in fast memory,
one per (layer, batch row, KV head); it goes to the file in one write of whole pages when it is full, so the
file is never written a row at a time and a write never makes the kernel read a page first. Once the pool is
full (victims), a victim's key and value rows are written in place.

Reads. A layer's selection (read at its attention where the policy selects with the layer's own query, the default
here: `ahead_pays`; a plan known one layer ahead is prefetched on the store's worker thread, like
`OffloadedKVStore`) names slots; the store reads exactly the units they lie in (every run of adjacent units
announced to the kernel first, POSIX_FADV_WILLNEED, so the device has them all in its queue, then positioned reads
into a staging buffer in fast memory, one per run; the open block is copied from memory: `block_select.load_units`,
one native call without the GIL, or `os.preadv` where it is not built). The attention reads the selected rows where
they lie in the staging buffer (`hand_rows`: a unit's keys, then its values, so the values are the same buffer a
block further on), with spare rows for the token after the units; nothing is gathered. A selection made in blocks
of this size reads each unit it names whole; a token-level selection reads every unit one of its tokens lies in.
The file is opened with POSIX_FADV_RANDOM: the kernel reads what is asked, no readahead around it. A layer reading
every used slot (read whole) is handed them as a copy in (batch row, KV head, slot) order instead; a layer behind a
sliding window (Gemma 3's local layers) reads its window as a selection: the units it lies in.

Correction. A layer that selects again with its own query at its attention (`Placement.correct`) reads its rows
in units the prefetch staged where they lie, whether or not the speculation chose those rows, and reads on
demand, in one batch of positioned reads, only the units holding its own rows that the prefetch did not read,
into the same staging buffer after the staged units.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import time

import torch

from ..cache import HandedRows, KVCodec, KVStore, SelectedRows, packed_order, packed_places
from ..errors import UserError
from ..kernels import block_select
from .held import HeldSet
from .rows import layout_for
from .store import OffloadedKVStore, _Job
from .transfer import KV, PAGE, TransferStats, _Buffers, fetch_worker, located
from .tiers import SlowTier


# A positioned read waits for its pages before the next is issued: one request at a time in the device's queue.
# Announcing every run first (POSIX_FADV_WILLNEED starts their reads without waiting) lets the device serve them
# together; the reads then find their pages arriving or arrived.
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)
_NO_UNITS = torch.empty(0, dtype=torch.long)  # no unit staged yet
native_reads = True  # units loaded and held by the native kernel where it is built (tests counting os.preadv: off)


def _native() -> bool:
    """Whether units are loaded and held by the native kernel (`native_reads`, and the kernel built)."""
    return native_reads and block_select.available()


def unit_bytes(block: int, row_bytes: int) -> int:
    """Bytes of one unit: `block` key rows and `block` value rows, padded to whole pages (and to whole rows,
    so the staging buffer is a stack of rows)."""
    step = math.lcm(PAGE, row_bytes)
    return -(-2 * block * row_bytes // step) * step


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _read_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise OSError(f"the KV pool file ended at byte {offset}")
        view, offset = view[n:], offset + n


@contextlib.contextmanager
def _pool_io(folder: str | None, what: str):
    """An OSError of the pool file's reads or writes (a failing disk, a file system gone read-only or full)
    as one line naming the folder: the request it hits fails with it, not the server."""
    try:
        yield
    except OSError as e:
        raise OSError(f"cannot {what} the KV pool file in {folder}: {e.strerror or e}") from e


def _bytes(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes (no copy)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class BlockedKVStore(OffloadedKVStore):
    """`OffloadedKVStore` with the pool on disk in page-aligned blocks (see the module doc); CPU hosts only,
    keys and values as computed (no packed codec), no row cache. A corrected selection reads on demand only the
    units its prefetch did not read (`_corrected`), those its recent steps read on demand too held in fast memory
    (`holds_missed`: the units, as `OffloadedKVStore` holds rows)."""
    # The host's cores both compute and copy the units (from the page cache, or wait for the device): a speculation
    # one layer ahead costs its scoring and the units it reads that the own query does not want, and hides nothing.
    # Measured (results/sessions_step/on_disk.md): 16 sessions x 3000 tokens under a 2 GiB bound, the own query
    # reading its units at the attention 418-504 ms a step, the speculation prefetched and corrected 716-802 ms.
    ahead_pays = False

    def __init__(self, num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", codec: KVCodec | None = None,
                 allocator=None, tier: SlowTier | None = None, prefetch: bool = True, threaded: bool = True,
                 stats: TransferStats | None = None, block: int = 16):
        if torch.device(device).type != "cpu":
            raise UserError("the block layout of the disk tier runs on a CPU host; behind a GPU use the cpu tier")
        if tier is None or tier.kind != "disk":
            raise UserError("the block layout needs the disk tier")
        self.layout = layout_for(codec, head_dim, dtype, pack=False)
        self.block = block
        self.row_bytes = self.layout.row_bytes
        self.unit = unit_bytes(block, self.row_bytes)
        self.unit_rows = self.unit // self.row_bytes
        self.capacity, self.bulk_share = capacity, 1.0
        self.codec = codec or KVCodec()
        self.allocator = allocator
        self.fast = torch.device("cpu")
        self.cuda = False
        self.tier = tier
        self.packed = False
        self.num_layers, self.batch, self.kv_heads = num_layers, batch, kv_heads
        self.head_dim, self.dtype = head_dim, dtype
        self.bh = batch * kv_heads
        self.blocks_per_head = -(-capacity // block)
        self.fd = tier.file(num_layers * self.bh * self.blocks_per_head * self.unit)
        meta = (batch, kv_heads, capacity)
        self.valid = [torch.zeros(meta, dtype=torch.bool) for _ in range(num_layers)]
        self.pos = [torch.full(meta, -1, dtype=torch.long) for _ in range(num_layers)]
        self.length = [0] * num_layers
        self.padded = False
        # no float view of the pool: policies that look at store.k for its shape and device get a placeholder
        ph = torch.zeros((), dtype=dtype).expand(batch, kv_heads, capacity, head_dim)
        self.k = self.v = [ph] * num_layers
        # the open block of every (layer, batch row, KV head), laid out as its unit
        self.open = torch.zeros(num_layers, self.bh, self.unit_rows, head_dim, dtype=dtype)
        self.stats = stats or TransferStats()
        meta_bytes = sum(t.numel() * t.element_size() for t in self.valid + self.pos) + self.open.nbytes
        self.buffers = _Buffers(self.fast, self.stats, meta_bytes)
        self.stats.peak_fast_bytes = max(self.stats.peak_fast_bytes, meta_bytes)
        self.row_cache = None
        self.prefetch = prefetch
        self._jobs: dict[int, _Job] = {}
        self._step = 0
        # per layer: units its recent corrected selections read on demand, ascending, their data and the step each
        # was last read (`_hold`); never an open block (it changes as tokens arrive: read from fast memory anyway)
        self._held = HeldSet()
        self._pending: list[list] = [[] for _ in range(num_layers)]
        self._lock = threading.Lock()
        self._pool = fetch_worker(1) if threaded else None

    @staticmethod
    def slot_bytes(num_layers: int, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, codec=None,
                   pack: bool = True, block: int = 16) -> int:
        """File bytes per slot (a unit's share, padding included)."""
        row = layout_for(codec, head_dim, dtype, pack=False).row_bytes
        return math.ceil(num_layers * batch * kv_heads * unit_bytes(block, row) / block)

    def _offset(self, layer: int, bh: int, j: int) -> int:
        return ((layer * self.bh + bh) * self.blocks_per_head + j) * self.unit

    def _open_block(self, layer: int) -> int:
        """The block the next append fills (in fast memory), or -1 once the pool is full."""
        n = self.length[layer]
        return n // self.block if n < self.capacity else -1

    # ---- writes -----------------------------------------------------------------------------------
    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, T, d] -> [B * Hkv, T, d] as stored (the codec's rounding, the store's dtype)."""
        b, h, t, d = x.shape
        return self.layout.encode(x.reshape(b * h * t, d))[0].view(b * h, t, d)

    def write_prompt(self, layer, k, v, token_valid, positions, at: int = 0):
        """A prompt's keys and values [B,Hkv,T,d] in slots at..at+T-1 (`at` > 0: after the prefix a prefix cache
        restored there, a cached block at a time): every block they complete goes to the file in one write per
        (batch row, KV head), the rest stays in the open block."""
        t = k.shape[2]
        if at + t > self.capacity:
            raise ValueError(f"prompt of {at + t} tokens does not fit a KV pool of {self.capacity}")
        if at and at != self.length[layer]:
            raise RuntimeError(f"a prompt continues at slot {at}, but layer {layer} holds {self.length[layer]}")
        self._drop(layer)
        if not at:
            self.open[layer].zero_()
            self._held.pop(layer, None)
        self._extend(layer, at, self._encode(k), self._encode(v))
        if not at:
            self._prompt_written(layer, t, token_valid, positions)
            return
        self.valid[layer][:, :, at:at + t] = token_valid[:, None, :]
        self.pos[layer][:, :, at:at + t] = positions[:, None, :]
        self.length[layer] = at + t

    def _extend(self, layer: int, at: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Tokens [B * Hkv, T, d] (as stored) into slots at..at+T-1 of `layer`, whose open block holds slots
        from the block's start to `at`."""
        bs, end = self.block, at + keys.shape[1]
        first = at // bs
        lead = at - first * bs  # the open block's tokens before this chunk's
        done = end // bs if end < self.capacity else self.blocks_per_head  # blocks [first, done) are complete
        if done <= first:  # the chunk stays in the open block
            self.open[layer, :, lead:lead + keys.shape[1]] = keys
            self.open[layer, :, bs + lead:bs + lead + keys.shape[1]] = values
            return
        count, n = done - first, min(end, done * bs) - at  # complete blocks; this chunk's tokens in them
        units = torch.empty(self.bh, count, self.unit_rows, self.head_dim, dtype=self.dtype)
        units[:, :, 2 * bs:] = 0  # the page padding after a unit's values
        for kind, x in zip(KV, (keys, values)):
            into = units[:, :, kind * bs:(kind + 1) * bs]
            if lead == 0 and n == count * bs:  # whole blocks from a block's start (a restored prefix): one copy
                into.copy_(x[:, :n].reshape(self.bh, count, bs, self.head_dim))
                continue
            rows = torch.zeros(self.bh, count * bs, self.head_dim, dtype=self.dtype)
            rows[:, lead:lead + n] = x[:, :n]
            rows[:, :lead] = self.open[layer, :, kind * bs:kind * bs + lead]
            into.copy_(rows.view(self.bh, count, bs, self.head_dim))
        with _pool_io(self.tier.dir, "write"):
            for bh in range(self.bh):  # a (batch row, KV head)'s blocks are one run of the file
                _write_all(self.fd, _bytes(units[bh]), self._offset(layer, bh, first))
        self.open[layer].zero_()
        rest = keys.shape[1] - n
        if rest > 0:
            self.open[layer, :, :rest] = keys[:, n:]
            self.open[layer, :, bs:bs + rest] = values[:, n:]

    def keys_values(self, layer: int, start: int, stop: int):
        """Keys and values [B,Hkv,stop-start,d] of slots start..stop-1, read from the file into new tensors
        (positioned reads of the units they lie in, about 1 MiB at a time through one staging buffer; the open
        block from memory): a prefix cache's blocks and a continued prefill's attention, one layer at a time."""
        bs, m, d = self.block, stop - start, self.head_dim
        first, last = start // bs, -(-stop // bs)
        open_j = self._open_block(layer)
        on_disk = last if open_j < 0 else min(last, open_j)
        out = [torch.empty(self.bh, m, d, dtype=self.dtype) for _ in KV]
        per = max(1, (1 << 20) // self.unit)
        stage = torch.empty(min(per, last - first), self.unit_rows, d, dtype=self.dtype)
        with _pool_io(self.tier.dir, "read"):
            for bh in range(self.bh):
                for j in range(first, last, per):
                    units = stage[:min(per, last - j)]
                    c = len(units)
                    if on_disk > j:
                        _read_all(self.fd, _bytes(units[:min(c, on_disk - j)]), self._offset(layer, bh, j))
                    if j <= open_j < j + c:
                        units[open_j - j] = self.open[layer, bh]
                    lo, hi = max(start, j * bs), min(stop, (j + c) * bs)
                    for kind, dst in zip(KV, out):
                        rows = units[:, kind * bs:(kind + 1) * bs].reshape(c * bs, d)
                        dst[bh, lo - start:hi - start] = rows[lo - j * bs:hi - j * bs]
        return tuple(x.view(self.batch, self.kv_heads, m, d) for x in out)

    def append(self, layer, k, v, positions):
        b, h = k.shape[:2]
        n = self.length[layer]
        slots = self._claim(layer, b, h, k.device)
        self._drop(layer)  # an unused prefetched copy of this layer no longer matches the pool
        keys, values = self._encode(k)[:, 0], self._encode(v)[:, 0]  # [B * Hkv, d]
        bs = self.block
        if n < self.capacity:  # every row's token goes to slot n, in the open block
            j, i = divmod(n, bs)
            self.open[layer, :, i] = keys
            self.open[layer, :, bs + i] = values
            if i == bs - 1 or n + 1 == self.capacity:  # the block is full: to the file, whole pages
                with _pool_io(self.tier.dir, "write"):
                    for bh in range(self.bh):
                        _write_all(self.fd, _bytes(self.open[layer, bh]), self._offset(layer, bh, j))
        else:  # victims anywhere in the pool: their rows in place (a held copy of their units is stale)
            self._unhold(layer, slots)
            with _pool_io(self.tier.dir, "write"):
                for bh, s in enumerate(slots.reshape(-1).tolist()):
                    j, i = divmod(s, bs)
                    at = self._offset(layer, bh, j)
                    _write_all(self.fd, _bytes(keys[bh]), at + i * self.row_bytes)
                    _write_all(self.fd, _bytes(values[bh]), at + (bs + i) * self.row_bytes)
        self._mark(layer, slots, positions)
        return slots

    # ---- reads ------------------------------------------------------------------------------------
    def past(self, layer):
        """Metadata only: the keys and values are read through `hand_rows`/`dense`."""
        n = self.length[layer]
        return None, None, self.valid[layer][:, :, :n], self.pos[layer][:, :, :n]

    def _run(self, job: _Job, ondemand: bool = False) -> None:
        """Bring job.layer's selected units (every used slot's for a full job) to fast memory; a full job's rows
        gathered from them in (b, h, i) order."""
        t0 = time.perf_counter()
        if job.plan is not None and job.selection is None:  # the plan packed, as the runtime packs it
            job.selection = self._packed_plan(job)
        if job.full:  # every used slot (padding's too), in (b, h, i) order
            seg = torch.arange(self.bh).repeat_interleave(job.n)
            slot = torch.arange(job.n).repeat(self.bh)
            job.kv, units, job.staged = self._read(job.layer, seg, slot, gather=True)
            moved = slot.numel()
        else:
            units, job.staged, job.selected = self._stage(job.layer, job.selection)
            moved = job.selected
            if not ondemand and self.stats.steps:  # this step's rows prefetched
                self.stats.steps[-1][0] += job.selected
        self.stats.bytes_moved += units * self.unit
        self.stats.rows_moved += moved
        self.stats.fetches += 1
        if not ondemand:
            self.stats.gather_s += time.perf_counter() - t0

    def _packed_plan(self, job: _Job):
        """The job's plan and the valid slots packed as `KVStore.select_rows` packs them (one native call where
        the kernel is built)."""
        n, layer = job.n, job.layer
        if not block_select.available():
            return KVStore.select_rows(self, layer, job.plan[:, :, :n], self.valid[layer][:, :, :n])
        keep = job.plan[:, :, :n] & self.valid[layer][:, :, :n]
        return SelectedRows(keep, *block_select.pack_rows(keep, self.capacity))

    def _stage(self, layer: int, sel) -> tuple[int, tuple, int]:
        """The units holding `sel`'s rows read into the layer parity's staging buffer -> (the units read from the
        file; (the units' ids within the layer, ascending; the staging buffer, rows [U * unit_rows, d] then room
        for the spare units (`_hand`); each packed column's row in it [B, m]); the selected entries)."""
        nb, per, d = self.blocks_per_head, self.unit_rows, self.head_dim
        if block_select.available():  # none staged: every unit holding a selected row is to read
            ids, rows, selected = block_select.staged_places(_NO_UNITS, sel.rows, sel.head, self.capacity, self.block,
                                                             nb, per, self.bh * nb)
            u = ids.numel()
            stage = self.buffers.get(("disk", layer % 2), (u + self._spare_units) * per, (d,), self.dtype)
            return self._load(layer, ids, stage[:u * per].view(u, per, d)), (ids, stage, rows), selected
        flat = packed_order(sel)[0]
        _, read, (ids, stage, row) = self._read(layer, flat // self.capacity, flat % self.capacity, gather=False)
        local, _ = packed_places(sel, 0)
        return read, (ids, stage, row[local] if row.numel() else torch.zeros_like(local)), flat.numel()

    def _read(self, layer: int, seg: torch.Tensor, slot: torch.Tensor, gather: bool):
        """The units holding the rows of (batch row * Hkv + KV head, slot) pairs seg, slot [N], read into the
        layer parity's staging buffer -> (with `gather`: keys, values [N + B * Hkv, d], the rows in that order,
        then a spare row per (batch row, KV head); else None), the units read from the file, and what was staged:
        (the units' ids within the layer, ascending; the staging buffer, rows [U * unit_rows, d] then room for
        the spare units (`_hand`); each pair's row in it [N])."""
        parity, bs, nb, per = layer % 2, self.block, self.blocks_per_head, self.unit_rows
        unit_id = slot // bs + seg * nb  # [N] unit within the layer
        hit = torch.zeros(self.bh * nb, dtype=torch.bool)
        hit[unit_id] = True
        rank = hit.cumsum(0) - 1  # a hit unit's place in the staging buffer
        ids = hit.nonzero().squeeze(1)
        u = ids.numel()
        stage = self.buffers.get(("disk", parity), (u + self._spare_units) * per, (self.head_dim,), self.dtype)
        read = self._load(layer, ids, stage[:u * per].view(u, per, self.head_dim))
        row = rank[unit_id] * per + slot % bs
        if not gather:
            return None, read, (ids, stage, row)
        out = []
        for kind in KV:
            buf = self.buffers.get(("fast", parity, kind, 0), row.numel() + self.bh, (self.head_dim,), self.dtype)
            torch.index_select(stage, 0, row + kind * bs, out=buf[:row.numel()])
            out.append(buf)
        return tuple(out), read, (ids, stage, row)

    # ---- handing rows to the attention: views of the staging buffer, no copy ------------------------------
    @property
    def _spare_units(self) -> int:
        """Units of the staging buffer after the units read that hold the spare rows (`_hand`)."""
        return -(-self.bh // self.block)

    def hand_rows(self, layer, sel, buffer=None, every: bool = False) -> HandedRows:
        """The rows of `sel` in fast memory with a spare row per (batch row, KV head) for the token (`HandedRows`).
        A selection's rows are handed as they lie in the staging buffer its units were read into (the prefetched
        units, and for a selection other than the prefetched one the units it adds, read now: `_corrected`);
        every used slot (`every`, no window hiding one), or a layer prefetched whole, as a whole-layer copy in
        (b, h, i) order."""
        job = self._take(layer)
        n = self.length[layer]
        if job is None or (job.full and job.n != n):
            self._discard(job)  # nothing prefetched for this selection: read now (its units, or the layer whole)
            job = self._fetch(layer, None if self._whole(sel, n, every) else sel, n)
        if job.full:
            local = sel.rows // self.capacity * n + sel.rows % self.capacity
            own = self.bh * n + torch.arange(self.bh).view(self.batch, self.kv_heads)
            return HandedRows(*job.kv, local, own)
        if job.selection is not sel:
            return self._corrected(layer, job, sel, buffer)
        ids, stage, rows = job.staged
        return self._hand(stage, ids.numel(), rows)

    def _hand(self, stage: torch.Tensor, used: int, rows: torch.Tensor) -> HandedRows:
        """Rows of the staging buffer `stage` handed as views of it (`rows`: each packed column's row, [B, m]), its
        first `used` units holding them: a unit holds its keys, then its values `block` rows further, so the keys
        are the buffer and the values the same buffer `block` rows on, both read at the same row. The spare rows
        lie in the spare units after the `used` ones, each key's value `block` rows after it, where no other spare
        key lies."""
        bs, per = self.block, self.unit_rows
        j = torch.arange(self.bh)
        own = ((used + j // bs) * per + j % bs).view(self.batch, self.kv_heads)
        end = (used + self._spare_units) * per
        return HandedRows(stage[:end - bs], stage[bs:end], rows, own)

    def _load(self, layer: int, ids: torch.Tensor, units: torch.Tensor, held: tuple | None = None) -> int:
        """Units `ids` of `layer` (ids within the layer, ascending) into units [len(ids), unit_rows, d]: open
        blocks copied from fast memory, and those of `held` (the layer's held units, `_hold`), the others with
        positioned reads, one per run of adjacent units (every run announced to the kernel first). Returns the
        number of units read from the file."""
        open_j = self._open_block(layer)
        if _native():  # all of it in one call, the reads without the GIL
            held_ids, held_data = held[:2] if held is not None else (_NO_UNITS, _NO_UNITS)
            with _pool_io(self.tier.dir, "read"):
                read, _ = block_select.load_units(self.fd, ids, layer * self.bh * self.blocks_per_head,
                                                  self.blocks_per_head, open_j, self.open[layer], held_ids, held_data,
                                                  units, self.unit, _WILLNEED is not None)
            self.stats.blocks += read
            return read
        if held is not None and ids.numel():  # the held units copied, the others loaded
            at, found = located(held[0], ids)
            hit = found.nonzero().squeeze(1)
            units[hit] = held[1][at[hit]]
            lack = (~found).nonzero().squeeze(1)
            got = torch.empty((lack.numel(), *units.shape[1:]), dtype=units.dtype)
            read = self._load(layer, ids[lack], got)
            units[lack] = got
            return read
        on_disk = torch.ones(ids.numel(), dtype=torch.bool)
        if open_j >= 0:  # the open blocks come from fast memory
            opened = ids % self.blocks_per_head == open_j
            if opened.any():
                units[opened] = self.open[layer, ids[opened] // self.blocks_per_head]
                on_disk = ~opened
        where = on_disk.nonzero().squeeze(1)  # places in `units`; adjacent ids lie at adjacent places
        disk = ids[where]
        read = disk.numel()
        if read:
            starts = torch.ones(read, dtype=torch.bool)
            starts[1:] = disk[1:] != disk[:-1] + 1
            first = starts.nonzero().squeeze(1)
            counts = torch.diff(torch.cat([first, torch.tensor([read])]))
            mv = _bytes(units)
            base = layer * self.bh * self.blocks_per_head
            runs = list(zip(disk[first].tolist(), counts.tolist(), where[first].tolist()))
            with _pool_io(self.tier.dir, "read"):
                if _WILLNEED is not None:  # every run's read queued at once, then taken in order
                    for f, c, _ in runs:
                        os.posix_fadvise(self.fd, (base + f) * self.unit, c * self.unit, _WILLNEED)
                for f, c, w in runs:
                    _read_all(self.fd, mv[w * self.unit:(w + c) * self.unit], (base + f) * self.unit)
        self.stats.blocks += read
        return read

    def _corrected(self, layer, job, sel, buffer=None) -> HandedRows:
        """`hand_rows` of the layer's own selection `sel` after a prefetch (`job`) of another: its rows in units
        the prefetch staged are read where they lie, the units holding the rest are read now, in one batch, into
        the same staging buffer after the staged ones (grown, the staged units kept, where they do not fit)."""
        t0 = time.perf_counter()
        nb, per, d = self.blocks_per_head, self.unit_rows, self.head_dim
        held, stage, _ = job.staged
        u = held.numel()
        if block_select.available():  # one native call for the bookkeeping below
            ids, rows, missed = block_select.staged_places(held, sel.rows, sel.head, self.capacity, self.block, nb,
                                                           per, self.bh * nb)
        else:
            ids, rows, missed = self._staged_places(held, sel)
        m = ids.numel()
        need = (u + m + self._spare_units) * per
        if stage.shape[0] < need:
            grown = self.buffers.get(("disk", layer % 2), need, (d,), self.dtype)
            if grown.data_ptr() != stage.data_ptr():  # a new buffer: the staged units move with it
                grown[:u * per] = stage[:u * per]
            stage = grown
        read = self._load_missed(layer, ids, stage[u * per:(u + m) * per].view(m, per, d))
        self.stats.fetched_missed(missed, read * self.unit, time.perf_counter() - t0, units=read)
        return self._hand(stage, u + m, rows)

    def _load_missed(self, layer: int, ids: torch.Tensor, units: torch.Tensor) -> int:
        """`_load` of the units a corrected selection reads beyond its prefetch: those held (`holds_missed`) copied
        from fast memory, the others loaded; then held for the layer's next steps (`_hold`), but an open block.
        Returns the number of units read from the file."""
        read = self._load(layer, ids, units, self._held.get(layer))
        if not self.holds_missed:
            return read
        open_j = self._open_block(layer)
        if not _native():
            closed = ids % self.blocks_per_head != open_j
            self._hold(layer, ids[closed], (units[closed],), self.block)
            return read
        prev = self._held.pop(layer, None) or (_NO_UNITS, _NO_UNITS, _NO_UNITS)
        limit = int(self.hold_share * self.length[layer] * self.bh) // self.block
        held, data, last = block_select.hold_units(*prev, ids, units, self.blocks_per_head, open_j, self._step,
                                                   self.hold_steps, limit, self.unit)
        if held.numel():
            self._held[layer] = (held, data.view(self.dtype).view(-1, self.unit_rows, self.head_dim), last)
            self.stats.peak_fast_bytes = max(self.stats.peak_fast_bytes, self.fast_bytes())
        return read

    def _held_at(self, slots: torch.Tensor) -> torch.Tensor:
        """The held entries (units within the layer) of the slots [B, Hkv], ascending."""
        return (torch.arange(self.bh) * self.blocks_per_head + slots.reshape(-1) // self.block).sort().values

    def _staged_places(self, held: torch.Tensor, sel) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`block_select.staged_places` in torch: the units holding `sel`'s rows that are not among the staged
        units `held` (ascending), each packed column's row in a staging buffer of the `held` units then those, and
        the count of selected entries in them."""
        bs, nb, per = self.block, self.blocks_per_head, self.unit_rows
        flat = packed_order(sel)[0]
        slot = flat % self.capacity
        unit_id = slot // bs + flat // self.capacity * nb
        at, found = located(held, unit_id)
        missed = ~found
        hit = torch.zeros(self.bh * nb, dtype=torch.bool)
        hit[unit_id[missed]] = True
        unit_at = torch.where(found, at, held.numel() + (hit.cumsum(0) - 1)[unit_id])  # each row's unit there
        place = unit_at * per + slot % bs
        local, _ = packed_places(sel, 0)
        rows = place[local] if place.numel() else torch.zeros_like(local)
        return hit.nonzero().squeeze(1), rows, int(missed.sum())
