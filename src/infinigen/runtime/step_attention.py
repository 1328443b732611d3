"""A decoding step's attention at one layer, for one session or several whose rows are stacked (the server's
running requests, a fan-out): one session is "many" with one member.

    plans      each session's read plan (`Session._read`: for every row and KV head, all of its entries or
               the packed slots to read), asked of its own policy and store
    attention  ONE call over every row: packed rows (`attention.attend_packed`, or for one session the C++
               kernel reading its store in place), all entries read in place (`attention.attend_all`, one
               session), all entries stacked (`attention.attend_masked`), or the reference path that keeps
               the current token apart and hands the weights to a policy that observes them
               (`attention.attend_step`)
    remainder  mixed in once per session (`attention.with_remainder`), then each session stores its token

Entries of several sessions are stacked into buffers, each row's padded to the longest read; one session's are
read where they lie, so its attention copies nothing it need not.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import fused_select
from ..selection import ALL
from . import attention
from .attention import StepBuffers, with_own


def attend_sessions(layer: int, q, k, v, sessions: list, spans: list[tuple[int, int]], scale: float,
                    buffers: StepBuffers) -> torch.Tensor:
    """One decoding step's attention at `layer` for the sessions whose rows are stacked in q [N,H,1,d], k, v
    [N,Hkv,1,d] (session i owns rows spans[i]): each session plans its read from its own store, one attention
    runs over every row, the remainder is mixed in per session and each session stores its token.

    When every session reads all its entries and none wants the weights (a dense step), the current token is
    read among the entries: stored first where one session's store is read in place, else following each row's
    stacked entries; otherwise the current tokens stay apart (`attend_step`) and the sessions see the weights
    of what they read."""
    plans = [s._read(layer, _part(q, a, b), _part(k, a, b), in_place=True) for s, (a, b) in zip(sessions, spans)]
    if any(p.rows is not None for p in plans):
        if all(s.reads_rows() for s in sessions):  # a session reading all its entries reads them as rows
            plans = [p if p.rows is not None else p._replace(rows=s.store.select_rows(layer, p.seen, p.seen))
                     for s, p in zip(sessions, plans)]
            return _attend_rows(layer, q, k, v, sessions, spans, plans, scale, buffers)
        # another session needs the reference path (weights, an offloaded store): every selection takes it
        plans = [p if p.rows is None else s._read_slots(layer, p.cur, p.keep, p.keep, None)
                 for s, p in zip(sessions, plans)]
    stacked = len(sessions) > 1
    if not stacked and plans[0].keys is None:  # every used slot, read in place: the token stored first
        s, p = sessions[0], plans[0]
        slots = s.store.append(layer, k, v, p.cur)
        out = attention.attend_all(q, *s.store.used_keys_values(layer), scale)
        s._appended(layer, slots, k, v)
        return out
    # the current token joins the entries where they are stacked (copied) anyway
    fused = stacked and all(p.idx is ALL and not s.policy.needs_weights for s, p in zip(sessions, plans))
    if not fused:  # a store that could have been read in place hands its entries like any other
        plans = [p if p.keys is not None else s._read_dense(layer, p) for s, p in zip(sessions, plans)]
    if stacked:
        kp, vp, mask, sizes, slots = _stack(layer, q, k, v, sessions, spans, plans, fused, buffers)
    else:
        kp, vp, mask, sizes, slots = plans[0].keys, plans[0].values, plans[0].mask, [plans[0].keys.shape[2]], [None]
    if fused:
        out = attention.attend_masked(q, kp, vp, mask, scale)
        for s, p, slot, (a, b) in zip(sessions, plans, slots, spans):
            if slot is None:
                s._write(layer, p, None, k[a:b], v[a:b])
            else:
                s._appended(layer, slot, k[a:b], v[a:b])
        return out
    remainders = [s.policy.remainder_at(layer, s) for s in sessions]  # before the tokens' append: they were read
    att, probs = attention.attend_step(q, kp, vp, mask, k, v, scale, any(r is not None for r in remainders))
    n = kp.shape[2]
    outs = []
    for s, p, remainder, m, (a, b) in zip(sessions, plans, remainders, sizes, spans):
        outs.append(attention.with_remainder(att.rows(a, b), remainder))
        w = probs[a:b]
        if s.policy.needs_weights and m < n:  # the session's own entries, then the current token
            w = torch.cat([w[..., :m], w[..., -1:]], dim=-1)
        s._write(layer, p, w, _part(k, a, b), _part(v, a, b))
    return outs[0] if not stacked else torch.cat(outs)


def _stack(layer: int, q, k, v, sessions, spans, plans, fused: bool, buffers: StepBuffers):
    """Every session's entries in buffers [N,Hkv,n,d], each row's padded to the longest read, and the mask
    [N,Hkv,n] of each row's own; with `fused`, each row's current token after its entries (a store read in
    place gets the token first and is copied with it, as a session decoded alone reads it). Returns keys,
    values, mask, each session's entry count and the slots of the tokens already stored (None where not)."""
    slots = [None] * len(sessions)
    entries = []  # per session: keys and values [B, Hkv, m, d] to stack, the current token among them if fused
    for i, (s, p, (a, b)) in enumerate(zip(sessions, plans, spans)):
        if p.keys is None:  # the token first, then the store's used slots, as `attend_all` reads them
            slots[i] = s.store.append(layer, k[a:b], v[a:b], p.cur)
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
    return kp, vp, mask, sizes, slots


