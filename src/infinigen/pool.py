"""KV pool manager (paper section 4.4): a capacity limit on the cached tokens per sequence, with a
victim policy that picks which slot a new token overwrites once the pool is full.

Victims are chosen per layer, batch row and KV head (heads read different tokens):
  counter (default)  a per-slot counter incremented whenever the slot is read; the victim has the
                     smallest count (ties: the oldest); when a counter reaches `saturate`, every
                     counter of that (row, head) is halved, so old popularity fades
  lru                the slot read (or written) least recently
  fifo               the slot written first
`protect_recent` keeps the newest N tokens out of reach of eviction (the authors' simulation of the
pool only evicts from the older half), `protect_sinks` the first N positions of the sequence
(attention sinks, StreamingLLM). Invalid slots (left padding) always go first.

The store calls `victims` when it is full, then `on_write` with the slots written, then `on_read`
with the slots the step's attention read (`infinigen.cache.KVStore`, `infinigen.model`).
Policies that keep per-slot state (InfiniGen's partial key cache) follow through `on_append`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UserError

VICTIM_POLICIES = ("counter", "lru", "fifo")
_SHIFT = 40  # counter in the high bits, arrival stamp in the low bits: ties go to the oldest


@dataclass
class KVPool:
    victim: str = "counter"  # "counter" | "lru" | "fifo"
    saturate: int = 255  # counter value that triggers halving (8-bit counters)
    protect_recent: int = 0  # the newest N tokens are never evicted
    protect_sinks: int = 0  # nor the first N positions (attention sinks)

    def __post_init__(self):
        if self.victim not in VICTIM_POLICIES:
            raise UserError(f"eviction policy must be one of {', '.join(VICTIM_POLICIES)}, got {self.victim!r}")
        if self.saturate < 2:
            raise UserError("counter saturation must be at least 2")
        if self.protect_recent < 0 or self.protect_sinks < 0:
            raise UserError("protected recent and sink tokens must be >= 0")

    def begin(self, num_layers: int, batch: int, kv_heads: int, capacity: int, device) -> None:
        if self.protect_recent + self.protect_sinks >= capacity:
            raise UserError(f"cannot protect {self.protect_recent} recent and {self.protect_sinks} sink tokens "
                            f"in a pool of {capacity}")
        self.capacity = capacity
        shape = (batch, kv_heads, capacity)
        # prompt tokens arrive in slot order before every decoded token: stamps -capacity .. -1
        born = (torch.arange(capacity, device=device) - capacity).expand(shape)
        self.count = [torch.zeros(shape, dtype=torch.int32, device=device) for _ in range(num_layers)]
        self.born = [born.clone() for _ in range(num_layers)]  # arrival stamp of each slot's token
        self.last = [born.clone() for _ in range(num_layers)]  # last read or write (LRU)
        self.clock = [0] * num_layers  # decoding steps seen per layer
        self.written = [None] * num_layers  # slots overwritten this step (their reads were of the old token)
        self.evictions = [0] * num_layers

    def victims(self, layer: int, store) -> torch.Tensor:
        """The slot each (row, KV head) overwrites next: [B, Hkv] long."""
        born = self.born[layer]
        if self.victim == "counter":
            key = (self.count[layer].long() << _SHIFT) + (born + self.capacity)
        elif self.victim == "lru":
            key = self.last[layer].clone()
        else:
            key = born.clone()
        key = key.masked_fill(~store.valid[layer], torch.iinfo(torch.long).min)  # empty slots first
        if self.protect_recent:
            newest = born.amax(-1, keepdim=True)
            key = key.masked_fill(born > newest - self.protect_recent, torch.iinfo(torch.long).max)
        if self.protect_sinks:
            sink = store.valid[layer] & (store.pos[layer] < self.protect_sinks)
            key = key.masked_fill(sink, torch.iinfo(torch.long).max)
        self.evictions[layer] += 1
        return key.argmin(-1)

    def on_write(self, layer: int, slots: torch.Tensor) -> None:
        t = self.clock[layer]
        s = slots[:, :, None]
        self.born[layer].scatter_(2, s, t)
        self.last[layer].scatter_(2, s, t)
        self.count[layer].scatter_(2, s, 0)
        self.written[layer] = slots
        self.clock[layer] = t + 1

    def on_read(self, layer: int, mask: torch.Tensor) -> None:
        """mask [B, Hkv, S]: the slots this step's attention read (S <= capacity)."""
        full = torch.zeros_like(self.count[layer], dtype=torch.bool)
        full[:, :, :mask.shape[-1]] = mask
        if self.written[layer] is not None:  # the read was of the token this slot held before
            full.scatter_(2, self.written[layer][:, :, None], False)
            self.written[layer] = None
        if self.victim == "counter":
            c = self.count[layer] + full.int()
            sat = (c >= self.saturate).any(-1, keepdim=True)
            self.count[layer] = torch.where(sat, c // 2, c)
        elif self.victim == "lru":
            self.last[layer].masked_fill_(full, self.clock[layer] - 1)


def make_pool(victim: str = "counter", **kw) -> KVPool:
    return KVPool(victim=victim, **kw)
