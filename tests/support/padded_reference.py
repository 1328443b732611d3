"""The padded reference read of a decoding step, which the tests compare the runtime's one read plan (packed rows,
or every entry in place) with: each (batch row, KV head) its selected slots, padded to the largest count
(`slots`), gathered (`gather`), attended with the current token kept apart (`attend_step`); several sessions'
entries stacked, each row's padded to the longest read.

`padded_reference(*sessions)` makes sessions read so (their class becomes `PaddedReferenceSession`); a step that
decodes several of them together runs inside `decoding_padded()`. `attend_teacher_rows` is the padded reference of
teacher-forced rows (`attention.attend_rows`): every row scored against every key, the unread masked out."""
from __future__ import annotations

import contextlib
from typing import NamedTuple
from unittest import mock

import torch
import torch.nn.functional as F

from infinigen.runtime import attention, passes
from infinigen.runtime.session import ReadPlan, Session
from infinigen.runtime.step_attention import _part
from infinigen.selection import ALL, All, Remainder, first_key_read

TEACHER_ROWS = 1024  # rows per call of `attend_teacher_rows`: bounds its [R, T] scores


def slots(store, layer: int, keep: torch.Tensor, valid: torch.Tensor):
    """The slots a selection reads: keep [B,Hkv,S] & valid -> (that mask, idx [B,Hkv,n] with the selected slots
    first, mask [B,Hkv,n] False on padding, counts [B,Hkv]); n = the largest count."""
    keep = keep & valid
    counts = keep.sum(-1)
    n = int(counts.max()) if counts.numel() else 0
    flat = keep.reshape(-1, keep.shape[-1])
    row, slot = flat.nonzero(as_tuple=True)  # row-major: ascending slots within each row
    per = counts.reshape(-1)
    col = torch.arange(row.numel(), device=keep.device) - (per.cumsum(0) - per)[row]
    idx = torch.zeros(flat.shape[0], n, dtype=torch.long, device=keep.device)
    idx[row, col] = slot
    return keep, idx.view(*keep.shape[:-1], n), torch.arange(n, device=keep.device) < counts[..., None], counts


def gather(store, layer: int, idx: torch.Tensor):
    """Rows `idx` [B,Hkv,n] of the store's keys and values."""
    b, h, n = idx.shape
    k, v = store.k[layer], store.v[layer]
    d = k.shape[-1]
    rows = (torch.arange(b * h, device=idx.device).view(b, h, 1) * store.capacity + idx).reshape(-1)
    return (k.view(-1, d).index_select(0, rows).view(b, h, n, d),
            v.view(-1, d).index_select(0, rows).view(b, h, n, d))