def _attend_rows(layer: int, q, k, v, sessions, spans, plans, scale: float, buffers: StepBuffers):
    """`attend_sessions` when every session reads packed rows: each stores its token first and reads it among
    its rows. One session whose store the C++ kernel can read is read in place; otherwise each session's rows
    (padded to the longest session's) are gathered into one buffer and one masked fused call runs over every
    row."""
    stored = [s.store.append(layer, _part(k, a, b), _part(v, a, b), p.cur)
              for s, p, (a, b) in zip(sessions, plans, spans)]
    remainders = [s.policy.remainder_at(layer, s) for s in sessions]  # before the tokens' append: they were read
    wants_lse = any(r is not None for r in remainders)
    store = sessions[0].store
    if len(sessions) == 1 and fused_select.usable(q, store.k[layer]):
        sessions[0].stats.record_rows(layer, plans[0].rows.rows.numel())
        att = _attend_rows_in_place(q, k, store.k[layer], store.v[layer], plans[0].rows, stored[0], store.capacity,
                                    scale, wants_lse)
    else:
        att = _attend_rows_gathered(layer, q, k, sessions, spans, plans, stored, scale, buffers, wants_lse)
    outs = []
    for s, remainder, slots, (a, b) in zip(sessions, remainders, stored, spans):
        outs.append(attention.with_remainder(att.rows(a, b), remainder))
        s._appended(layer, slots, _part(k, a, b), _part(v, a, b))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend_rows_in_place(q, k, keys, values, sel, slots, capacity: int, scale: float,
                          wants_lse: bool) -> attention.Attended:
    """One session's packed rows `sel` and its tokens (stored in slots [B, Hkv]) read from the store's keys and
    values in place: one C++ call, which returns what the remainder needs as well."""
    b, h, _, d = q.shape
    hkv = k.shape[1]
    own = torch.arange(b * hkv, device=q.device).view(b, hkv) * capacity + slots
    out, lse, read_sum = fused_select.attend_rows(q.view(b, h, d), keys.view(-1, d), values.view(-1, d), sel.rows,
                                                  sel.counts, own, scale)
    if not wants_lse:
        return attention.Attended(out.view(b, h, 1, d))
    return attention.Attended(out.view(b, h, 1, d), lse.view(b, hkv, h // hkv, 1), read_sum, sel.counts)


def _attend_rows_gathered(layer: int, q, k, sessions, spans, plans, stored, scale: float, buffers: StepBuffers,
                          wants_lse: bool) -> attention.Attended:
    """Every session's packed rows and its tokens gathered into one buffer [N, m, d] (padding first), one
    masked fused call over every row (`attention.attend_packed`)."""
    owned = [with_own(p.rows, slots, s.store.capacity) for s, p, slots in zip(sessions, plans, stored)]
    m = max(rows.shape[1] for rows, _ in owned)
    kp, vp = buffers.rows(q.shape[0] * m, k)
    kp, vp = kp.view(q.shape[0], m, -1), vp.view(q.shape[0], m, -1)
    head = torch.full((q.shape[0], m), -1, dtype=torch.long, device=q.device)
    for s, p, slots, (rows, own_head), (a, b) in zip(sessions, plans, stored, owned, spans):
        pad = m - rows.shape[1]
        head[a:b, pad:] = own_head  # padding first, then the rows and the own tokens
        rows = F.pad(rows, (pad, 0))
        s.store.gather_rows(layer, rows, kp[a:b].view(-1, kp.shape[-1]), vp[a:b].view(-1, vp.shape[-1]))
        if p.idx is not ALL:  # a read of ALL counted its rows already (`_read`)
            s.stats.record_rows(layer, rows.numel() - slots.numel())
    return attention.attend_packed(q, kp[:, None], vp[:, None], head, k.shape[1], scale, wants_lse)


def _part(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows a..b-1 of x: one session's of several; all of them (one session) without a slicing call."""
    return x if a == 0 and b == x.shape[0] else x[a:b]
