"""A KV store whose pool lives in the slow tier; the rows a layer reads are fetched one layer ahead.

Decoding step, layer i (the runtime calls `ahead` after each policy hook):
  1. As soon as the policy knows layer i+1's selection (`Session.planned`: InfiniGen after its speculation
     at layer i, H2O from its scores, full/INT4: everything), the store turns it into row indices and
     hands a fetch job to a background worker: gather the rows from the slow tier into a staging buffer
     (index_select; torch releases the GIL) and, on CUDA, copy the staging buffer to the GPU on a copy
     stream and record an event.
  2. Meanwhile the main thread runs the rest of layer i (attention, MLP).
  3. At layer i+1's attention, `hand_rows`/`dense` wait for that job only (its future and, on CUDA, its
     event on the compute stream; never a device-wide synchronize) and return views of the fetched rows.
The layer reads the planned selection, packed as the runtime packs it (`KVStore.select_rows`, derived on the
worker; the store hands over the plan's when the selection is the plan), or the selection its own query makes
at its attention (the correction, `corrects`: the policy `reselects`): then only the rows of that selection
the prefetch missed are fetched on the spot, in one gather, after the prefetched ones, less those the layer's recent
steps missed too, held in fast memory since (`holds_missed`). Nothing planned: the
rows are fetched on the spot. The fetched rows are handed to the
attention in the packed order (`hand_rows`), with a spare row per (batch row, KV head) for the token, which is
stored after the attention. The tokens are therefore always those of the in-memory store.

Double buffering: jobs for layers of the same parity share buffers; on CUDA the copy for layer i+2
waits on an event recorded when layer i's attention was done with the buffer.
"""
from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ..cache import HandedRows, KVCodec, KVStore, SelectedRows, packed_order, packed_places
from ..errors import UserError
from ..selection import ALL
from .behind_gpu import BehindGpu
from .held import HeldSet, HoldsMisses
from .rows import layout_for
from .rowcache import RowCache
from .tiers import SlowTier
from .transfer import KV, TransferStats, _Buffers, fetch_worker, located, touched_page_share

@dataclass
class _Job:
    layer: int
    step: int
    n: int  # the layer's used slots when the job was made
    plan: object = None  # what the session planned (bool [B,Hkv,S]); None: `selection` given, or every used slot
    selection: SelectedRows | None = None  # the plan packed as the runtime packs it (derived on the worker)
    full: bool = False  # every used slot (full offload, dense layers)
    future: Future | None = None
    ready: object = None  # CUDA: event on the copy stream
    raw: list | None = None  # CUDA: fetched planes per kind, finished on the compute stream
    staged: tuple | None = None  # the block layout: the units the fetch read (ids within the layer, copies)
    # (k, v) in the fast tier: a selection's rows in its packed order (`packed_order`), or every used slot in
    # row order (b, h, i); then (CPU host) a spare row per (batch row, KV head) for the token
    kv: tuple | None = None
    selected: int = 0  # a selection's rows in kv (counted on the worker: the main thread need not wait for it)
    held_rows: torch.Tensor | None = None  # a selection's rows of the flat store order, ascending, on the host
    plan_host: torch.Tensor | None = None  # CUDA: the plan [B, Hkv, n] on the host (a corrected layer compares)


