"""What an offloaded store does behind a GPU (a part of `OffloadedKVStore`): the pool lives in pinned host
memory, the host gathers the rows a selection names, and the copies run on a copy stream, ordered by events, so
the main thread does not wait for the GPU. A corrected layer's own selection stays on the GPU where it can
(`_select_on_device`, `_corrected_on_device`): the attention reads the rows the prefetch missed from the pinned
pool itself, over the bus. Elsewhere (a packed pool, a file, no triton) it is packed on the host from one copy of
its mask (`_select_on_host`), and the host gathers the missed rows."""
from __future__ import annotations

import time

import torch

from ..cache import HandedRows, KVStore, SelectedRows
from ..kernels import fused_select
from .rows import PlainRows
from .transfer import KV


class BehindGpu:
    """`OffloadedKVStore`'s CUDA paths (`copy_stream`, `buffers`, `planes`, `layout`, `_lock`, `_pending`,
    `_copied`, `_consumed`, `_compute_stream`, `_own_host`, `_to_fast`, `stats` are the store's)."""
    # Behind a GPU a corrected layer's own selection is packed on the GPU and the rows its prefetch missed are read
    # by the attention from the pinned pool (False: packed on the host, the missed rows gathered and held there)
    corrects_on_device = True
    # Behind a GPU every selection's rows are read by the attention from the pinned pool, none prefetched
    # (`Placement.read_in_place`; a layer reading every slot is still prefetched whole)
    reads_in_place = False

    def _pool_readable(self) -> bool:
        """Whether the attention can read the pool where it lies: pinned host memory whose rows are what the
        attention reads (the plain layout), and the Triton kernel, which reads them over the bus (UVA)."""
        return (self.cuda and self.tier.pinned and type(self.layout) is PlainRows and fused_select.enabled
                and fused_select._triton_kernel() is not None)

    def _on_device(self) -> bool:
        """Whether a corrected selection stays on the GPU (`corrects_on_device` where the pool is readable)."""
        return self.corrects_on_device and self._pool_readable()

    def _in_place(self) -> bool:
        """Whether selections are read where they lie (`reads_in_place` where the pool is readable). Not under a pool
        limit: with no prefetch to pace it the host may run a step ahead of the GPU, and a victim's slot written to
        the pool then could still be read by the step before."""
        return self.reads_in_place and self.allocator is None and self._pool_readable()

    def _read_in_place(self, layer, sel, buffer) -> HandedRows:
        """`hand_rows` of a selection packed on the GPU with no prefetch: every entry read by the attention from the
        pinned pool where it lies (`HandedRows.far`), the buffer holding only the token's spare rows; the rows read
        counted on the device and sent back unwaited."""
        t0 = time.perf_counter()
        self._flush(layer)
        if self._spare_like is None:
            self._spare_like = torch.empty((0, self.head_dim), dtype=self.dtype, device=self.fast)
        keys, values = buffer(self.bh, self._spare_like)
        real = sel.head >= 0
        local = (self.bh + self._slow_rows(sel.rows)) * real
        own = torch.arange(self.bh, device=self.fast).view(self.batch, self.kv_heads)
        far = (self.planes[layer][0][0], self.planes[layer][1][0], self.bh)
        counts = torch.stack([real.sum(), torch.ones((), dtype=torch.long, device=self.fast)])
        self.stats.fetched_later(counts, self.layout.row_bytes, time.perf_counter() - t0, missed=False)
        return HandedRows(keys, values, local, own, far)

    def _select_on_device(self, keep, valid) -> SelectedRows:
        """`select_rows` on the GPU without waiting: each batch row's entries head-major as `KVStore.select_rows`
        packs them, padded to every (KV head, slot) of the row (a width known without counting them), the entries
        counted on the device (`SelectedRows.read`)."""
        keep = keep & valid
        b, h, s = keep.shape
        dev = keep.device
        flat = keep.reshape(b, h * s)
        width = h * s
        at = torch.where(flat, flat.cumsum(1) - 1, width)  # each entry's column; the others past the end
        entry = torch.arange(width, device=dev)
        head = (entry // s).expand(b, width)
        store_row = (torch.arange(b, device=dev)[:, None] * h + head) * self.capacity + entry % s
        rows = torch.zeros(b, width + 1, dtype=torch.long, device=dev).scatter_(1, at, store_row)[:, :width]
        heads = torch.full((b, width + 1), -1, dtype=torch.long, device=dev).scatter_(1, at, head)[:, :width]
        counts = keep.sum(-1)
        return SelectedRows(keep, rows, heads, counts, counts.sum())

    def _corrected_on_device(self, layer, job, sel, buffer) -> HandedRows:
        """`_corrected` on the GPU: the prefetched rows and the token's spare rows in `buffer`, each of `sel`'s
        entries read from there where the prefetch has it, else from the pinned pool where it lies (`HandedRows.far`:
        the attention reads it over the bus), the count of those (and whether the selection is the plan's) sent to
        the host without waiting. The host's writes to the pool (`_flush`) stay behind the GPU's reads: the fetch of
        a layer waits for the copies two layers back, so the host is never a step ahead of the attention reading
        this layer (a victim's slot is not rewritten while an earlier step reads it)."""
        t0 = time.perf_counter()
        self._flush(layer)  # the tokens appended since the prefetch, in the pool before the GPU reads it
        p = job.selected
        keys, values = buffer(p + self.bh, job.kv[0])
        keys[:p], values[:p] = job.kv[0][:p], job.kv[1][:p]
        planned = job.selection.keep.reshape(-1)  # the prefetched entries, in the buffer's order
        place = planned.cumsum(0) - 1
        real = sel.head >= 0
        entry = sel.rows // self.capacity * sel.keep.shape[-1] + sel.rows % self.capacity
        hit = planned[entry] & real
        split = p + self.bh
        local = torch.where(hit, place[entry], split + self._slow_rows(sel.rows)) * real
        own = p + torch.arange(self.bh, device=self.fast).view(self.batch, self.kv_heads)
        far = (self.planes[layer][0][0], self.planes[layer][1][0], split)
        counts = torch.stack([(real & ~hit).sum(), (sel.keep != job.selection.keep).any().long()])
        self.stats.fetched_later(counts, self.layout.row_bytes, time.perf_counter() - t0)
        return HandedRows(keys, values, local, own, far)

    def _write_async(self, layer, rows, data):
        """CUDA: copy the new rows device->pinned host on the copy stream; they enter the pool (a host-side
        index_copy) before the next read of this layer, by which time the copy has long finished."""
        produced = torch.cuda.Event()
        produced.record()
        host = []
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(produced)
            for d in [rows] + data[0] + data[1]:
                d.record_stream(self.copy_stream)
                dst = torch.empty(d.shape, dtype=d.dtype, pin_memory=True)
                dst.copy_(d, non_blocking=True)
                host.append(dst)
            ev = torch.cuda.Event()
            ev.record(self.copy_stream)
        p = len(self.layout.planes)
        with self._lock:
            self._pending[layer].append((ev, host[0], [host[1:1 + p], host[1 + p:]]))

    def _select_on_host(self, layer, keep, valid, planned):
        """CUDA: `select_rows` packed on the host from one copy of the mask (the main thread waits once; packing on
        the GPU waits for its counts several times), the packed rows sent back without waiting. The host's copy of
        the rows and heads is kept for `_corrected`, which gathers the ones the prefetch missed."""
        keep, valid = torch.broadcast_tensors(keep, valid)
        keep_h, valid_h = torch.stack([keep, valid]).cpu()
        if (planned is not None and planned.plan_host is not None and keep_h.shape == planned.plan_host.shape
                and torch.equal(keep_h, planned.plan_host)):
            self.stats.reused += 1
            return planned.selection
        packed = KVStore.select_rows(self, layer, keep_h, valid_h)
        sel = SelectedRows(keep & valid, *(self._to_fast(x) for x in packed[1:4]))
        self._own_host = (sel.rows, packed.rows, packed.head)
        return sel

    def _host_rows(self, sel) -> tuple[torch.Tensor, torch.Tensor]:
        """`sel`'s rows and heads on the host: the copy `_select_on_host` kept, else one copy now."""
        if not self.cuda:
            return sel.rows, sel.head
        own = self._own_host
        if own is not None and own[0] is sel.rows:
            return own[1], own[2]
        rows, head = torch.stack([sel.rows, sel.head]).cpu()
        return rows, head

    def _run_cuda(self, job, rows, total):
        """The worker's part of a fetch behind a GPU: the rows gathered on the host into pinned staging (or the
        used prefix as it lies), copied on the copy stream once layer-2's attention is done with the buffers."""
        parity = job.layer % 2
        planes = self.planes[job.layer]
        if rows is not None:  # gather on the host into pinned staging, once its previous copy is done
            prev = self._copied[parity]
            if prev is not None:
                prev.synchronize()
            src = [[torch.index_select(pl, 0, rows, out=self.buffers.get(("stage", parity, kind, p), total,
                                                                          pl.shape[1:], pl.dtype, host_pinned=True))
                    for p, pl in enumerate(planes[kind])] for kind in KV]
        else:  # full offload: the used prefix is contiguous pinned memory already
            src = [[pl[:total] for pl in planes[kind]] for kind in KV]
        with torch.cuda.stream(self.copy_stream):
            consumed = self._consumed[parity]
            if consumed is not None:
                self.copy_stream.wait_event(consumed)  # layer-2's attention no longer reads these buffers
            raw = []
            for kind in KV:
                dst = []
                for p, s in enumerate(src[kind]):
                    d = self.buffers.get(("raw", parity, kind, p), total, s.shape[1:], s.dtype,
                                         read_on=self._compute_stream)
                    d.copy_(s, non_blocking=True)
                    dst.append(d)
                raw.append(dst)
            ev = torch.cuda.Event()
            ev.record(self.copy_stream)
        self._copied[parity] = ev
        job.ready, job.raw = ev, raw

    def _finish(self, job, kind, planes) -> torch.Tensor:
        """CUDA, compute stream: reorder a full-layer copy to (b, h, i) and decode packed rows."""
        parity = job.layer % 2
        if job.full:
            out = []
            for p, pl in enumerate(planes):
                shape = pl.shape[1:]
                buf = self.buffers.get(("fast", parity, kind, p), pl.shape[0], shape, pl.dtype)
                src = pl.view(job.n, self.batch, self.kv_heads, *shape).permute(1, 2, 0, *range(3, 3 + len(shape)))
                buf.view(self.batch, self.kv_heads, job.n, *shape).copy_(src)
                out.append(buf)
            planes = out
        return self.layout.decode(planes)
