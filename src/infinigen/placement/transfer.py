"""What moves between the tiers: the transfer counters (`TransferStats`), the fast tier's growable buffers
(`_Buffers`) and what reading scattered rows costs a file (`touched_page_share`)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

KV = (0, 1)  # keys, values
PAGE = 4096  # the unit the kernel reads a file in (a fault, a page-cache page)


def fetch_worker(threads: int) -> ThreadPoolExecutor:
    """A store's worker thread, its torch ops on `threads` intra-op threads, started now. torch.set_num_threads
    there also sets the count each thread takes at its first parallel op in torch or in one of our kernels (ATen's
    lazy init, once per thread and library): left so, the compute thread's first call of a kernel after a worker
    started would drop it to the worker's count. So once the worker has set its own, this thread sets the count
    back to its own."""
    keep = torch.get_num_threads()
    pool = ThreadPoolExecutor(1, thread_name_prefix="infinigen-fetch", initializer=torch.set_num_threads,
                              initargs=(threads,))
    pool.submit(int).result()  # the worker runs its initializer before its first job
    torch.set_num_threads(keep)
    return pool


def touched_page_share(rows: torch.Tensor, row_bytes: int, used_rows: int) -> float:
    """Share of the pages of a layer's first `used_rows` rows (`row_bytes` each, from the start of a page)
    that the rows `rows` lie on: what reading only those rows costs a file, in its own unit."""
    pages = -(-used_rows * row_bytes // PAGE)
    if pages == 0:
        return 0.0
    first = rows * row_bytes // PAGE
    last = (rows * row_bytes + row_bytes - 1) // PAGE
    hit = torch.zeros(pages + 1, dtype=torch.bool)
    hit[first.cpu()] = True
    hit[last.cpu()] = True  # a row across a page boundary touches both
    return float(hit[:pages].sum()) / pages


def located(held: torch.Tensor, wanted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(at, found) per entry of `wanted`: its place in the ascending `held` and whether it is there (at is 0 where
    `held` is empty)."""
    if not held.numel():
        return torch.zeros_like(wanted), torch.zeros(wanted.shape, dtype=torch.bool, device=wanted.device)
    at = torch.searchsorted(held, wanted).clamp_(max=held.numel() - 1)
    return at, held[at] == wanted