class OffloadedKVStore(HoldsMisses, BehindGpu, KVStore):
    """KVStore with the pool in `tier` (a `SlowTier`); metadata (valid, pos) stays in the fast tier.

    `prefetch=False` fetches every layer on demand (no overlap); `threaded=False` runs prefetch jobs
    inline (no worker thread). `pack=False` keeps a quantizing codec's values unpacked.

    Disk tier on a CPU host: a file is read in pages, and a selection of scattered rows (256 B each at
    d 64 in float32) touches most of a layer's pages while reading them one synchronous fault at a time.
    Where a selection touches more than `bulk_share` of the used layer's pages, the layer is read front
    to back (the kernel's readahead streams it) into a RAM staging buffer and the rows are selected there.
    Measured at context 8192, batch 8, under a memory bound below the pool: faulting the selected rows in
    took 3.5x the time per step of streaming every layer (results/offload/), hence 0.25.
    """
    offloaded = True
    # whether a selection made one layer ahead (a speculation) is worth prefetching here, when the policy leaves it
    # to the store (InfiniGen's query "auto"): a worker's gather from host memory, or a copy engine behind a GPU,
    # runs beside the compute
    ahead_pays = True
    corrects = True  # a policy that `reselects` may read its own selection (`Placement.correct`)
    fetches_missing = True  # a corrected selection's rows: the prefetched ones and one gather of the missed ones

    def __init__(self, num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", codec: KVCodec | None = None,
                 allocator=None, tier: SlowTier | None = None, prefetch: bool = True, threaded: bool = True,
                 pack: bool = True, stats: TransferStats | None = None, bulk_share: float = 0.25,
                 row_cache_bytes: int = 0):
        self.capacity = capacity
        self.bulk_share = bulk_share
        self.codec = codec or KVCodec()
        self.allocator = allocator
        self.fast = torch.device(device)
        self.cuda = self.fast.type == "cuda"
        self.tier = tier or SlowTier("cpu", self.fast)
        self.layout = layout_for(codec, head_dim, dtype, pack)
        self.packed = self.layout.packed
        shape0, dtype0 = self.layout.planes[0]  # the rows of every plane are the same: plane 0 says which pages
        self._plane0_row_bytes = math.prod(shape0) * torch.empty((), dtype=dtype0).element_size()
        self.num_layers, self.batch, self.kv_heads = num_layers, batch, kv_heads
        self.head_dim, self.dtype = head_dim, dtype
        self.bh = batch * kv_heads
        rows = capacity * self.bh
        # one tensor per (kind, plane) for all layers: one file each on disk
        whole = [[self.tier.empty((num_layers, rows, *shape), pdtype, name=f"{'kv'[kind]}{p}")
                  for p, (shape, pdtype) in enumerate(self.layout.planes)] for kind in KV]
        self.planes = [[[w[i] for w in whole[kind]] for kind in KV] for i in range(num_layers)]
        meta = (batch, kv_heads, capacity)
        self.valid = [torch.zeros(meta, dtype=torch.bool, device=self.fast) for _ in range(num_layers)]
        self.pos = [torch.full(meta, -1, dtype=torch.long, device=self.fast) for _ in range(num_layers)]
        self.length = [0] * num_layers
        self.padded = False  # a prompt had padding: some used slots are not valid
        if self.packed or self.cuda:
            # No float view of a packed pool, and GPU kernels cannot read a pinned pool: policies that look
            # at store.k for its shape and device get a one-element placeholder of that shape.
            ph = torch.zeros((), dtype=dtype, device=self.fast).expand(batch, kv_heads, capacity, head_dim)
            self.k = self.v = [ph] * num_layers
        else:
            self.k = [self._slow_view(i, capacity)[0] for i in range(num_layers)]
            self.v = [self._slow_view(i, capacity)[1] for i in range(num_layers)]
        self.stats = stats or TransferStats()
        meta_bytes = sum(t.numel() * t.element_size() for t in self.valid + self.pos)
        self.buffers = _Buffers(self.fast, self.stats, meta_bytes)
        self.stats.peak_fast_bytes = max(self.stats.peak_fast_bytes, meta_bytes)
        if row_cache_bytes and self.cuda:
            raise UserError("the row cache runs where the host gathers into fast memory (a CPU device) only; "
                            "give a row cache of 0 bytes behind a GPU")
        # the rows recent selections fetched, kept in the fast tier (0 bytes: off, every row from the slow tier)
        self.row_cache = RowCache(num_layers, rows, head_dim, dtype, row_cache_bytes, self.buffers) \
            if row_cache_bytes else None
        self.prefetch = prefetch
        self._jobs: dict[int, _Job] = {}
        self._step = 0
        # per layer: rows its recent corrected selections had to add to the prefetch, ascending, their keys and
        # values, and the step each was last added (`_hold`)
        self._held = HeldSet()
        self._own_host = None  # CUDA: the last selection `_select_on_host` packed: (its rows, on the host rows, heads)
        self._spare_like = None  # CUDA, `_read_in_place`: an empty [0, d] tensor of the fast tier (the buffer's kind)
        self._pending: list[list] = [[] for _ in range(num_layers)]  # CUDA: appends on their way to the pool
        self._lock = threading.Lock()
        # The worker's own OpenMP team: one thread on a CPU host, where compute needs the cores; behind a GPU
        # the host is otherwise idle and the row gather from pinned memory is the critical path.
        n = max(1, min(8, (os.cpu_count() or 2) - 2)) if self.cuda else 1
        self._pool = fetch_worker(n) if threaded else None
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.fast)
            self._compute_stream = torch.cuda.current_stream(self.fast)  # the stream attention reads fetched rows on
            self._consumed = [None, None]  # per parity: compute-stream event once attention read the buffer
            self._copied = [None, None]  # per parity: copy-stream event once the pinned staging was read

    # ---- accounting -------------------------------------------------------------------------------
    def nbytes(self) -> int:
        return self.slow_bytes()

    def slow_bytes(self) -> int:
        return self.tier.nbytes

    def fast_bytes(self) -> int:
        """Metadata, the buffers of fetched rows (not the pinned host staging behind a GPU: host memory) and the
        missed rows held for the next step."""
        return self.buffers.fast_bytes() + self._held.nbytes  # (the held indices too)

    def peak_fast_bytes(self) -> int:
        """The most metadata, staging and fetched rows held in the fast tier (`TransferStats`)."""
        return self.stats.peak_fast_bytes

    def pool_file_bytes(self) -> int:
        return self.tier.files_bytes()

    @staticmethod
    def slot_bytes(num_layers: int, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, codec=None,
                   pack: bool = True) -> int:
        """Slow-tier bytes of one slot (one token of every sequence, layer and KV head)."""
        return num_layers * batch * kv_heads * 2 * layout_for(codec, head_dim, dtype, pack).row_bytes

    # ---- rows -------------------------------------------------------------------------------------
    def _slow_view(self, layer: int, n: int):
        """Plain layout only: k, v [B,Hkv,n,d] views of the slow tier (no copy)."""
        return tuple(self.planes[layer][kind][0][: n * self.bh].view(n, self.batch, self.kv_heads, self.head_dim)
                     .permute(1, 2, 0, 3) for kind in KV)

    def _slow_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """Rows of the flat [B * Hkv * capacity] store order (`select_rows`) -> the slow tier's slot-major rows."""
        return flat % self.capacity * self.bh + flat // self.capacity

    def _views(self, job: _Job):
        shape = (self.batch, self.kv_heads, job.n, self.head_dim)
        rows = self.bh * job.n
        return job.kv[0][:rows].view(shape), job.kv[1][:rows].view(shape)

    # ---- writes -----------------------------------------------------------------------------------
    def write_prompt(self, layer, k, v, token_valid, positions):
        t = k.shape[2]
        if t > self.capacity:
            raise ValueError(f"prompt of {t} tokens does not fit a KV pool of {self.capacity}")
        self._drop(layer)
        self._held.pop(layer, None)
        if self.row_cache is not None:
            self.row_cache.reset(layer)
        for kind, x in zip(KV, (k, v)):
            x = x.permute(2, 0, 1, 3).reshape(t * self.bh, self.head_dim)  # slot-major rows
            for plane, rows in zip(self.planes[layer][kind], self.layout.encode(x)):
                plane[: t * self.bh].copy_(rows)  # synchronous on CUDA: prefill is not the hot loop
        self._prompt_written(layer, t, token_valid, positions)

    def _prompt_written(self, layer, t, token_valid, positions) -> None:
        """The bookkeeping of a prompt of t tokens written at slots 0..t-1 of `layer` (which are valid, where)."""
        self.valid[layer][:, :, :t] = token_valid[:, None, :]
        self.valid[layer][:, :, t:] = False
        self.pos[layer][:, :, :t] = positions[:, None, :]
        self.length[layer] = t
        if layer == 0:
            self.padded = not bool(token_valid.all())

    def append(self, layer, k, v, positions):
        b, h = k.shape[:2]
        full = self.length[layer] >= self.capacity
        slots = self._claim(layer, b, h, k.device)
        if full:  # a victim's slot may be a held row's: another token's now
            self._unhold(layer, slots)
        self._drop(layer)  # an unused prefetched copy of this layer no longer matches the pool
        rows = (slots * self.bh + torch.arange(self.bh, device=k.device).view(b, h)).reshape(-1)
        if self.row_cache is not None:  # the slot may be a reused victim: its cached rows are another token's
            self.row_cache.invalidate(layer, rows)
        data = [self.layout.encode(x.reshape(self.bh, self.head_dim)) for x in (k, v)]
        if self.cuda:
            self._write_async(layer, rows, data)
        else:
            for kind in KV:
                for plane, d in zip(self.planes[layer][kind], data[kind]):
                    plane.index_copy_(0, rows, d)
        self._mark(layer, slots, positions)
        return slots

    def _flush(self, layer):
        # under the lock throughout: a second caller (main thread vs worker) must not read the pool
        # before the first has written the rows it took
        with self._lock:
            for ev, rows, data in self._pending[layer]:
                ev.synchronize()  # this copy only
                for kind in KV:
                    for plane, d in zip(self.planes[layer][kind], data[kind]):
                        plane.index_copy_(0, rows, d)
            self._pending[layer] = []

    # ---- reads ------------------------------------------------------------------------------------
    def past(self, layer):
        """Metadata in the fast tier; k, v are slow-tier views (None when packed) that only host code
        may read: attention reads through `hand_rows`/`dense`."""
        n = self.length[layer]
        self._flush(layer)
        k, v = self._slow_view(layer, n) if not self.packed else (None, None)
        return k, v, self.valid[layer][:, :, :n], self.pos[layer][:, :, :n]

    def dense(self, layer):
        """Every used slot, in the fast tier: the prefetched copy (full offload) or fetched now."""
        n = self.length[layer]
        job = self._take(layer)
        if job is None or not job.full or job.n != n:
            self._discard(job)
            job = self._fetch(layer, None, n)
        return self._views(job)

    def select_rows(self, layer, keep, valid):
        """The planned selection, packed, when `keep` is what was planned (no second pass over the mask); behind a
        GPU another selection (a corrected layer's own) is packed on the host (`_select_on_host`)."""
        job = self._jobs.get(layer)
        planned = None
        if job is not None and job.step == self._step and job.plan is not None:
            self._settle(job)  # the worker packs the plan (and gathers its rows) off the main thread
            n = self.length[layer]
            mine = self.valid[layer]
            if valid.data_ptr() == mine.data_ptr() and valid.shape[-1] == n and valid.stride() == mine.stride():
                planned = job
            if planned is not None and keep is job.plan:
                self.stats.reused += 1
                return job.selection
        if self.cuda:
            if (planned is not None and self._on_device()) or self._in_place():
                return self._select_on_device(keep, valid)
            return self._select_on_host(layer, keep, valid, planned)
        if planned is not None and keep.shape[-1] == n and torch.equal(keep, job.plan[:, :, :n]):
            self.stats.reused += 1
            return job.selection
        return super().select_rows(layer, keep, valid)

    def hand_rows(self, layer, sel, buffer=None, every: bool = False) -> HandedRows:
        """The rows of `sel` in the fast tier (the prefetched ones, else fetched now; `every`: sel is every
        visible slot, fetched as the whole used layer where no sliding window hides one) with a spare row per
        (batch row, KV head) for the token (`HandedRows`)."""
        if sel.read is not None and buffer is not None and self._in_place() and not self._prefetched_whole(layer):
            self._drop(layer)  # packed on the GPU, read where it lies
            return self._read_in_place(layer, sel, buffer)
        job = self._take(layer)
        n = self.length[layer]
        if (job is not None and not job.full and job.selection is not sel and not every and buffer is not None
                and self.fetches_missing):
            if sel.read is not None and sel.keep.shape == job.selection.keep.shape:  # packed on the GPU
                return self._corrected_on_device(layer, job, sel, buffer)
            return self._corrected(layer, job, sel, buffer)
        if job is None or (job.selection is not sel and not (job.full and job.n == n)):
            self._discard(job)
            job = self._fetch(layer, None if self._whole(sel, n, every) else sel, n)
        if job.full:  # every used slot in (b, h, i) order: a column's row there, the spare rows after them
            before = self.bh * n
            local = sel.rows // self.capacity * n + sel.rows % self.capacity
            own = before + torch.arange(self.bh, device=sel.rows.device).view(self.batch, self.kv_heads)
        else:
            before = job.selected
            local, own = packed_places(sel, before)
        keys, values = job.kv
        spare = before + self.bh - keys.shape[0]
        if spare > 0:  # (behind a GPU the rows arrive without the spare rows)
            keys, values = (torch.cat([x, x.new_empty(spare, x.shape[1])]) for x in (keys, values))
        return HandedRows(keys, values, local, own)

    def _prefetched_whole(self, layer) -> bool:
        """Whether this step's prefetch of `layer` is its whole used layer (a layer that reads every slot)."""
        job = self._jobs.get(layer)
        return job is not None and job.full and job.step == self._step and job.n == self.length[layer]

    def _whole(self, sel, n: int, every: bool) -> bool:
        """Whether a fetch on demand of `sel` reads the whole used layer: `sel` is every visible slot (`every`)
        and no sliding window hides a used slot (a window's slots are fetched as a selection)."""
        return every and int(sel.counts.sum()) == self.bh * n

    def _corrected(self, layer, job: _Job, sel, buffer) -> HandedRows:
        """`hand_rows` of a selection other than the prefetched one (`job`'s): its rows the prefetch holds are
        taken from there, those it missed are fetched now in one gather; the caller's `buffer` holds the
        prefetched rows, then the missed ones, then the spare rows."""
        t0 = time.perf_counter()
        held = job.held_rows  # the prefetched rows of the flat store order, ascending, on the host
        p = job.selected
        rows, head = self._host_rows(sel)
        real = head >= 0
        at, found = located(held, rows)
        found &= real
        missing = real & ~found
        want = rows[missing]  # ascending: packed order
        m = want.numel()
        keys, values = buffer(p + m + self.bh, job.kv[0])  # (like: the dtype and device of the fast tier)
        keys[:p], values[:p] = job.kv[0][:p], job.kv[1][:p]
        gathered = self._missed_rows(layer, want, keys[p:p + m], values[p:p + m])
        local = torch.where(found, at, 0)
        local[missing] = torch.arange(p, p + m)
        local = self._to_fast(local)
        own = p + m + torch.arange(self.bh, device=self.fast).view(self.batch, self.kv_heads)
        self.stats.fetched_missed(gathered, 2 * gathered * self.layout.row_bytes, time.perf_counter() - t0,
                                  held=m - gathered)
        return HandedRows(keys, values, local, own)

    def _gather_rows(self, layer, rows, keys, values) -> None:
        """The slow tier's rows `rows` (slot-major, on the host: the host gathers) of `layer`, decoded, into keys
        and values [m, d] (behind a GPU through pinned memory, without waiting)."""
        self._flush(layer)
        for kind, out in zip(KV, (keys, values)):
            planes = [torch.index_select(pl, 0, rows, out=torch.empty((rows.numel(), *pl.shape[1:]), dtype=pl.dtype,
                                                                       pin_memory=self.cuda))
                      for pl in self.planes[layer][kind]]
            if self.cuda:
                planes = [x.to(self.fast, non_blocking=True) for x in planes]
            out.copy_(self.layout.decode(planes))

    # ---- the pipeline -----------------------------------------------------------------------------
    def ahead(self, layer, point, session):
        if self.cuda and point == "attn_out" and layer >= 0:
            self._compute_stream = torch.cuda.current_stream(self.fast)
            ev = torch.cuda.Event()
            ev.record()  # layer's attention is done with its parity's buffers
            self._consumed[layer % 2] = ev
        if point == "embed" and session.decoding:
            self.stats.settle()  # on-demand counts the GPU has sent since
            self.stats.steps.append([0, 0, sum(self.length) * self.bh, 0.0])  # this step's fetch counters
            if self.row_cache is not None:
                self.stats.row_steps.append([0, 0, 0, 0])  # this step's row-cache counters
        if not self.prefetch or not session.decoding:
            return
        if point == "embed":
            self._step += 1
        nxt = layer + 1
        if nxt >= self.num_layers:
            return
        job = self._jobs.get(nxt)
        if job is not None and job.step == self._step:
            return  # already on its way
        plan = session.fetch_plan(nxt)  # (a layer behind a sliding window: the slots it sees)
        if plan is None:  # not known yet
            return
        self._issue(nxt, plan)

    def _issue(self, layer, plan):
        """Hand layer's fetch to the worker: for a selection, deriving its slot indices (the runtime's own
        rule, `KVStore.select_rows`) is part of the job, so the main thread does not wait for it either."""
        self._drop(layer)
        if plan is not ALL and self._in_place():  # the attention reads the selection where it lies
            return
        full = plan is ALL
        job = _Job(layer, self._step, self.length[layer], plan=None if full else plan, full=full)
        if self._pool is None:
            self._run(job)
        else:
            job.future = self._pool.submit(self._run, job)
        self._jobs[layer] = job

    def _take(self, layer) -> _Job | None:
        job = self._jobs.pop(layer, None)
        if job is None:
            return None
        if job.step != self._step:
            self._discard(job)
            return None
        self._settle(job)
        self._wait(job)
        return job

    def _settle(self, job: _Job) -> None:
        """Wait for the worker's part of a job (host side)."""
        if job.future is not None:
            t0 = time.perf_counter()
            try:
                job.future.result()  # re-raises a worker error here
            finally:
                job.future = None
                self.stats.wait_s += time.perf_counter() - t0

    def _wait(self, job: _Job) -> None:
        self._settle(job)
        if job.raw is not None:  # CUDA: wait for this copy only, then finish on the compute stream
            torch.cuda.current_stream(self.fast).wait_event(job.ready)
            job.kv = tuple(self._finish(job, kind, planes) for kind, planes in zip(KV, job.raw))
            job.raw = None

    def _discard(self, job: _Job | None) -> None:
        if job is None:
            return
        if job.future is not None:
            job.future.result()  # its buffers are about to be reused
            job.future = None
        self.stats.stale += 1

    def _drop(self, layer) -> None:
        self._discard(self._jobs.pop(layer, None))

    def _fetch(self, layer, sel, n) -> _Job:
        """Fetch `sel`'s rows (None: every used slot) now, on the main thread."""
        t0 = time.perf_counter()
        job = _Job(layer, self._step, n, selection=sel, full=sel is None)
        self._run(job, ondemand=True)
        self._wait(job)
        self.stats.on_demand += 1
        self.stats.ondemand_s += time.perf_counter() - t0
        return job

    def _run(self, job: _Job, ondemand: bool = False) -> None:
        """Bring job.layer's rows to the fast tier (on the worker thread, or inline)."""
        t0 = time.perf_counter()
        if job.plan is not None and job.selection is None:  # the plan packed, as the runtime packs it
            n = job.n
            job.selection = KVStore.select_rows(self, job.layer, job.plan[:, :, :n], self.valid[job.layer][:, :, :n])
            if self.cuda and self.corrects:
                job.plan_host = job.plan[:, :, :n].cpu()
        self._flush(job.layer)
        total = job.n * self.bh
        rows = None
        if not job.full:
            flat = packed_order(job.selection)[0]
            job.held_rows = flat.cpu()  # behind a GPU the host gathers
            rows = self._slow_rows(job.held_rows)
            total = rows.numel()
        asked = total
        job.selected = asked
        look = None
        if rows is not None and self.row_cache is not None:  # fetch only the rows the cache lacks
            look = self.row_cache.lookup(job.layer, rows)
            self.stats.row_hits += look.hits
            self.stats.row_lookups += look.distinct
            if self.stats.row_steps:
                self.stats.row_steps[-1][0] += look.hits
                self.stats.row_steps[-1][1] += look.distinct
            rows = look.misses
            total = rows.shape[0]
        used = self.length[job.layer] * self.bh
        bulk = (rows is not None and total > 0 and not self.cuda and self.tier.kind == "disk" and self.bulk_share < 1
                and touched_page_share(rows, self._plane0_row_bytes, used) > self.bulk_share)
        if self.cuda:
            self._run_cuda(job, rows, total)
        elif look is not None and total == 0:  # every row was cached
            job.kv = tuple(torch.empty((0, self.head_dim), dtype=self.dtype, device=self.fast) for _ in KV)
        else:
            job.kv = tuple(self._host_fetch(job, kind, rows, total, used if bulk else None) for kind in KV)
        if look is not None:
            d = (self.head_dim,)
            out = tuple(self.buffers.get(("cached", job.layer % 2, kind), asked + self.bh, d, self.dtype)
                        for kind in KV)
            self.row_cache.assemble(job.layer, look, tuple(x[:total] for x in job.kv), tuple(x[:asked] for x in out))
            job.kv = out
        moved = 2 * (used if bulk else total) * self.layout.row_bytes
        self.stats.bytes_moved += moved
        self.stats.bulk += bulk
        self.stats.rows_moved += total
        if look is not None and self.stats.row_steps:
            self.stats.row_steps[-1][2] += total
            self.stats.row_steps[-1][3] += moved
        self.stats.fetches += 1
        if not ondemand:
            self.stats.gather_s += time.perf_counter() - t0
            if job.selection is not None and self.stats.steps:
                self.stats.steps[-1][0] += asked

    def _host_fetch(self, job, kind, rows, total, bulk_rows=None) -> torch.Tensor:
        """CPU host: gather (or copy the whole used prefix of) one kind's planes into fast RAM buffers, with a
        spare row per (batch row, KV head) after them (for the token, `hand_rows`).
        `bulk_rows`: read the first that many rows of the plane in one sequential pass, then gather there."""
        parity, out = job.layer % 2, []
        spare = 0 if self.packed else self.bh
        for p, plane in enumerate(self.planes[job.layer][kind]):
            shape = plane.shape[1:]
            whole = self.buffers.get(("fast", parity, kind, p), total + spare, shape, plane.dtype)
            buf = whole[:total]
            if rows is None:  # full offload: the used prefix, reordered from slot-major to (b, h, i)
                src = plane[:total].view(job.n, self.batch, self.kv_heads, *shape)
                slot_last = src.permute(1, 2, 0, *range(3, 3 + len(shape)))
                buf.view(self.batch, self.kv_heads, job.n, *shape).copy_(slot_last)
            elif bulk_rows is not None:  # one staging buffer per parity: kinds and planes take turns in it
                stage = self.buffers.get(("disk", parity), bulk_rows, shape, plane.dtype)
                stage.copy_(plane[:bulk_rows])
                torch.index_select(stage, 0, rows, out=buf)
            else:
                torch.index_select(plane, 0, rows, out=buf)
            out.append(buf if self.packed else whole)
        if not self.packed:
            return out[0]
        dq = self.buffers.get(("dq", parity, kind), total + self.bh, (self.head_dim,), self.dtype)
        self.layout.decode(out, out=dq[:total])
        return dq

    def close(self) -> None:
        self.stats.settle(wait=True)
        for job in self._jobs.values():  # wait for the worker; a failed fetch's error is not news to a closing store
            if job.future is not None:
                job.future.exception()
        self._jobs.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.planes = []
        self.k = self.v = []
        self.tier.close()

