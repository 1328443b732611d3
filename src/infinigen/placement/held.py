"""The rows a corrected layer's own selection adds to its prefetch, held in fast memory for the layer's next steps:
the own query's picks that the speculation misses recur from step to step (results/recall/correction.md), so those
held are copied from fast memory and only the rest is fetched on demand. A part of the offloaded stores
(`OffloadedKVStore`, and `BlockedKVStore` in units of its blocks)."""
from __future__ import annotations

import torch

from .transfer import located


class HeldSet(dict):
    """A store's held entries per layer (`HoldsMisses._held`: layer -> ids, data..., last) and their bytes, kept up
    to date (`nbytes`): the fast bytes are asked after every hold, and summing every layer's each time cost more
    than the hold."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    @staticmethod
    def _size(entry) -> int:
        return sum(t.numel() * t.element_size() for t in entry)

    def __setitem__(self, layer, entry) -> None:
        self.pop(layer, None)
        super().__setitem__(layer, entry)
        self.nbytes += self._size(entry)

    def pop(self, layer, *default):
        if layer in self:
            entry = super().pop(layer)
            self.nbytes -= self._size(entry)
            return entry
        return super().pop(layer, *default)


class HoldsMisses:
    """The held set of `OffloadedKVStore` (its `_held`: per layer the entries, ascending, their data and the step
    each was last added; `_step`, `length`, `bh`, `capacity`, `stats`, `_gather_rows`, `_slow_rows`, `fast` are
    the store's). The entries and steps live on the host, the data in the fast tier: behind a GPU every choice of
    rows is made on the host, which must know them to gather from the slow tier anyway, and only the indices
    travel to the GPU (`_to_fast`), so the main thread does not wait for the GPU here."""
    holds_missed = True  # a corrected layer's missed rows held in fast memory for its next steps (`_hold`)
    # A held row stays while one of the layer's last `hold_steps` corrected selections added it, at most
    # `hold_share` of the layer's used rows held; a layer holding none (its first step) prefetches the speculation
    # at `first_margin` times its cap. Chosen on the validation text at 2048 (results/recall/correction.md: the
    # on-demand share per step 1.66% mean / 2.43% max with one step held and no margin, 1.30% / 1.81% with these)
    hold_steps = 6
    hold_share = 0.10
    first_margin = 1.2

    def _to_fast(self, index: torch.Tensor) -> torch.Tensor:
        """A host index tensor on the fast tier's device (behind a GPU from pinned memory, without waiting)."""
        if index.device.type == self.fast.type:
            return index
        return index.pin_memory().to(self.fast, non_blocking=True)

    def _held_at(self, slots: torch.Tensor) -> torch.Tensor:
        """The held entries (flat store rows) of the slots [B, Hkv], ascending."""
        return (torch.arange(self.bh, device=slots.device) * self.capacity + slots.reshape(-1)).sort().values

    def _unhold(self, layer: int, slots: torch.Tensor) -> None:
        """Drop the layer's held entries of the slots [B, Hkv] a victim's token now takes."""
        held = self._held.get(layer)
        if held is None:
            return
        _, stale = located(self._held_at(slots).to(held[0].device), held[0])
        if bool(stale.any()):
            ids, *data, last = held
            stay = (~stale).nonzero().squeeze(1)
            self._held[layer] = (ids[stay], *(x.index_select(0, self._to_fast(stay)) for x in data), last[stay])

    def _missed_rows(self, layer: int, want: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> int:
        """The rows `want` (flat store order, ascending, on the host) a corrected selection adds to its prefetch, into
        keys, values [m, d]: those held in fast memory (`holds_missed`: the own query's picks the speculation misses
        recur) copied from there, the others gathered from the slow tier. Returns the rows gathered from the slow
        tier."""
        prev = self._held.get(layer)
        lack = torch.arange(want.numel())  # the rows' places that the slow tier fills
        if prev is not None and want.numel():
            at, found = located(prev[0], want)
            hit = found.nonzero().squeeze(1)
            to, frm = self._to_fast(hit), self._to_fast(at[hit])
            keys.index_copy_(0, to, prev[1].index_select(0, frm))
            values.index_copy_(0, to, prev[2].index_select(0, frm))
            lack = (~found).nonzero().squeeze(1)
        if lack.numel():
            k, v = torch.empty_like(keys[:lack.numel()]), torch.empty_like(values[:lack.numel()])
            self._gather_rows(layer, self._slow_rows(want[lack]), k, v)
            to = self._to_fast(lack)
            keys.index_copy_(0, to, k)
            values.index_copy_(0, to, v)
        if self.holds_missed:
            self._hold(layer, want, (keys, values))
        return lack.numel()

    def _hold(self, layer: int, want: torch.Tensor, data: tuple, rows_each: int = 1) -> None:
        """Hold for the layer's next steps what its corrected selection added to the prefetch this step (`want`: rows,
        or the block pool's units of `rows_each` slots, ascending; `data`: their keys and values) with what was held
        before: an entry stays while a corrected selection of the layer's last `hold_steps` steps added it, and past
        `hold_share` of the layer's used rows the entries added longest ago go first. Counted in the fast bytes."""
        prev = self._held.pop(layer, None)
        step = self._step
        last = torch.full((want.numel(),), step, dtype=torch.long)
        if prev is not None:
            ids0, *data0, last0 = prev
            _, again = located(want, ids0)
            old = (~again & (last0 > step - self.hold_steps)).nonzero().squeeze(1)  # not added again, not too old
            want, last = torch.cat([ids0[old], want]), torch.cat([last0[old], last])
            old = self._to_fast(old)
            data = tuple(torch.cat([a.index_select(0, old), b]) for a, b in zip(data0, data))
        limit = int(self.hold_share * self.length[layer] * self.bh) // rows_each
        if want.numel() > limit:  # the most recently added first (stable: ties keep the lower ones)
            keep = torch.sort(last, descending=True, stable=True).indices[:limit]
            want, last = want[keep], last[keep]
            data = tuple(x.index_select(0, self._to_fast(keep)) for x in data)
        if not want.numel():
            return
        order = torch.argsort(want)
        fast_order = self._to_fast(order)
        self._held[layer] = (want[order], *(x.index_select(0, fast_order) for x in data), last[order])
        self.stats.peak_fast_bytes = max(self.stats.peak_fast_bytes, self.fast_bytes())

    def prefetch_margin(self, layer: int) -> float:
        """The factor on `layer`'s cap while its selection is speculated for the prefetch: `first_margin` where the
        corrected layer holds none of its recent misses (its first step: nothing to take them from), else 1."""
        return self.first_margin if self.holds_missed and layer not in self._held else 1.0