def attend_step(q, kp, vp, mask, kc, vc, scale: float, remainder: bool = False):
    """One token per row, q [B,H,1,d], over the past entries kp, vp [B,Hkv,n,d] where mask [B,Hkv,n], and over
    itself (kc, vc [B,Hkv,1,d], kept apart from the past). Returns the attention (`attention.Attended`: what the
    remainder needs too, if `remainder`) and the weights probs [B,Hkv,G,n+1] (the current token last)."""
    b, h, _, d = q.shape
    hkv = kp.shape[1]
    qg = q.view(b, hkv, h // hkv, d)
    s_past = torch.matmul(qg, kp.transpose(-1, -2)).float() * scale
    s_past = torch.where(mask[:, :, None, :], s_past, float("-inf"))
    s_cur = (qg.float() * kc.float()).sum(-1, keepdim=True) * scale
    scores = torch.cat([s_past, s_cur], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs[..., :-1].to(vp.dtype), vp) + probs[..., -1:].to(vc.dtype) * vc
    out = out.view(b, h, 1, d)
    if not remainder:
        return attention.Attended(out), probs
    read_sum, read_count = vp.float().masked_fill(~mask[..., None], 0).sum(2), mask.sum(-1)
    return attention.Attended(out, torch.logsumexp(scores, -1)[..., None], read_sum, read_count), probs


def observed_slots(probs, idx, capacity: int):
    """The weights probs [B, Hkv, G, n + 1] (n past entries in slots idx [B, Hkv, n], or ALL: every used slot in
    order; the current token last) as a policy observes them (`Policy.observe`): each entry's weight summed over
    the group and its row in the flat [B * Hkv * capacity] store, both [B, Hkv * n], and the tokens' [B, Hkv]."""
    b, hkv = probs.shape[:2]
    got = probs[..., :-1].sum(2)
    n = got.shape[-1]
    idx_slots = torch.arange(n, device=got.device).expand(b, hkv, n) if idx is ALL else idx
    rows = torch.arange(b * hkv, device=got.device).view(b, hkv, 1) * capacity + idx_slots
    return got.reshape(b, -1), rows.reshape(b, -1), probs[..., -1].sum(2)


class PaddedPlan(NamedTuple):
    """What a decoding row reads on the padded reference: the runtime's `ReadPlan` less the packed rows, plus the
    keys and values gathered (None: every used slot read in place)."""
    cur: torch.Tensor
    keep: torch.Tensor | All
    seen: torch.Tensor
    keys: torch.Tensor | None  # [B, Hkv, n, d] what attention reads (None: read in place)
    values: torch.Tensor | None
    mask: torch.Tensor | None  # [B, Hkv, n]
    idx: torch.Tensor | All  # the slots of keys/values (ALL: every used slot, in order)
    full: bool  # every entry of keys/values counts (mask is all True): no padding, window or selection


class PaddedReferenceSession(Session):
    """A session whose decoding step reads the padded reference: the selection as the runtime asks it
    (`Session._selection`), then each KV head's slots padded and gathered, or every used slot as stored."""

    def _read(self, layer: int, q, k) -> PaddedPlan:
        got = self._selection(layer, q, k, packs=False)
        if isinstance(got, ReadPlan):  # every used slot, read in place
            return PaddedPlan(got.cur, ALL, got.seen, None, None, None, ALL, True)
        cur, keep, _, _, visible, past = got
        if keep is ALL:
            return self._read_dense(layer, PaddedPlan(cur, ALL, visible, None, None, None, ALL, False))
        store = self.store
        keep, idx, mask, counts = slots(store, layer, keep, visible)
        kp, vp = gather(store, layer, idx)
        self.stats.record(layer, counts[..., None], past)
        self.stats.record_rows(layer, idx.numel())
        return PaddedPlan(cur, keep, keep, kp, vp, mask, idx, False)

    def _read_dense(self, layer: int, read: PaddedPlan) -> PaddedPlan:
        """Every used slot, where attention can read it (an offloaded store hands its fast-tier copy)."""
        kp, vp = self.store.dense(layer)
        full = not self.store.padded and self.model.cfg.window(layer) is None
        return read._replace(keys=kp, values=vp, mask=read.seen, full=full)

    def _step_attention(self, layer: int, q, k, v) -> torch.Tensor:
        return attend_sessions(layer, q, k, v, [self], [(0, q.shape[0])], self.model.scale, self._row_buffers)


def padded_reference(*sessions: Session) -> None:
    """These sessions read the padded reference from now on."""
    for s in sessions:
        s.__class__ = PaddedReferenceSession


@contextlib.contextmanager
def decoding_padded():
    """Several sessions decoded in one `runtime.decode` call attend as the padded reference."""
    with mock.patch.object(passes, "attend_sessions", attend_sessions):
        yield


def attend_sessions(layer: int, q, k, v, sessions: list, spans: list, scale: float, buffers,
                    faults: dict | None = None) -> torch.Tensor:
    """The runtime's `step_attention.attend_sessions` on the padded reference: one session reading every used
    slot in place as the runtime does; else every session's entries (its padded selection, or every used slot)
    stacked, each row's padded to the longest read, and one call: with the current tokens among them where every
    session reads all (`attention.attend_masked`), else kept apart (`attend_step`); the remainder mixed in per
    session, then each session stores its token. `faults` is not honoured: a store's error fails the step."""
    plans = [s._read(layer, _part(q, a, b), _part(k, a, b)) for s, (a, b) in zip(sessions, spans)]
    stacked = len(sessions) > 1
    if not stacked and plans[0].keys is None:  # every used slot, read in place: the token stored first
        s, p = sessions[0], plans[0]
        slot = s.store.append(layer, k, v, p.cur)
        out = attention.attend_all(q, *s.store.used_keys_values(layer), scale)
        s._appended(layer, slot, k, v)
        return out
    fused = stacked and all(p.idx is ALL and not s.policy.needs_weights for s, p in zip(sessions, plans))
    if not fused:  # a store that could have been read in place hands its entries like any other
        plans = [p if p.keys is not None else s._read_dense(layer, p) for s, p in zip(sessions, plans)]
    if stacked:
        kp, vp, mask, sizes, stored = _stack(layer, q, k, v, sessions, spans, plans, fused, buffers)
    else:
        kp, vp, mask, sizes, stored = plans[0].keys, plans[0].values, plans[0].mask, [plans[0].keys.shape[2]], [None]
    if fused:
        out = attention.attend_masked(q, kp, vp, mask, scale)
        for s, p, slot, (a, b) in zip(sessions, plans, stored, spans):
            if slot is None:
                s._write(layer, p, None, k[a:b], v[a:b])
            else:
                s._appended(layer, slot, k[a:b], v[a:b])
        return out
    remainders = [s.policy.remainder_at(layer, s) for s in sessions]  # before the tokens' append: they were read
    att, probs = attend_step(q, kp, vp, mask, k, v, scale, any(r is not None for r in remainders))
    n = kp.shape[2]
    outs = []
    for s, p, remainder, m, (a, b) in zip(sessions, plans, remainders, sizes, spans):
        outs.append(attention.with_remainder(att.rows(a, b), remainder))
        w = None
        if s.policy.needs_weights:  # the session's own entries, then the current token
            w = probs[a:b] if m == n else torch.cat([probs[a:b, ..., :m], probs[a:b, ..., -1:]], dim=-1)
            w = observed_slots(w, p.idx, s.store.capacity)
        s._write(layer, p, w, _part(k, a, b), _part(v, a, b))
    return outs[0] if not stacked else torch.cat(outs)


def _stack(layer: int, q, k, v, sessions, spans, plans, fused: bool, buffers):
    """Every session's entries in buffers [N,Hkv,n,d], each row's padded to the longest read, and the mask
    [N,Hkv,n] of each row's own; with `fused`, each row's current token after its entries (a store read in
    place gets the token first and is copied with it, as a session decoded alone reads it). Returns keys,
    values, mask, each session's entry count and the slots of the tokens already stored (None where not)."""
    stored = [None] * len(sessions)
    entries = []  # per session: keys and values [B, Hkv, m, d] to stack, the current token among them if fused
    for i, (s, p, (a, b)) in enumerate(zip(sessions, plans, spans)):
        if p.keys is None:  # the token first, then the store's used slots, as `attend_all` reads them
            stored[i] = s.store.append(layer, k[a:b], v[a:b], p.cur)
            entries.append(s.store.past(layer)[:2])
        else:
            entries.append((p.keys, p.values))
    sizes = [e[0].shape[2] + (fused and p.keys is not None) for e, p in zip(entries, plans)]
    n = max(sizes)
    kp, vp = buffers.views(q.shape[0], k.shape[1], n, k)
    length = torch.tensor([m for m, (a, b) in zip(sizes, spans) for _ in range(a, b)], device=q.device)
    mask = torch.arange(n, device=q.device) < length[:, None, None]  # [rows, 1, n]: each row's own entries
    mask = mask.expand(q.shape[0], k.shape[1], n)
    if not all(p.keys is None or p.full for p in plans):  # padding, a window or a selection somewhere
        mask = mask.contiguous()
    for (ks, vs), p, (a, b) in zip(entries, plans, spans):
        m = ks.shape[2]
        kp[a:b, :, :m], vp[a:b, :, :m] = ks, vs
        if p.keys is not None:
            if not p.full:  # not every entry of the session counts
                mask[a:b, :, :m] = p.mask
            if fused:
                kp[a:b, :, m:m + 1], vp[a:b, :, m:m + 1] = k[a:b], v[a:b]
    return kp, vp, mask, sizes, stored


def attend_teacher_rows(q, k, v, keep, first: int, codec, scale: float, remainder: Remainder | None = None):
    """The padded reference of `attention.attend_rows` (keep a mask): decoding rows q [B,H,R,d] (positions
    first..first+R-1 of a sequence with keys and values k, v [B,Hkv,T,d]) at once, scored against every key in
    one [R, T] matrix per chunk: each reads the entries in keep [B,Hkv,R,T] plus itself, past entries as the
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
    for s in range(0, r, TEACHER_ROWS):
        e = min(r, s + TEACHER_ROWS)
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
    att = attention.Attended(out, lse, read @ vf, read.sum(-1))
    return attention.with_remainder(att, remainder._replace(sums=totals, counts=counts))
