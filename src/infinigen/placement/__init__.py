"""Placement: which memory tier the KV pool (and optionally part of the weights) lives in, how large the
pool is, and how the rows a policy selects travel to the fast tier. Independent of the policy: any
policy runs on any placement and produces the same tokens.

    placement = Placement(kv_offload="disk", pool_bytes=2**30)    # or "cpu" (pinned host memory behind a GPU), "none"
    sess = placement.new_session(model, batch, max_len, policy)   # a runtime.Session over placement.new_store(...)
    ...                                                           # runtime.prefill / runtime.decode as usual
    placement.close(sess)                                         # removes the pool file
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..cache import KVStore
from ..errors import ArgumentError, UserError
from ..runtime import Session
from .blocks import BlockedKVStore
from .rowcache import RowCache
from .store import OffloadedKVStore
from .transfer import TransferStats
from .tiers import KINDS, SlowTier

__all__ = ["Placement", "OffloadedKVStore", "BlockedKVStore", "TransferStats", "SlowTier", "KINDS",
           "kv_slot_bytes"]

EVICTIONS = ("counter", "lru", "fifo")


def kv_slot_bytes(model, batch: int, policy=None, kv_offload: str = "none", pack: bool = True) -> int:
    """Bytes one token slot costs in the KV pool (all layers, sequences and KV heads)."""
    cfg = model.cfg
    codec = policy.codec() if policy is not None else None
    if kv_offload == "none":
        codec = None  # the in-memory store keeps (fake-quantized) values in the model dtype
        pack = False
    return OffloadedKVStore.slot_bytes(cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, model.dtype, codec, pack)


@dataclass(frozen=True)
class Placement:
    kv_offload: str = "none"  # none | cpu | disk
    pool_dir: str | None = None  # where the disk tier's file goes (default: the system temp dir)
    capacity: int | float | None = None  # pool limit: tokens per sequence, or a float in (0, 1]: that share of max_len
    pool_bytes: int | None = None  # pool limit in bytes (of the slow tier when offloaded)
    evict: str = "counter"  # victim choice once the pool is full: counter | lru | fifo (`infinigen.pool`)
    prefetch: bool = True  # fetch layer i+1's rows during layer i (False: on demand, no overlap)
    # offloaded: a policy that speculates ahead (InfiniGen's default, but on the disk in blocks: `ahead_pays`)
    # selects again with each layer's own query at its attention, reading what it selects in fast memory; the store
    # fetches on demand the rows the prefetch missed (False: the layer reads what was speculated and prefetched)
    correct: bool = True
    threaded: bool = True  # a worker thread does the gathers (False: inline, for debugging)
    pack: bool = True  # a quantizing policy's KV is packed in the slow tier (INT4: 4 bits per value)
    protect_recent: int = 0  # the pool never evicts the newest N tokens
    # disk tier: a selection touching more than this share of a layer's file pages is read as the whole
    # used layer, sequentially, and selected in RAM (`OffloadedKVStore`; 1: always only the rows)
    disk_bulk_share: float = 0.25
    # fast-tier bytes of the row cache (`rowcache.RowCache`: the rows recent steps fetched, so a step fetches
    # only those it lacks); 0: off, the default (results/row_cache/: on this disk it saves no read)
    row_cache_bytes: int = 0
    # disk tier on a CPU host: the pool in page-aligned blocks of this many consecutive tokens per (layer,
    # batch row, KV head), read with positioned reads of exactly the blocks a selection names
    # (`blocks.BlockedKVStore`); 0: the slot-major memory-mapped file
    disk_block: int = 0
    # behind a GPU with the pool in pinned host memory: the attention reads each selection's rows where they lie,
    # over the bus, none prefetched by a host gather (a layer reading every slot is still prefetched whole). In
    # effect only where it applies (a plain pool in pinned memory, triton, no pool limit, whose victims the
    # prefetch's pace keeps apart from the reads); elsewhere selections are prefetched. On by default: measured
    # 0.86-1.38x full offload's step at 8192 and 1.5-2.4x faster at 32768, where prefetching forms are host-bound
    read_in_place: bool = True

    def __post_init__(self):
        if self.kv_offload not in KINDS:
            raise ArgumentError("kv_offload", f"must be one of {', '.join(KINDS)}, got {self.kv_offload!r}")
        if self.evict not in EVICTIONS:
            raise ArgumentError("evict", f"must be one of {', '.join(EVICTIONS)}, got {self.evict!r}")
        c = self.capacity
        if c is not None:
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
                raise ArgumentError("capacity",
                                    f"must be a positive number of tokens (or a fraction in (0, 1]), got {c!r}")
            if isinstance(c, float) and c > 1 and c != int(c):
                raise ArgumentError("capacity", f"above 1 is a token count and must be an integer, got {c}")
        if self.pool_bytes is not None and (isinstance(self.pool_bytes, bool) or not isinstance(self.pool_bytes, int)
                                            or self.pool_bytes < 1):
            raise ArgumentError("pool_bytes", f"must be a positive whole number of bytes, got {self.pool_bytes!r}")
        b = self.disk_bulk_share
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b <= 1:
            raise ArgumentError("disk_bulk_share", f"must be in [0, 1], got {b!r}")
        r = self.row_cache_bytes
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ArgumentError("row_cache_bytes", f"must be a whole number of bytes >= 0 (0: off), got {r!r}")
        if r and self.kv_offload == "none":
            raise ArgumentError("row_cache_bytes", "needs an offloaded KV pool (kv_offload cpu or disk)")
        d = self.disk_block
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ArgumentError("disk_block", f"must be a whole number of tokens >= 0 (0: off), got {d!r}")
        if d and self.kv_offload != "disk":
            raise ArgumentError("disk_block", "needs the disk tier (kv_offload disk)")
        if d and r:
            raise ArgumentError("disk_block", "the block layout has no row cache (row_cache_bytes 0)")
        if self.protect_recent < 0:
            raise ArgumentError("protect_recent", f"must be >= 0, got {self.protect_recent}")

    @property
    def limited(self) -> bool:
        return self.capacity is not None or self.pool_bytes is not None

    def pool_tokens(self, model, batch: int, max_len: int, policy=None) -> int:
        """Token slots of the pool (the one capacity resolver): max_len, or fewer when `capacity` (tokens,
        or a share of max_len) or `pool_bytes` (as many slots as fit) says so."""
        cap = max_len
        c = self.capacity
        if c is not None:
            cap = min(cap, math.floor(c * max_len) if isinstance(c, float) and c <= 1 else int(c))
            if cap < 1:
                raise UserError(f"a KV pool of capacity {c} holds no token of a {max_len}-token sequence")
        if self.pool_bytes is not None:
            per = kv_slot_bytes(model, batch, policy, self.kv_offload, self.pack)
            if self.disk_block:  # the file's units are padded to whole pages
                cfg = model.cfg
                per = BlockedKVStore.slot_bytes(cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, model.dtype,
                                                policy.codec() if policy is not None else None, block=self.disk_block)
            by_bytes = self.pool_bytes // per
            if by_bytes < 1:
                raise UserError(f"a KV pool of {self.pool_bytes} bytes holds no token (one token costs {per} bytes)")
            cap = min(cap, by_bytes)
        return cap

    def check_row_cache(self, model, batch: int, max_len: int, policy=None) -> None:
        """A UserError now, before any work, where the row cache cannot hold one row of the store that
        `new_store(model, batch, max_len, policy)` would make (its map of the pool's rows grows with both)."""
        if not self.row_cache_bytes or self.kv_offload == "none":
            return
        cfg = model.cfg
        rows = self.pool_tokens(model, batch, max_len, policy) * batch * cfg.num_kv_heads
        RowCache.check_budget(cfg.num_layers, rows, cfg.head_dim, model.dtype, self.row_cache_bytes)

    def new_store(self, model, batch: int, max_len: int, policy=None, prompt_len: int | None = None,
                  stats: TransferStats | None = None, allocator=None) -> KVStore:
        """The KV store of a session of `batch` rows and up to `max_len` tokens each, with this placement's
        tier and pool limit. `prompt_len`: fail now if the prompt cannot fit. `allocator`: a victim policy
        of `infinigen.pool` instead of `evict`'s (also without a limit, e.g. to count reads)."""
        cfg = model.cfg
        cap = self.pool_tokens(model, batch, max_len, policy)
        if prompt_len is not None and prompt_len > cap:
            raise UserError(f"a KV pool of {cap} tokens cannot hold the {prompt_len}-token prompt")
        if allocator is None and cap < max_len:
            from ..pool import make_pool
            allocator = make_pool(self.evict, protect_recent=self.protect_recent)
        if allocator is not None:
            allocator.begin(cfg.num_layers, batch, cfg.num_kv_heads, cap, model.device)
        codec = policy.codec() if policy is not None else None
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, cap, cfg.head_dim, model.dtype, model.device)
        if self.kv_offload == "none":
            return KVStore(*shape, codec=codec, allocator=allocator)
        tier = SlowTier(self.kv_offload, model.device, self.pool_dir)
        try:
            if self.disk_block:
                store = BlockedKVStore(*shape, codec=codec, allocator=allocator, tier=tier, prefetch=self.prefetch,
                                       threaded=self.threaded, stats=stats, block=self.disk_block)
            else:
                store = OffloadedKVStore(*shape, codec=codec, allocator=allocator, tier=tier, prefetch=self.prefetch,
                                         threaded=self.threaded, pack=self.pack, stats=stats,
                                         bulk_share=self.disk_bulk_share, row_cache_bytes=self.row_cache_bytes)
            # a store that cannot fetch only the rows a prefetch missed would read a corrected selection whole,
            # on demand, after its prefetch: it reads what was speculated
            store.corrects = self.correct and store.fetches_missing
            store.reads_in_place = self.read_in_place
            return store
        except BaseException:
            tier.close()
            raise

    def new_session(self, model, batch: int, max_len: int, policy=None, prompt_len: int | None = None,
                    stats: TransferStats | None = None, allocator=None, listeners=()):
        """A `runtime.Session` of `batch` rows over a store of this placement (see `new_store`), with the
        policy's per-request state and `listeners` (`runtime.Listener`)."""
        store = self.new_store(model, batch, max_len, policy, prompt_len, stats, allocator)
        try:
            return Session(model, store, policy, batch, listeners)
        except BaseException:
            store.close()
            raise

    @staticmethod
    def close(session) -> None:
        session.store.close()

    def settings(self) -> dict:
        """The placement as JSON-able values (for results)."""
        return {"kv_offload": self.kv_offload, "capacity": self.capacity, "pool_bytes": self.pool_bytes,
                "evict": self.evict, "protect_recent": self.protect_recent, "row_cache_bytes": self.row_cache_bytes,
                "disk_block": self.disk_block, "correct": self.correct, "read_in_place": self.read_in_place}

    def describe(self, device: torch.device | str) -> str:
        device = torch.device(device)
        fast = "GPU memory" if device.type == "cuda" else "RAM"
        if self.kv_offload == "none":
            return f"KV in {fast}"
        slow = {"cpu": "pinned host memory" if device.type == "cuda" else "host memory",
                "disk": f"a file of page-aligned blocks of {self.disk_block} tokens" if self.disk_block
                else "a memory-mapped file"}
        return f"KV pool in {slow[self.kv_offload]}, fetched to {fast}"
