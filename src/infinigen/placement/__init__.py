"""Placement: which memory tier the KV pool (and optionally part of the weights) lives in, and how the
rows a policy selects travel to the fast tier. Independent of the policy: any policy runs on any
placement and produces the same tokens.

    placement = Placement(kv_offload="disk")             # or "cpu" (pinned host memory behind a GPU), "none"
    sess = placement.new_session(model, batch, max_len, policy, pool_bytes=2**30)
    ...                                                  # model.prefill / model.decode as usual
    placement.close(sess)                                # removes the pool file
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import KVStore
from ..errors import UserError
from .store import OffloadedKVStore, TransferStats
from .tiers import KINDS, SlowTier

__all__ = ["Placement", "OffloadedKVStore", "TransferStats", "SlowTier", "KINDS", "kv_slot_bytes"]


def kv_slot_bytes(model, batch: int, policy=None, kv_offload: str = "none", pack: bool = True) -> int:
    """Bytes one token slot costs in the KV pool (all layers, sequences and KV heads)."""
    cfg = model.cfg
    codec = policy.codec() if policy is not None else None
    if kv_offload == "none":
        codec = None  # the in-memory store keeps (fake-quantized) values in the model dtype
        pack = False
    return OffloadedKVStore.slot_bytes(cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, model.dtype, codec, pack)


@dataclass
class Placement:
    kv_offload: str = "none"  # none | cpu | disk
    pool_dir: str | None = None  # where the disk tier's file goes (default: the system temp dir)
    prefetch: bool = True  # fetch layer i+1's rows during layer i (False: on demand, no overlap)
    threaded: bool = True  # a worker thread does the gathers (False: inline, for debugging)
    pack: bool = True  # a quantizing policy's KV is packed in the slow tier (INT4: 4 bits per value)

    def validate(self) -> None:
        if self.kv_offload not in KINDS:
            raise UserError(f"--kv-offload must be one of {', '.join(KINDS)}, got {self.kv_offload!r}")

    def capacity(self, model, batch: int, max_len: int, policy=None, capacity: int | None = None,
                 pool_bytes: int | None = None) -> int | None:
        """Token slots of the pool: `capacity` tokens, or as many as `pool_bytes` holds (at most max_len)."""
        if pool_bytes is not None:
            per = kv_slot_bytes(model, batch, policy, self.kv_offload, self.pack)
            by_bytes = pool_bytes // per
            if by_bytes < 1:
                raise UserError(f"a KV pool of {pool_bytes} bytes holds no token (one token costs {per} bytes)")
            capacity = by_bytes if capacity is None else min(capacity, by_bytes)
        if capacity is not None:
            if capacity < 1:
                raise UserError(f"pool capacity must be >= 1 token, got {capacity}")
            capacity = min(capacity, max_len)
        return capacity

    def new_session(self, model, batch: int, max_len: int, policy=None, capacity: int | None = None,
                    pool_bytes: int | None = None, allocator=None, stats: TransferStats | None = None):
        self.validate()
        cap = self.capacity(model, batch, max_len, policy, capacity, pool_bytes)
        if cap is not None and cap < max_len and allocator is None:
            from ..pool import make_pool  # the pool manager's default victim policy (counter)
            allocator = make_pool()
        if self.kv_offload == "none":
            return model.new_session(batch, max_len, policy, capacity=cap, allocator=allocator, store_cls=KVStore)
        tier = SlowTier(self.kv_offload, model.device, self.pool_dir)
        try:
            return model.new_session(batch, max_len, policy, capacity=cap, allocator=allocator,
                                     store_cls=OffloadedKVStore, tier=tier, prefetch=self.prefetch,
                                     threaded=self.threaded, pack=self.pack, stats=stats)
        except BaseException:
            tier.close()
            raise

    def session_kw(self, model) -> dict:
        """Keyword arguments for `model.new_session` (and `generate(..., session_kw=...)`) that put the
        KV pool in this placement's slow tier. A disk pool's directory goes when the store is closed or
        garbage collected."""
        self.validate()
        if self.kv_offload == "none":
            return {}
        return dict(store_cls=OffloadedKVStore, tier=SlowTier(self.kv_offload, model.device, self.pool_dir),
                    prefetch=self.prefetch, threaded=self.threaded, pack=self.pack)

    @staticmethod
    def close(session) -> None:
        session.store.close()

    def describe(self, device: torch.device | str) -> str:
        device = torch.device(device)
        fast = "GPU memory" if device.type == "cuda" else "RAM"
        if self.kv_offload == "none":
            return f"KV in {fast}"
        slow = {"cpu": "pinned host memory" if device.type == "cuda" else "host memory", "disk": "a memory-mapped file"}
        return f"KV pool in {slow[self.kv_offload]}, fetched to {fast}"