@dataclass
class TransferStats:
    """What moved from the slow tier to the fast tier, and where the time went."""
    bytes_moved: int = 0
    rows_moved: int = 0  # key+value vectors of one (slot, sequence, KV head)
    fetches: int = 0  # fetch jobs run (prefetched or on demand)
    on_demand: int = 0  # fetched when attention asked (nothing planned, or the plan differed)
    stale: int = 0  # prefetched but not what attention read (wasted)
    missed: int = 0  # rows a layer's own selection read that its prefetch missed, fetched on demand
    held: int = 0  # such rows taken from fast memory instead, where the layer's last step held them
    reused: int = 0  # selections the plan served (its slot indices taken; behind a GPU: one equal to the plan)
    bulk: int = 0  # disk: selections read as the whole used layer (they touched most of its pages)
    blocks: int = 0  # disk in blocks (`BlockedKVStore`): units read from the file
    missed_blocks: int = 0  # of those, units a layer's own selection read on demand (its prefetch had not)
    gather_s: float = 0.0  # time spent in prefetch jobs (on the worker thread: overlapped with compute)
    ondemand_s: float = 0.0  # time fetching on demand (main thread, not overlapped)
    wait_s: float = 0.0  # main thread waiting for a prefetch to finish
    peak_fast_bytes: int = 0  # staging + fetched rows + metadata (+ the row cache) held in the fast tier
    # the row cache (`RowCache`): distinct rows selections asked for, and how many of them it held
    row_lookups: int = 0
    row_hits: int = 0
    # per decoding step (while a row cache is on): [hits, distinct rows asked for, rows fetched from the
    # slow tier, bytes read from it] over the step's selecting layers
    row_steps: list = field(default_factory=list)
    # per decoding step: [rows prefetched, rows the prefetch missed that the layers' own selections read, fetched
    # on demand (not those held in fast memory), rows of the used KV over every layer, seconds fetching them]
    steps: list = field(default_factory=list)
    # behind a GPU: on-demand counts still on their way from the device (`fetched_later`, `settle`)
    pending: list = field(default_factory=list)

    def missed_shares(self) -> list[float]:
        """Per decoding step: the rows fetched on demand because the prefetch missed them, as a share of
        the used KV."""
        return [m / kv for _, m, kv, _ in self.steps if kv]

    def fetched_missed(self, rows: int, nbytes: int, seconds: float, units: int = 0, held: int = 0) -> None:
        """Count one on-demand fetch of the `rows` a layer's own selection read and its prefetch missed: `nbytes`
        read from the slow tier in `seconds` (`units`: the file's blocks read, for a pool in blocks; `held`: more
        such rows, taken from fast memory, where the layer's last step held them)."""
        self.on_demand += 1
        self.missed += rows
        self.held += held
        self.missed_blocks += units
        self.rows_moved += rows
        self.bytes_moved += nbytes
        self.ondemand_s += seconds
        if self.steps:
            self.steps[-1][1] += rows
            self.steps[-1][3] += seconds

    def fetched_later(self, rows: torch.Tensor, row_bytes: int, seconds: float, missed: bool = True) -> None:
        """`fetched_missed` of counts [2] on the GPU: the rows a corrected layer's own selection read from the slow
        tier beyond its prefetch (`row_bytes` each for keys and for values), and 1 where the selection differs
        from the plan (else the plan served it: `reused`, as the host counts a selection equal to its plan). Copied
        to pinned memory without waiting, folded in by `settle` once there: the decoding loop never waits for it.
        `missed=False`: the rows of a selection read where they lie, no prefetch (`Placement.read_in_place`),
        counted as a fetch of them."""
        self.ondemand_s += seconds
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        self.pending.append((len(self.steps) - 1, host, ready, row_bytes, missed))

    def settle(self, wait: bool = False) -> None:
        """Fold in the counts `fetched_later` sent that have arrived (`wait`: all of them, waiting for the
        GPU: for a reader after decoding)."""
        left = []
        for entry in self.pending:
            step, host, ready, row_bytes, missed = entry
            if wait:
                ready.synchronize()
            elif not ready.query():
                left.append(entry)
                continue
            rows, differs = host.tolist()
            if missed and not differs:  # the plan served the selection
                self.reused += 1
                continue
            self.rows_moved += rows
            self.bytes_moved += 2 * rows * row_bytes
            if missed:
                self.on_demand += 1
                self.missed += rows
            else:  # a selection read in place: a fetch of its rows
                self.fetches += 1
            if 0 <= step < len(self.steps):
                self.steps[step][1 if missed else 0] += rows
        self.pending = left

    def hit_rate(self) -> float | None:
        """Share of the distinct selected rows the row cache held (None: no lookup, or no cache)."""
        return self.row_hits / self.row_lookups if self.row_lookups else None

    def reset(self) -> None:
        keep = self.peak_fast_bytes
        self.__init__()
        self.peak_fast_bytes = keep


class _Buffers:
    """Growable buffers, keyed by (role, parity, kind, plane); accounts for the fast tier's share."""

    def __init__(self, fast: torch.device, stats: TransferStats, extra_bytes: int):
        self.fast, self.stats, self.extra = fast, stats, extra_bytes
        self.bufs: dict[tuple, torch.Tensor] = {}

    def get(self, key, rows: int, shape, dtype, host_pinned: bool = False, read_on=None) -> torch.Tensor:
        """The first `rows` rows of buffer `key`, grown by 25% at least when too short. CUDA: growth needs no
        synchronize. The caching allocators reuse a dropped buffer's memory only after the work queued on it
        is done: a device buffer's on the stream it was allocated on and on `read_on` (a second stream that
        reads it, recorded here), a pinned host buffer's after the copies that read it."""
        t = self.bufs.get(key)
        if t is None or t.shape[0] < rows:
            cap = max(rows, int(1.25 * t.shape[0]) if t is not None else rows, 1)
            self.bufs.pop(key, None)
            device = torch.device("cpu") if host_pinned else self.fast
            with torch.inference_mode(False):  # a normal tensor: the worker thread (not in inference mode) and
                # the main thread (decoding in it) both write it, whichever made it
                t = torch.empty((cap, *shape), dtype=dtype, device=device, pin_memory=host_pinned)
            if read_on is not None:
                t.record_stream(read_on)
            self.bufs[key] = t
            self.stats.peak_fast_bytes = max(self.stats.peak_fast_bytes, self.fast_bytes())
        return t[:rows]

    def fast_bytes(self) -> int:
        staged = list(self.bufs.items())
        return self.extra + sum(t.numel() * t.element_size() for k, t in staged if k[0] != "stage")
