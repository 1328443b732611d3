"""A row cache in the fast tier: the rows recent steps fetched, so a step fetches only the rows it lacks.

Consecutive decoding steps select mostly the same tokens (the same heavy hitters, sinks and recent
window). The cache keeps, per layer, up to `rows` fetched rows (one key and one value vector of a
(slot, sequence, KV head), decoded) with a map from the slow tier's row number to the cache row holding
it. A fetch splits the rows it asks for into hits (copied from the cache) and misses (fetched from the
slow tier, then inserted in place of the rows least recently selected); then every row asked for is
gathered from the cache in one call. Policy-independent: the store
consults it for every selection it fetches; dense layers (every used slot) bypass it.

An entry is the bytes the slow tier holds for that row: a row is written once, at its slot's append
(or the prompt), and never changes until the slot is reused, so the store invalidates a slot's rows
when it writes them (an append into a victim slot under a pool limit, a new prompt).

Each layer's part is used by one thread at a time: a layer's fetch job and its appends never overlap
(the store waits for the job before the layer's attention, and issues the next one after the append).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UserError

MAP_DTYPE = torch.int32  # slow-tier row -> cache row (-1: not cached)


@dataclass
class Lookup:
    """A fetch's rows split: `rows` [N] asked for (repeats allowed: padding columns), `misses` the distinct
    rows not cached (the first occurrence of each, in the fetch's order), `hits` how many distinct rows were."""
    rows: torch.Tensor
    misses: torch.Tensor
    hits: int

    @property
    def distinct(self) -> int:
        return self.hits + self.misses.shape[0]


class RowCache:
    """Per layer: decoded key and value rows [rows, head_dim], the map [slow rows], the owner and the
    fetch at which each cache row was last selected. `budget` bytes in all (layers split it evenly);
    `buffers` (the store's `_Buffers`) allocates each layer's part at its first selection, so the bytes
    count in the store's fast bytes and its peak."""

    def __init__(self, num_layers: int, slow_rows: int, head_dim: int, dtype: torch.dtype, budget: int, buffers):
        self.num_layers, self.slow_rows, self.head_dim, self.dtype = num_layers, slow_rows, head_dim, dtype
        self.budget, self.buffers = budget, buffers
        self.row_bytes = self.bytes_per_row(head_dim, dtype)
        self.rows = self.check_budget(num_layers, slow_rows, head_dim, dtype, budget)
        self._parts: list[dict | None] = [None] * num_layers
        self._tick = [0] * num_layers  # fetches of each layer so far: the clock of its LRU

    @staticmethod
    def bytes_per_row(head_dim: int, dtype: torch.dtype) -> int:
        return 2 * head_dim * torch.empty((), dtype=dtype).element_size() + 2 * 8  # k, v, owner, stamp

    @staticmethod
    def check_budget(num_layers: int, slow_rows: int, head_dim: int, dtype: torch.dtype, budget: int) -> int:
        """`rows_for`, or a UserError where `budget` holds no row (callers check it before any work)."""
        rows = RowCache.rows_for(num_layers, slow_rows, head_dim, dtype, budget)
        if rows < 1:
            map_bytes = slow_rows * torch.empty((), dtype=MAP_DTYPE).element_size()
            row_bytes = RowCache.bytes_per_row(head_dim, dtype)
            need = num_layers * (map_bytes + row_bytes)
            raise UserError(f"a row cache of {budget} bytes holds no row: it needs at least {need} bytes "
                            f"({num_layers} layers, each a {map_bytes}-byte map and {row_bytes} bytes a row)")
        return rows

    @staticmethod
    def rows_for(num_layers: int, slow_rows: int, head_dim: int, dtype: torch.dtype, budget: int) -> int:
        """Cache rows per layer that `budget` bytes hold (each layer also keeps a map of its slow rows)."""
        map_bytes = slow_rows * torch.empty((), dtype=MAP_DTYPE).element_size()
        return max(0, (budget // num_layers - map_bytes) // RowCache.bytes_per_row(head_dim, dtype))

    def layer_bytes(self) -> int:
        """Fast-tier bytes of one layer's part (map, rows, owners, stamps)."""
        return self.slow_rows * torch.empty((), dtype=MAP_DTYPE).element_size() + self.rows * self.row_bytes

    def nbytes(self) -> int:
        """Bytes allocated now (layers that selected so far)."""
        return sum(self.layer_bytes() for p in self._parts if p is not None)

    def _part(self, layer: int) -> dict:
        part = self._parts[layer]
        if part is None:
            get = self.buffers.get
            part = {"map": get(("rowcache", layer, "map"), self.slow_rows, (), MAP_DTYPE).fill_(-1),
                    "k": get(("rowcache", layer, "k"), self.rows, (self.head_dim,), self.dtype),
                    "v": get(("rowcache", layer, "v"), self.rows, (self.head_dim,), self.dtype),
                    "owner": get(("rowcache", layer, "owner"), self.rows, (), torch.long).fill_(-1),
                    "stamp": get(("rowcache", layer, "stamp"), self.rows, (), torch.long).fill_(-1)}
            self._parts[layer] = part
        return part

    def lookup(self, layer: int, rows: torch.Tensor) -> Lookup:
        """Split the slow-tier rows `rows` [N] (any order, repeats allowed) into hits and misses; the hits
        are stamped as selected now, so this fetch's inserts do not evict them."""
        part = self._part(layer)
        self._tick[layer] += 1
        now, where, stamp = self._tick[layer], part["map"], part["stamp"]
        at = where[rows]
        hit = at >= 0
        stamp[at[hit].long()] = now
        hits = int((stamp == now).sum())  # distinct: repeated rows share their cache row
        cand = rows[~hit]
        # the distinct misses without a sort: each writes its own code into the (unused) map entries of the
        # missing rows, one code survives per row, and that occurrence is the row's first
        code = -2 - torch.arange(cand.shape[0], dtype=MAP_DTYPE)
        where[cand] = code
        first = where[cand] == code
        where[cand] = -1
        return Lookup(rows, cand[first], hits)

    def assemble(self, layer: int, look: Lookup, fetched: tuple, out: tuple) -> tuple:
        """The rows asked for, in the fetch's order, into `out` (k, v [N, d]): the misses (`fetched`, k, v
        [M, d] in `look.misses` order) enter the cache first, then every row is read from it in one gather.
        Misses the cache has no room for (a cache smaller than one selection) are filled in from `fetched`."""
        part = self._part(layer)
        n = self._insert(layer, look.misses, fetched)
        src = part["map"][look.rows].long()
        for kind, name in enumerate("kv"):
            torch.index_select(part[name], 0, src.clamp(min=0), out=out[kind])
        if n < look.misses.shape[0]:  # the rows left out of the cache, from the fetched rows
            left = (src < 0).nonzero().squeeze(1)
            rest = look.misses[n:]
            order = torch.argsort(rest)
            pick = n + order[torch.searchsorted(rest[order], look.rows[left])]
            for kind in range(2):
                out[kind][left] = fetched[kind][pick]
        return out

    def _insert(self, layer: int, rows: torch.Tensor, fetched: tuple) -> int:
        """Cache the fetched `rows` [M] in the cache rows selected longest ago (never one this fetch selected);
        when fewer are free than fetched, the first n. Returns n."""
        part = self._part(layer)
        stamp = part["stamp"]
        now = self._tick[layer]
        n = min(rows.shape[0], int((stamp < now).sum()))
        if n == 0:
            return 0
        victims = torch.topk(stamp, n, largest=False, sorted=False).indices
        old = part["owner"][victims]
        part["map"][old[old >= 0]] = -1
        rows = rows[:n]
        part["owner"][victims] = rows
        part["map"][rows] = victims.to(MAP_DTYPE)
        stamp[victims] = now
        for kind, name in enumerate("kv"):
            part[name][victims] = fetched[kind][:n]
        return n

    def invalidate(self, layer: int, rows: torch.Tensor) -> None:
        """The slow tier's `rows` are being rewritten (an append, possibly into a reused slot): forget them."""
        part = self._parts[layer]
        if part is None:
            return
        at = part["map"][rows].long()
        at = at[at >= 0]
        if at.numel():
            part["owner"][at] = -1
            part["stamp"][at] = -1
        part["map"][rows] = -1

    def reset(self, layer: int) -> None:
        """A new prompt in the layer: nothing cached is valid."""
        part = self._parts[layer]
        if part is not None:
            part["map"].fill_(-1)
            part["owner"].fill_(-1)
            part["stamp"].fill_(-1)
