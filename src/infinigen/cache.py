"""The KV store: preallocated keys and values per layer, written in place.

Slot order is free: positions live inside the keys (post-RoPE) or the hidden state (OPT),
so a pool limit may overwrite any slot. `pos` remembers which token each slot holds.
Placement (which memory tier a store lives in) is decided by subclasses in `infinigen.placement`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .codecs import KVCodec
from .errors import UserError
from .kernels import fused_select


def _scatter_rows(buf: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> None:
    """buf.scatter_(2, idx, rows), 16-bit floats moved as int16 (the same bits): scatter_ on bfloat16 or
    float16 takes a slow path in torch 2.13 on CPU (55 ms for one token into a [8, 3, 8192, 64] buffer,
    against 7 us as int16)."""
    if buf.dtype in (torch.bfloat16, torch.float16) and rows.dtype == buf.dtype:
        buf, rows = buf.view(torch.int16), rows.view(torch.int16)
    buf.scatter_(2, idx, rows)


class SelectedRows(NamedTuple):
    """A selection as the rows it reads (`KVStore.select_rows`), packed per batch row.

    keep    [B, Hkv, S] the selected slots (the selection and the valid slots)
    rows    [B, n] each column's row in the layer's flat [B * Hkv * capacity, d] keys and values
    head    [B, n] each column's KV head; -1 on padding (a batch row with fewer rows than the longest)
    counts  [B, Hkv] entries selected per (batch row, KV head)
    read    the entries selected, counted on the device, where the packing is padded to a width fixed in advance
            (behind a GPU a corrected selection is packed without waiting for its counts); None: the rows' width
            says what a gather moves
    """
    keep: torch.Tensor
    rows: torch.Tensor
    head: torch.Tensor
    counts: torch.Tensor
    read: torch.Tensor | None = None


class HandedRows(NamedTuple):
    """A selection's rows handed to the attention in a fast buffer (`KVStore.hand_rows`): the rows of
    `SelectedRows` in its packed order, then one spare row per (batch row, KV head) for the token's own key and
    value, which the attention writes (the token is stored after the attention: victims, codecs).

    keys, values  [M, d] the buffer: the selected rows first, then the spare rows
    rows          [B, n] each packed column's row in the buffer (padding: row 0)
    own           [B, Hkv] the spare row of each (batch row, KV head)
    far           None, or (keys, values, split): a row of `split` or more is row (row - split) of these [N', d]
                  tensors instead, which the GPU reads where they lie (a pool in pinned host memory, over the bus)
    """
    keys: torch.Tensor
    values: torch.Tensor
    rows: torch.Tensor
    own: torch.Tensor
    far: tuple | None = None


def packed_order(sel: SelectedRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selected entries of `sel` without its padding, in its packed order: (their rows in the flat
    [B * Hkv * capacity, d] store [total], each packed column's place among them [B, n] (padding: 0), and a
    spare place after them for each (batch row, KV head)'s own token [B, Hkv])."""
    return (sel.rows[sel.head >= 0], *packed_places(sel))


def packed_places(sel: SelectedRows, total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`packed_order`'s places without its rows, and without waiting on the device: each packed column's place
    among the selected entries [B, n] (padding: 0), and a spare place after the `total` selected entries (None:
    counted on the device) for each (batch row, KV head)'s own token [B, Hkv]."""
    real = sel.head >= 0
    local = (real.reshape(-1).cumsum(0) - 1).view_as(sel.rows) * real
    b, h = sel.counts.shape
    base = sel.counts.sum() if total is None else total
    return local, base + torch.arange(b * h, device=sel.rows.device).view(b, h)


class KVStore:
    offloaded = False  # the pool lives in fast memory

    def __init__(self, num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", codec: KVCodec | None = None,
                 allocator=None):
        self.capacity = capacity
        self.codec = codec or KVCodec()
        self.allocator = allocator  # victim choice once `capacity` is reached (infinigen.pool)
        shape = (batch, kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.valid = [torch.zeros(shape[:3], dtype=torch.bool, device=device) for _ in range(num_layers)]
        self.pos = [torch.full(shape[:3], -1, dtype=torch.long, device=device) for _ in range(num_layers)]
        self.length = [0] * num_layers  # slots in use (the append pointer until the pool is full)
        self.padded = False  # a prompt had padding: some used slots are not valid
        self._appended_at: tuple = (None, None)  # ((slot, B, Hkv, device), [B, Hkv] that slot): `_slot_tensor`

    def past(self, layer: int):
        """Views of the used slots: k, v [B,Hkv,S,d], valid and pos [B,Hkv,S]."""
        n = self.length[layer]
        return self.k[layer][:, :, :n], self.v[layer][:, :, :n], self.valid[layer][:, :, :n], self.pos[layer][:, :, :n]

    def used_keys_values(self, layer: int):
        """Views of the used slots' keys and values [B,Hkv,S,d] (`past` without the metadata)."""
        n = self.length[layer]
        return self.k[layer][:, :, :n], self.v[layer][:, :, :n]

    def keys_values(self, layer: int, start: int, stop: int):
        """Keys and values [B,Hkv,stop-start,d] of slots start..stop-1 as stored (views here; a store on disk
        reads them): what a prefix cache keeps of a prompt, and what a prefill continuing one attends over."""
        return self.k[layer][:, :, start:stop], self.v[layer][:, :, start:stop]

    def reads_rows(self) -> bool:
        """A selection's rows may be read in place, as `select_rows` packs them, the current token stored first
        and read among the rows: in fast memory, no victims (appending first cannot overwrite a selected slot),
        values stored as computed (the token read from the store is the token computed). Elsewhere the store
        hands the rows over in a fast buffer (`hand_rows`) and the token is stored after the attention."""
        return type(self) is KVStore and self.allocator is None and type(self.codec) is KVCodec

    def select_rows(self, layer: int, keep: torch.Tensor, valid: torch.Tensor) -> "SelectedRows":
        """The rows a selection reads, packed per batch row: keep [B,Hkv,S] & valid -> `SelectedRows`, each
        batch row's selected (KV head, slot) pairs in ascending order (head-major: each KV head's rows one
        run), padded only to the largest batch row's total, never every KV head to the largest head's count.
        A layer-pooled cap bounds a batch row's total, so it bounds the rows moved too."""
        keep = keep & valid
        b, h, s = keep.shape
        flat = keep.reshape(-1).nonzero().squeeze(1)  # ascending (batch, KV head, slot)
        seg = flat // s  # batch * Hkv + KV head
        row = seg // h
        counts = torch.bincount(seg, minlength=b * h).view(b, h)
        per_row = counts.sum(1)
        n = int(per_row.max()) if flat.numel() else 0
        col = torch.arange(flat.numel(), device=keep.device) - (per_row.cumsum(0) - per_row)[row]
        # the row of (batch, KV head, slot) in the flat [B * Hkv * capacity, d] buffer; padding reads the
        # buffer's row 0 (a stored, finite key: its head of -1 masks it)
        rows = torch.zeros(b, n, dtype=torch.long, device=keep.device)
        rows[row, col] = flat + seg * (self.capacity - s)
        head = torch.full((b, n), -1, dtype=torch.long, device=keep.device)
        head[row, col] = seg - row * h
        return SelectedRows(keep, rows, head, counts)

    def every_row(self, layer: int) -> "SelectedRows":
        """Every used slot as `select_rows` packs them, where every used slot is valid (no padding, no
        victims): built from the used length, without waiting on the device for a count."""
        b, h = self.k[layer].shape[:2]
        n = self.length[layer]
        dev = self.k[layer].device
        col = torch.arange(h * n, device=dev)
        head = (col // n).expand(b, -1) if n else col.view(1, 0).expand(b, 0)
        rows = (torch.arange(b, device=dev)[:, None] * h + head) * self.capacity + (col % max(n, 1))
        counts = torch.full((b, h), n, dtype=torch.long, device=dev)
        return SelectedRows(self.valid[layer][:, :, :n], rows, head.contiguous(), counts)

    def gather_rows(self, layer: int, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """Rows `rows` [B, m] of `select_rows` into keys, values [B * m, d] (buffers the caller reuses);
        returns them as [B, 1, m, d]: one head whose columns the caller masks per KV head."""
        b, m = rows.shape
        d = self.k[layer].shape[-1]
        flat = rows.reshape(-1)
        torch.index_select(self.k[layer].view(-1, d), 0, flat, out=keys)
        torch.index_select(self.v[layer].view(-1, d), 0, flat, out=values)
        return keys.view(b, 1, m, d), values.view(b, 1, m, d)

    def hand_rows(self, layer: int, sel: SelectedRows, buffer, every: bool = False) -> HandedRows:
        """The rows of `sel` (this layer's `select_rows`) copied into a fast buffer with a spare row per (batch
        row, KV head) for the token (`HandedRows`); `buffer(n, like)` gives flat [n, d] keys and values the
        caller reuses. `every`: sel is every visible slot (an offloaded store then reads the whole layer)."""
        flat, local, own = packed_order(sel)
        d = self.k[layer].shape[-1]
        keys, values = buffer(flat.numel() + own.numel(), self.k[layer])
        torch.index_select(self.k[layer].view(-1, d), 0, flat, out=keys[:flat.numel()])
        torch.index_select(self.v[layer].view(-1, d), 0, flat, out=values[:flat.numel()])
        return HandedRows(keys, values, local, own)

    def write_prompt(self, layer: int, k: torch.Tensor, v: torch.Tensor, token_valid: torch.Tensor,
                     positions: torch.Tensor, at: int = 0) -> None:
        """Store a prompt's keys and values [B,Hkv,T,d] in slots at..at+T-1 (`at` > 0: the prompt continues
        the unpadded prefix already in slots 0..at-1, which a prefix cache restored)."""
        t = k.shape[2]
        if at + t > self.capacity:
            raise UserError(f"a prompt of {at + t} tokens does not fit a KV pool of {self.capacity} tokens")
        if at and at != self.length[layer]:
            raise RuntimeError(f"a prompt continues at slot {at}, but layer {layer} holds {self.length[layer]}")
        self.k[layer][:, :, at:at + t] = self.codec.encode(k)
        self.v[layer][:, :, at:at + t] = self.codec.encode(v)
        self.valid[layer][:, :, at:at + t] = token_valid[:, None, :]
        self.pos[layer][:, :, at:at + t] = positions[:, None, :]
        self.length[layer] = at + t
        if layer == 0 and not at:
            self.padded = not bool(token_valid.all())

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Store one token's k, v [B,Hkv,1,d]; returns the slot written per (batch, kv head) [B,Hkv]."""
        b, h = k.shape[:2]
        n = self.length[layer]
        if n < self.capacity and self.allocator is None:  # every row's token goes to slot n: plain copies
            self.length[layer] = n + 1  # (a fifth of the operator calls of the scatters below, per layer)
            if type(self.codec) is KVCodec and fused_select.appends(k, self.k[layer], self.v[layer], self.valid[layer],
                                                                    self.pos[layer]):  # the copies in one call
                fused_select.append_token(self.k[layer], self.v[layer], self.valid[layer], self.pos[layer], n, k, v,
                                          positions)
                return self._slot_tensor(n, b, h, k.device)
            # (narrow/select and an in-place copy: 9 operator calls, where indexed assignment takes 14)
            self.k[layer].narrow(2, n, 1).copy_(self.codec.encode(k))
            self.v[layer].narrow(2, n, 1).copy_(self.codec.encode(v))
            self.valid[layer].select(2, n).fill_(True)
            self.pos[layer].select(2, n).copy_(positions[:, None])
            return self._slot_tensor(n, b, h, k.device)
        slots = self._claim(layer, b, h, k.device)
        idx = slots[:, :, None, None].expand(b, h, 1, k.shape[-1])
        for buf, x in ((self.k[layer], self.codec.encode(k)), (self.v[layer], self.codec.encode(v))):
            _scatter_rows(buf, idx, x)
        self._mark(layer, slots, positions)
        return slots

    def _slot_tensor(self, slot: int, b: int, h: int, device) -> torch.Tensor:
        """[B, Hkv] filled with `slot`: what `append` returns where every row's token went to one slot, made once
        per slot and shared by every layer of a step (each appends at the same slot; nobody writes it)."""
        key = (slot, b, h, device)
        if self._appended_at[0] != key:
            self._appended_at = (key, torch.full((b, h), slot, dtype=torch.long, device=device))
        return self._appended_at[1]

    def wrote_in_place(self, layer: int) -> None:
        """The caller wrote every row's next token at slot `length[layer]` itself, as `append`'s plain copies
        write it (keys, values, valid, pos: the compiled whole step, inside its graph, where the store
        `attends_in_place`): the append pointer moves on."""
        if self.length[layer] >= self.capacity or self.allocator is not None:
            raise RuntimeError(f"layer {layer}: no free slot to write in place")
        self.length[layer] += 1

    def _claim(self, layer: int, b: int, h: int, device) -> torch.Tensor:
        """The slot [B,Hkv] each row's next token goes to: the append pointer, or a victim once full."""
        n = self.length[layer]
        if n < self.capacity:
            self.length[layer] = n + 1
            return torch.full((b, h), n, dtype=torch.long, device=device)
        if self.allocator is None:
            raise RuntimeError("KV store is full and has no eviction policy")
        return self.allocator.victims(layer, self)

    def _mark(self, layer: int, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Record that `slots` now hold the tokens at `positions` [B] (after their k and v are written)."""
        b, h = slots.shape
        self.valid[layer].scatter_(2, slots[:, :, None], True)
        self.pos[layer].scatter_(2, slots[:, :, None], positions[:, None, None].expand(b, h, 1))
        if self.allocator is not None:
            self.allocator.on_write(layer, slots)

    def attends_in_place(self) -> bool:
        """Dense attention may read this store's used slots directly, the current token written first:
        in fast memory, every used slot valid, no victims, values stored as computed."""
        return type(self) is KVStore and self.allocator is None and not self.padded and type(self.codec) is KVCodec

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    # ---- memory accounting: what the store holds in each tier ---------------------------------------
    def fast_bytes(self) -> int:
        """Bytes held in the fast tier now: keys, values and their metadata (each storage once)."""
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in list(self.k) + list(self.v) + list(self.valid) + list(self.pos)}
        return sum(seen.values())

    def slow_bytes(self) -> int:
        """Bytes held in the slow tier (none here)."""
        return 0

    def peak_fast_bytes(self) -> int:
        """The most the KV cache held in the fast tier (here: its preallocated keys and values)."""
        return self.nbytes()

    def pool_file_bytes(self) -> int:
        """Bytes of the files the pool lives in (none here)."""
        return 0

    # ---- placement hooks: no-ops here, where everything already lives in fast memory -------------------
    def dense(self, layer: int):
        """Keys and values [B,Hkv,S,d] of every used slot, where attention can read them (a policy that
        selects everything); an offloaded store returns its fast-tier copy."""
        k, v, _, _ = self.past(layer)
        return k, v

    def ahead(self, layer: int, point: str, session) -> None:
        """Called by `Session.event` after the policy's `on_hidden(layer, point)` (and with layer -1,
        "embed", at the start of a decoding step): an offloaded store may start moving what layer+1 reads."""

    def close(self) -> None:
        """Release what the store holds outside the Python heap (files, pinned buffers, threads)."""
