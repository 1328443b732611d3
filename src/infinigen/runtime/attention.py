"""The attention of a decoding step or of teacher-forced rows, and the remainder a selection leaves unread."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..cache import SelectedRows
from ..kernels import fused_select
from ..selection import Remainder, first_key_read

ROW_CHUNK = 1024  # teacher-forced decoding rows per attention call: bounds the score matrix at long contexts


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
    """Decoding rows q [B,H,R,d] (positions first..first+R-1 of a sequence with keys and values k, v
    [B,Hkv,T,d]) at once: each reads the entries in keep [B,Hkv,R,T] plus itself, past entries as the
    store would hold them (`codec`), its own token as computed; plus what the policy estimates the unread
    entries add (`remainder`, see `Remainder`: their mean value from the sequence's values)."""
    b, h, r, d = q.shape
    t = k.shape[2]
    p = first
    rows = torch.arange(p, p + r, device=q.device)[:, None]
    cols = torch.arange(t, device=q.device)[None, :]
    kq, vq = codec.encode(k), codec.encode(v)
    diag = (cols == rows)[None, None]
    hkv, g = k.shape[1], h // k.shape[1]
    qg = q.view(b, hkv, g, r, d)
    out = torch.empty_like(qg)
    lse = None if remainder is None else q.new_empty(b, hkv, g, r, dtype=torch.float32)
    for s in range(0, r, ROW_CHUNK):
        e = min(r, s + ROW_CHUNK)
        # the keys some row of the chunk reads or is: [lo, hi). The rest (the future; behind a sliding window,
        # the past: a 512-token window at 32K tokens) would get a weight of exactly 0
        hi = min(t, p + e)
        lo = min(first_key_read(keep[:, :, s:e, :hi], hi), p + s)
        qc = qg[:, :, :, s:e]
        scores = torch.matmul(qc, kq[:, :, None, lo:hi].transpose(-1, -2)).float() * scale  # [B,Hkv,G,c,n]
        own = (qc.float() * k[:, :, None, p + s:p + e].float()).sum(-1) * scale  # [B,Hkv,G,c]
        scores = scores.masked_fill(~keep[:, :, None, s:e, lo:hi], float("-inf"))
        dg = diag[:, :, None, s:e, lo:hi]
        scores = torch.where(dg, own[..., None], scores)
        probs = torch.softmax(scores, dim=-1)
        if lse is not None:
            lse[..., s:e] = torch.logsumexp(scores, -1)
        pd = (probs * dg).sum(-1, keepdim=True)
        past = torch.matmul(probs.masked_fill(dg, 0).to(vq.dtype), vq[:, :, None, lo:hi])
        out[:, :, :, s:e] = past + pd.to(v.dtype) * v[:, :, None, p + s:p + e]
    out = out.view(b, h, r, d)
    if remainder is None:
        return out
    vf = vq.float()
    read = keep.float()
    # every entry before each row: the sequence's values summed up to it, [B, Hkv, R, d], and their count
    totals = F.pad(vf.cumsum(2), (0, 0, 1, 0))[:, :, p:p + r]
    counts = torch.arange(p, p + r, device=q.device).expand(b, hkv, r)
    return with_remainder(Attended(out, lse, read @ vf, read.sum(-1)), remainder._replace(sums=totals, counts=counts))


def attend_rows_packed(q, k, v, sel: SelectedRows, first: int, scale: float,
                       remainder: Remainder | None = None) -> torch.Tensor:
    """`attend_rows` over a selection packed per row (`SelectedRows` whose batch is the rows: rows [R, m] each
    row's entries in the sequence's flat [Hkv * T, d] keys and values, head-major; counts [R, Hkv]), in one call
    of the fused kernel (`fused_select.attend_rows`: no [R, T] score or mask tensor). Keys and values are read
    as computed: for a store whose codec keeps them as they are (the caller checks, and `fused_select.usable`)."""
    _, h, r, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    rows = torch.arange(first, first + r, device=q.device)
    own = (torch.arange(hkv, device=q.device) * t)[None, :] + rows[:, None]  # [R, Hkv]: each row's own token
    out, lse, read_sum = fused_select.attend_rows(q[0].transpose(0, 1), k[0].reshape(hkv * t, d),
                                                  v[0].reshape(hkv * t, d), sel.rows, sel.counts, own, scale)
    out = out.transpose(0, 1)[None]  # [1, H, R, d]
    if remainder is None:
        return out
    att = Attended(out, lse.view(r, hkv, h // hkv).permute(1, 2, 0)[None], read_sum.transpose(0, 1)[None],
                   sel.counts.T[None])
    # every entry before each row: the sequence's values summed up to it, [1, Hkv, R, d], and their count
    totals = F.pad(v.float().cumsum(2), (0, 0, 1, 0))[:, :, first:first + r]
    return with_remainder(att, remainder._replace(sums=totals, counts=rows.expand(1, hkv, r)))


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

