"""The attention of a decoding step or of teacher-forced rows, and the remainder a selection leaves unread."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..cache import SelectedRows
from ..kernels import fused_select
from ..model import _grouped_sdpa
from ..selection import Remainder

ROW_ENTRIES = 1 << 22  # teacher-forced (row, entry) pairs packed at once: bounds the packed index at long contexts
GATHER_ELEMENTS = 1 << 24  # keys gathered per call where the kernel cannot read them in place (rows x entries x d)


def attend_all(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, scale: float) -> torch.Tensor:
    """One token per row, q [B,H,1,d], over every entry of kp, vp [B,Hkv,S,d] (its own included): one
    fused call, no mask, no weights kept."""
    b, h, _, d = q.shape
    out = F.scaled_dot_product_attention(q.view(b, kp.shape[1], h // kp.shape[1], d), kp, vp, scale=scale)
    return out.reshape(b, h, 1, d)  # CUDA's fused kernels return [B,Hkv,G,d] with G outermost: no view


def attend_masked(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, mask: torch.Tensor, scale: float):
    """One token per row, q [B,H,1,d], over the entries of kp, vp [B,Hkv,S,d] where mask [B,Hkv,S] (its own
    included), or mask [B,Hkv,G,S] per query head of each group: one fused call, no weights kept."""
    b, h, _, d = q.shape
    hkv = kp.shape[1]
    mask = mask[:, :, None] if mask.dim() == 3 else mask
    out = F.scaled_dot_product_attention(q.view(b, hkv, h // hkv, d), kp, vp, attn_mask=mask, scale=scale)
    return out.reshape(b, h, 1, d)  # as in attend_all


class Attended(NamedTuple):
    """An attention over what decoding rows read, with what the remainder needs to be mixed in once
    (`with_remainder`); lse, read_sum and read_count are None where no remainder was asked for."""
    out: torch.Tensor  # [B, H, R, d]
    lse: torch.Tensor | None = None  # [B, Hkv, G, R] float32: log-sum-exp of the exact scaled scores read
    # the sum of the past values read (float32) and how many: [B, Hkv, d] and [B, Hkv] for one decoding row per
    # batch row, [B, Hkv, R, d] and [B, Hkv, R] per row of several
    read_sum: torch.Tensor | None = None
    read_count: torch.Tensor | None = None

    def rows(self, a: int, b: int) -> "Attended":
        """Batch rows a..b-1 (one session's of several stacked; all of them: itself, without slicing calls)."""
        if a == 0 and b == self.out.shape[0]:
            return self
        return Attended(*(None if x is None else x[a:b] for x in self))


def with_remainder(att: Attended, remainder: Remainder | None) -> torch.Tensor:
    """att.out mixed with what the policy estimates the unread past entries add (`Remainder`): (1 - w) * out
    + w * their mean value, w their share of the mass, exp(remainder.lse) / (exp(remainder.lse) + exp(att.lse)).
    The unread entries are every cached one (remainder.sums over remainder.counts, shaped as att.read_sum and
    att.read_count) less those read. Nothing unread (a count of 0, or a log-mass of -inf), or no remainder: w is
    0 and att.out is returned to the bit."""
    if remainder is None:
        return att.out
    unread_sum, unread_count = remainder.sums - att.read_sum, remainder.counts - att.read_count
    if unread_count.dim() == 2:  # one decoding row per batch row
        unread_sum, unread_count = unread_sum[:, :, None], unread_count[:, :, None]
    out = att.out
    b, h, r, d = out.shape
    hkv = remainder.lse.shape[1]
    lse_unread = remainder.lse.masked_fill((unread_count <= 0)[:, :, None], float("-inf"))
    w = torch.sigmoid(lse_unread - att.lse)[..., None]  # exp(u) / (exp(u) + exp(read))
    mean = (unread_sum / unread_count.clamp(min=1)[..., None])[:, :, None]  # [B, Hkv, 1, R, d]
    o = out.view(b, hkv, h // hkv, r, d).float()
    return (o + w * (mean - o)).to(out.dtype).view(b, h, r, d)


def attend_packed(q, kp, vp, head, hkv: int, scale: float, remainder: bool = False) -> Attended:
    """One token per row, q [B,H,1,d], over packed rows kp, vp [B,1,m,d] whose KV heads are head [B,m] (-1:
    padding), each row's own tokens the last hkv columns: one masked fused call, each query head over its KV
    head's rows; with `remainder`, also the log-sum-exp and the past rows' value sums per KV head."""
    b, m = head.shape
    h, d = q.shape[1], vp.shape[-1]
    mask = head_mask(head, h, hkv)
    out = attend_masked(q, kp, vp, mask, scale)
    if not remainder:
        return Attended(out)
    scores = torch.matmul(q.view(b, 1, h, d).float(), kp.float().transpose(-1, -2)) * scale  # (a 16-bit bmm
    lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1)  # is slower on a CPU)
    past = head[:, :m - hkv]
    # each past row's (batch row, KV head), padding to a spare last segment
    seg = torch.where(past >= 0, past + hkv * torch.arange(b, device=head.device)[:, None], b * hkv).reshape(-1)
    sums = vp.new_zeros(b * hkv + 1, d, dtype=torch.float32)
    sums.index_add_(0, seg, vp[:, 0, :m - hkv].reshape(-1, d).float())
    counts = torch.bincount(seg, minlength=b * hkv + 1)
    return Attended(out, lse.view(b, hkv, h // hkv, 1), sums[:-1].view(b, hkv, d), counts[:-1].view(b, hkv))


def packed_weights(q, kp, head, hkv: int, scale: float) -> torch.Tensor:
    """The attention weight [B, m] each packed column of kp [B, 1, m, d] (KV heads head [B, m], -1 on padding)
    received from one token per row q [B, H, 1, d], summed over its KV head's query heads: exp(score - lse)
    per query head, as `attend_packed` weighs it (padding: 0)."""
    b, m = head.shape
    h, d = q.shape[1], kp.shape[-1]
    scores = torch.matmul(q.view(b, 1, h, d).float(), kp.float().transpose(-1, -2)) * scale  # [B, 1, H, m]
    probs = torch.softmax(scores.masked_fill(~head_mask(head, h, hkv), float("-inf")), -1)
    return probs.sum(2)[:, 0]


def attend_rows(q, k, v, keep, first: int, codec, scale: float, remainder: Remainder | None = None) -> torch.Tensor:
    """Teacher-forced decoding rows q [B,H,R,d] (positions first..first+R-1 of a sequence with keys and values
    k, v [B,Hkv,T,d]) at once, each read as the decoding step reads it: the past entries in `keep` (a mask
    [B,Hkv,R,T], or a selection packed per row: `SelectedRows` whose batch is the rows, B = 1) as the store
    would hold them (`codec`), then its own token as computed, by the step's attention over packed rows
    (`fused_select.attend_rows`; `attend_packed_rows` where the kernel cannot take the tensors); plus what the
    policy estimates the unread entries add (`remainder`, see `Remainder`: their mean value from the sequence's
    values). A mask is packed `ROW_ENTRIES` (rows x entries) at a time: no [R, T] score tensor. A mask that keeps
    every past entry of every row, stored as computed, leaves nothing unread: one fused causal call
    (`attend_visible`; the remainder then weighs 0, so the output is the same to the bit)."""
    b, h, r, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    kq, vq = codec.encode(k), codec.encode(v)
    if kq is k and vq is v and not isinstance(keep, SelectedRows) and _keeps_all_past(keep, first):
        causal = torch.arange(t, device=q.device)[None] < torch.arange(first, first + r, device=q.device)[:, None]
        return attend_visible(q, k, v, causal, first, scale)
    keys, values = kq.reshape(-1, d), vq.reshape(-1, d)
    own_at = 0
    if kq is not k or vq is not v:  # the past as coded, each row's own token as computed after it
        keys, values = torch.cat([keys, k.reshape(-1, d)]), torch.cat([values, v.reshape(-1, d)])
        own_at = b * hkv * t
    heads = torch.arange(b * hkv, device=q.device).view(b, 1, hkv) * t  # each (batch row, KV head)'s first entry
    own = own_at + heads + torch.arange(first, first + r, device=q.device)[None, :, None]  # [B, R, Hkv]
    kernel = fused_select.usable(q, keys)
    wants = remainder is not None
    out = q.new_empty(b, r, h, d)
    lse = q.new_empty(b, r, h, dtype=torch.float32) if wants else None
    read_sum = q.new_empty(b, r, hkv, d, dtype=torch.float32) if wants else None
    read_count = torch.empty(b, r, hkv, dtype=torch.long, device=q.device) if wants else None
    if isinstance(keep, SelectedRows):  # (packed per row already, B = 1)
        chunks = [(0, r, keep.rows, keep.counts)]
    else:
        step = max(1, ROW_ENTRIES // max(1, b * hkv * t))
        chunks = ((s, min(r, s + step), *_packed(keep[:, :, s:min(r, s + step)], heads.view(b, hkv)))
                  for s in range(0, r, step))
    for s, e, rows, counts in chunks:
        qc = q[:, :, s:e].transpose(1, 2).reshape(-1, h, d)  # [B * c, H, d], batch-row-major
        args = (qc, keys, values, rows, counts, own[:, s:e].reshape(-1, hkv), scale)
        o, lse_c, rs = fused_select.attend_rows(*args) if kernel else attend_packed_rows(*args)
        out[:, s:e] = o.view(b, e - s, h, d)
        if wants:
            lse[:, s:e], read_sum[:, s:e] = lse_c.view(b, e - s, h), rs.view(b, e - s, hkv, d)
            read_count[:, s:e] = counts.view(b, e - s, hkv)
    out = out.transpose(1, 2)  # [B, H, R, d]
    if not wants:
        return out
    att = Attended(out, lse.view(b, r, hkv, h // hkv).permute(0, 2, 3, 1), read_sum.transpose(1, 2),
                   read_count.transpose(1, 2))
    # every entry before each row: the sequence's values summed up to it, [B, Hkv, R, d], and their count
    totals = F.pad(vq.float().cumsum(2), (0, 0, 1, 0))[:, :, first:first + r]
    counts = torch.arange(first, first + r, device=q.device).expand(b, hkv, r)
    return with_remainder(att, remainder._replace(sums=totals, counts=counts))


def attend_visible(q, k, v, visible: torch.Tensor, first: int, scale: float) -> torch.Tensor:
    """Teacher-forced rows q [B,H,R,d] (positions first..first+R-1) that read every past entry in view (visible
    [R, T]) of k, v [B,Hkv,T,d] as computed, plus themselves, with no remainder: a layer that does not select, in
    one fused call (what `attend_rows` computes for keep = visible and an identity codec)."""
    r, t = q.shape[2], k.shape[2]
    own = torch.arange(t, device=q.device)[None] == torch.arange(first, first + r, device=q.device)[:, None]
    return _grouped_sdpa(q, k, v, q.shape[1] // k.shape[1], attn_mask=visible | own, scale=scale)


def _keeps_all_past(keep: torch.Tensor, first: int) -> bool:
    """Whether keep [.., R, T] (past entries only) keeps all of each row's past: first + row of them."""
    r = keep.shape[-2]
    return bool((keep.sum(-1) == torch.arange(first, first + r, device=keep.device)).all())


def _packed(keep: torch.Tensor, heads: torch.Tensor):
    """keep [B, Hkv, c, T] (or broadcasting to it) -> each of the B * c rows' kept entries packed as the step packs
    a selection: rows [B * c, m] each entry's row in the flat [B * Hkv * T, d] keys (heads [B, Hkv]: each one's
    first), head-major in ascending position, padding after the last run; counts [B * c, Hkv]."""
    b, hkv = heads.shape
    c, t = keep.shape[2:]
    keep = keep.expand(b, hkv, c, t)  # (a mask the same for every batch row or KV head broadcasts)
    per_row = keep.transpose(1, 2).reshape(b * c, hkv * t)
    counts = per_row.view(b * c, hkv, t).sum(-1)
    total = counts.sum(-1)
    at, col = per_row.nonzero(as_tuple=True)  # row-major: each row's entries head-major, ascending
    base = heads[:, :1].expand(b, c).reshape(-1)  # each row's batch row's first entry
    rows = base[:, None].repeat(1, int(total.max()) if total.numel() else 0)
    rows[at, torch.arange(at.numel(), device=keep.device) - (total.cumsum(0) - total)[at]] = col + base[at]
    return rows, counts


def attend_packed_rows(q, keys, values, rows, counts, own, scale: float):
    """`fused_select.attend_rows`'s computation in torch (where the kernel cannot take the tensors): q [N, H, d]
    over each row's packed rows of keys, values [M, d] (rows [N, m] head-major, counts [N, Hkv]) and then its own
    (own [N, Hkv]), gathered `GATHER_ELEMENTS` at a time into one masked fused call (`attend_packed`). Returns out
    [N, H, d], lse [N, H] and read_sum [N, Hkv, d] (float32; past rows only)."""
    n, h, d = q.shape
    hkv, m = counts.shape[1], rows.shape[1]
    cols = torch.arange(m, device=q.device).repeat(n, 1)
    head = torch.searchsorted(counts.cumsum(-1), cols, right=True)  # each column's KV head; hkv: padding
    head = torch.cat([head.masked_fill(head >= hkv, -1), torch.arange(hkv, device=q.device).expand(n, hkv)], 1)
    index = torch.cat([rows, own], 1)
    out = q.new_empty(n, h, d)
    lse = q.new_empty(n, h, dtype=torch.float32)
    read_sum = q.new_empty(n, hkv, d, dtype=torch.float32)
    step = max(1, GATHER_ELEMENTS // ((m + hkv) * d))
    for s in range(0, n, step):
        e = min(n, s + step)
        kp, vp = keys[index[s:e]][:, None], values[index[s:e]][:, None]  # [c, 1, m + Hkv, d]
        att = attend_packed(q[s:e, :, None], kp, vp, head[s:e], hkv, scale, remainder=True)
        out[s:e], lse[s:e], read_sum[s:e] = att.out[:, :, 0], att.lse.reshape(e - s, h), att.read_sum
    return out, lse, read_sum


class StepBuffers:
    """The padded buffers one decoding step stacks every session's entries into, allocated once per step at
    the longest read so far and reused by every layer (each layer's attention is done with them before the
    next layer writes; a large allocation per layer costs page faults on a CPU). Allocated as zeros: a
    padded entry then always holds a finite number (zero, or an earlier layer's key or value), which its
    weight of exactly 0 cancels."""

    def __init__(self):
        self.keys = self.values = None
        self.flat: dict = {}  # use -> (keys, values) [capacity, d], grown by a quarter when too small
        self._store_views: dict = {}  # layer -> (its keys tensor, flat keys, flat values)
        self._own_rows: dict = {}  # (shape, capacity, device) -> [B, Hkv] each (batch row, KV head)'s first row
        self._own_rows_at: tuple = (None, 0, None)  # (slots, capacity, their rows): `own_rows_at`

    def flat_store(self, store, layer: int):
        """A store's keys and values of `layer` as flat [B * Hkv * capacity, d] views, made once per layer."""
        seen = self._store_views.get(layer)
        if seen is None or seen[0] is not store.k[layer]:
            d = store.k[layer].shape[-1]
            seen = self._store_views[layer] = (store.k[layer], store.k[layer].view(-1, d), store.v[layer].view(-1, d))
        return seen[1], seen[2]

    def own_rows(self, slots: torch.Tensor, capacity: int) -> torch.Tensor:
        """[B, Hkv] the row of slot 0 of each (batch row, KV head) in a flat store of `capacity` slots (slots: a
        [B, Hkv] tensor of the shape and device wanted), made once."""
        key = (tuple(slots.shape), capacity, slots.device)
        base = self._own_rows.get(key)
        if base is None:
            base = self._own_rows[key] = torch.arange(slots.numel(), device=slots.device).view(slots.shape) * capacity
        return base

    def own_rows_at(self, slots: torch.Tensor, capacity: int) -> torch.Tensor:
        """[B, Hkv] the row of each (batch row, KV head)'s slot `slots` in a flat store of `capacity` slots
        (`own_rows` + slots), made once per slots tensor: a store appending every layer of a step at one slot
        hands each layer the same one (`KVStore.append`)."""
        last = self._own_rows_at
        if last[0] is not slots or last[1] != capacity:
            last = self._own_rows_at = (slots, capacity, self.own_rows(slots, capacity) + slots)
        return last[2]

    def _flat(self, use: str, n: int, like: torch.Tensor):
        keys, values = self.flat.get(use, (None, None))
        if keys is None or keys.shape[0] < n:
            cap = max(n, int(1.25 * keys.shape[0]) if keys is not None else n)
            keys, values = like.new_empty(cap, like.shape[-1]), like.new_empty(cap, like.shape[-1])
            self.flat[use] = keys, values
        return keys[:n], values[:n]

    def handed(self, n: int, like: torch.Tensor):
        """Flat buffers [n, d] a store in fast memory copies a selection's rows into (`KVStore.hand_rows`)."""
        return self._flat("handed", n, like)

    def rows(self, n: int, like: torch.Tensor):
        """Flat buffers [n, d] for the rows a packed selection gathers (`KVStore.gather_rows`)."""
        return self._flat("rows", n, like)

    def views(self, rows: int, hkv: int, n: int, like: torch.Tensor):
        if self.keys is None or self.keys.shape[2] < n:
            cap = max(n, int(1.25 * self.keys.shape[2]) if self.keys is not None else n)
            self.keys = like.new_zeros(rows, hkv, cap, like.shape[3])
            self.values = like.new_zeros(rows, hkv, cap, like.shape[3])
        return self.keys[:, :, :n], self.values[:, :, :n]


def with_own(sel: SelectedRows, slots: torch.Tensor, capacity: int):
    """A packed selection's rows and KV heads [B, n + Hkv] with each row's own token (stored in slots [B, Hkv])
    after them, one row per KV head."""
    b, hkv = slots.shape
    seg = torch.arange(b * hkv, device=slots.device).view(b, hkv)
    own = seg * capacity + slots
    return torch.cat([sel.rows, own], 1), torch.cat([sel.head, seg - seg[:, :1]], 1)


def head_mask(head: torch.Tensor, h: int, hkv: int) -> torch.Tensor:
    """[B, 1, H, m]: query head j reads the columns of its KV head j // (H / Hkv) (`head` [B, m], -1 on
    padding)."""
    group = torch.arange(h, device=head.device) // (h // hkv)
    return head[:, None, None, :] == group[None, None, :, None]

