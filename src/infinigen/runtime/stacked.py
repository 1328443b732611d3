"""Several sessions' decoding rows stacked into one attention call per layer (the server's running requests)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..selection import ALL
from . import attention
from .attention import StepBuffers, with_own

if TYPE_CHECKING:
    from .session import Session


def _attend_sessions_rows(layer: int, q, k, v, sessions, spans, reads, scale: float, stack: StepBuffers):
    """`_attend_sessions` when every session reads packed rows: each stores its token, its rows (padded to the
    longest session's) are gathered into one buffer, one masked fused call runs over every row."""
    stored = []
    for s, r, (a, b) in zip(sessions, reads, spans):
        slots = s.store.append(layer, k[a:b], v[a:b], r.cur)
        stored.append((slots, *with_own(r.rows, slots, s.store.capacity)))
    m = max(rows.shape[1] for _, rows, _ in stored)
    kp, vp = stack.rows(q.shape[0] * m, k)
    kp, vp = kp.view(q.shape[0], m, -1), vp.view(q.shape[0], m, -1)
    head = torch.full((q.shape[0], m), -1, dtype=torch.long, device=q.device)
    for s, r, (slots, rows, own_head), (a, b) in zip(sessions, reads, stored, spans):
        pad = m - rows.shape[1]
        head[a:b, pad:] = own_head  # padding first, then the rows and the own tokens
        rows = F.pad(rows, (pad, 0))
        s.store.gather_rows(layer, rows, kp[a:b].view(-1, kp.shape[-1]), vp[a:b].view(-1, vp.shape[-1]))
        if r.idx is not ALL:  # a read of ALL counted its rows already (`_read`)
            s.stats.record_rows(layer, rows.numel() - slots.numel())
    rests = [s.policy.unread(layer, s) for s in sessions]  # before the tokens' append: they were read
    att = attention.attend_packed(q, kp[:, None], vp[:, None], head, k.shape[1], scale,
                                  any(rest is not None for rest in rests))
    outs = []
    for s, rest, (slots, _, _), (a, b) in zip(sessions, rests, stored, spans):
        outs.append(attention.with_remainder(att.rows(a, b), rest))
        s._appended(layer, slots, k[a:b], v[a:b])
    return torch.cat(outs)


def _attend_sessions(layer: int, q, k, v, sessions: list[Session], spans: list[tuple[int, int]], scale: float,
                     stack: StepBuffers):
    """One decoding step's attention at `layer` for several sessions whose rows are stacked in q, k, v
    (session i owns rows spans[i]): each session selects from its own store, then one batched attention
    runs over every row, each row's entries padded to the longest read, and each session stores its token.

    When every session reads all its entries and none wants the weights (a dense step), each row's own token
    follows its entries, as in the store of a session decoded alone (a store read in place gets the token
    first and is copied with it), and one fused call runs; otherwise the current tokens stay apart
    (`attend_step`) and the sessions see the weights of what they read."""
    reads = [s._read(layer, q[a:b], k[a:b], in_place=True) for s, (a, b) in zip(sessions, spans)]
    if any(r.rows is not None for r in reads):
        if all(s.reads_rows() for s in sessions):  # a session reading all its entries reads them as rows
            reads = [r if r.rows is not None else r._replace(rows=s.store.select_rows(layer, r.seen, r.seen))
                     for s, r in zip(sessions, reads)]
            return _attend_sessions_rows(layer, q, k, v, sessions, spans, reads, scale, stack)
        # another session needs the reference path (weights, an offloaded store): every selection takes it
        reads = [r if r.rows is None else s._read_slots(layer, r.cur, r.keep, r.keep, None)
                 for s, r in zip(sessions, reads)]
    fused = all(r.idx is ALL and not s.policy.needs_weights for s, r in zip(sessions, reads))
    if not fused:  # a store that could have been read in place hands its entries like any other
        reads = [r if r.keys is not None else s._read_dense(layer, r) for s, r in zip(sessions, reads)]
    slots = [None] * len(sessions)
    entries = []  # per session: keys and values [B, Hkv, m, d] to stack, the current token among them if fused
    for i, (s, r, (a, b)) in enumerate(zip(sessions, reads, spans)):
        if r.keys is None:  # the token first, then the store's used slots, as `attend_all` reads them
            slots[i] = s.store.append(layer, k[a:b], v[a:b], r.cur)
            entries.append(s.store.past(layer)[:2])
        else:
            entries.append((r.keys, r.values))
    sizes = [e[0].shape[2] + (fused and r.keys is not None) for e, r in zip(entries, reads)]
    n = max(sizes)
    kp, vp = stack.views(q.shape[0], k.shape[1], n, k)
    length = torch.tensor([m for m, (a, b) in zip(sizes, spans) for _ in range(a, b)], device=q.device)
    mask = torch.arange(n, device=q.device) < length[:, None, None]  # [rows, 1, n]: each row's own entries
    mask = mask.expand(q.shape[0], k.shape[1], n)
    if not all(r.keys is None or r.full for r in reads):  # padding, a window or a selection somewhere
        mask = mask.contiguous()
    for (ks, vs), r, (a, b) in zip(entries, reads, spans):
        m = ks.shape[2]
        kp[a:b, :, :m], vp[a:b, :, :m] = ks, vs
        if r.keys is not None:
            if not r.full:  # not every entry of the session counts
                mask[a:b, :, :m] = r.mask
            if fused:
                kp[a:b, :, m:m + 1], vp[a:b, :, m:m + 1] = k[a:b], v[a:b]
    if fused:
        out = attention.attend_masked(q, kp, vp, mask, scale)
        for s, r, slot, (a, b) in zip(sessions, reads, slots, spans):
            if slot is None:
                s._write(layer, r, None, k[a:b], v[a:b])
            else:
                s._appended(layer, slot, k[a:b], v[a:b])
        return out
    rests = [s.policy.unread(layer, s) for s in sessions]  # before the tokens' append: they were read
    att, probs = attention.attend_step(q, kp, vp, mask, k, v, scale, any(rest is not None for rest in rests))
    outs = []
    for s, r, rest, m, (a, b) in zip(sessions, reads, rests, sizes, spans):
        outs.append(attention.with_remainder(att.rows(a, b), rest))
        p = probs[a:b]
        if s.policy.needs_weights and m < n:  # the session's own entries, then the current token
            p = torch.cat([p[..., :m], p[..., -1:]], dim=-1)
        s._write(layer, r, p, k[a:b], v[a:b])
    return torch.cat(outs)

