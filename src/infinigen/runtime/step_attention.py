"""A decoding step's attention at one layer, for one session or several whose rows are stacked (the server's
running requests, a fan-out): one session is "many" with one member.

    plans      each session's read plan (`Session._read`: for every row and KV head, all of its entries in
               place or the packed rows to read), asked of its own policy and store
    attention  packed rows: each session's read where they lie by the fused kernel (its store, or the fast
               buffer an offloaded, coded or pool-limited store hands them in), one call per session; where a
               policy observes the weights or no kernel takes the tensors, every row gathered for ONE call
               (`attention.attend_packed`); or the dense step's entries, read in place (`attention.attend_all`,
               one session) or stacked (`attention.attend_masked`), in ONE call over every row
    remainder  mixed in once per session (`attention.with_remainder`; inside the C++ call where a session's
               rows are read by the kernel on a CPU), then each session stores its token

Packed rows are read where they lie, so a session's attention copies nothing it need not; entries gathered or
stacked for one call over several sessions go into buffers, each row's padded to the longest read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache import HandedRows
from ..kernels import fused_select
from ..selection import ALL
from . import attention
from .attention import StepBuffers


def attend_sessions(layer: int, q, k, v, sessions: list, spans: list[tuple[int, int]], scale: float,
                    buffers: StepBuffers, faults: dict | None = None) -> torch.Tensor:
    """One decoding step's attention at `layer` for the sessions whose rows are stacked in q [N,H,1,d], k, v
    [N,Hkv,1,d] (session i owns rows spans[i]): each session plans its read from its own store, one attention
    runs over every row, the remainder is mixed in per session and each session stores its token.

    A session that reads all its entries in place (the dense step) stores its token first and reads it among
    them: one session in place, several stacked into one buffer (copied), each row's padded to the longest.
    Everything else is read as packed rows (`_attend_rows`); a session reading all its entries beside one that
    reads rows reads them as rows too.

    `faults` (a dict, several sessions): a session whose own reads or writes of its store raise OSError leaves
    the step (faults[its index] = the error): where its plan fails the others attend without it; where its rows
    or its token's write fail while every session reads packed rows, its rows attend nothing and the others go
    on. Its rows' output then means nothing; every other row's is computed as without it. Elsewhere the error
    fails the step."""
    if faults is None and len(sessions) == 1:  # one session (a decoding step's common case): its plan, and where
        # it reads packed rows of a store read in place with the kernel built, one C++ call (`_one_in_place`)
        session = sessions[0]
        plan = session._read(layer, q, k)
        if plan.rows is not None and _reads_in_place(q, session, layer):
            return _one_in_place(layer, q, k, v, session, plan, scale, buffers)
        return _attend_planned(layer, q, k, v, sessions, spans, [plan], scale, buffers, faults)
    plans = [own_part(faults, i, s._read, layer, _part(q, a, b), _part(k, a, b))
             for i, (s, (a, b)) in enumerate(zip(sessions, spans))]
    if any(p is None for p in plans):  # a session whose plan failed: the others attend without it
        return _without(layer, q, k, v, sessions, spans, plans, scale, buffers, faults)
    return _attend_planned(layer, q, k, v, sessions, spans, plans, scale, buffers, faults)


def own_part(faults: dict | None, i: int, work, *args, **kwargs):
    """Session i's own part of the step: its OSError recorded in `faults` (None returned), where given; a
    session that failed before (at an earlier layer of the step) does nothing more."""
    if faults is None:
        return work(*args, **kwargs)
    if i in faults:
        return None
    try:
        return work(*args, **kwargs)
    except OSError as e:
        faults[i] = e
        return None


def _without(layer: int, q, k, v, sessions, spans, plans, scale: float, buffers: StepBuffers, faults: dict):
    """`_attend_planned` over the sessions whose plan did not fail, their rows taken out of the stack; the
    failed sessions' rows get zeros."""
    live = [i for i, p in enumerate(plans) if p is not None]
    out = torch.zeros_like(q)
    if not live:
        return out
    rows = torch.cat([torch.arange(*spans[i], device=q.device) for i in live])
    sub_spans, at = [], 0
    for i in live:
        n = spans[i][1] - spans[i][0]
        sub_spans.append((at, at + n))
        at += n
    sub_faults: dict = {}
    out[rows] = _attend_planned(layer, q[rows], k[rows], v[rows], [sessions[i] for i in live], sub_spans,
                                [plans[i] for i in live], scale, buffers, sub_faults)
    faults.update({live[j]: e for j, e in sub_faults.items()})
    return out


def _attend_planned(layer: int, q, k, v, sessions, spans, plans, scale: float, buffers: StepBuffers,
                    faults: dict | None) -> torch.Tensor:
    """`attend_sessions` once every session has its plan."""
    if any(p.rows is not None for p in plans):  # a session reading all its entries reads them as rows
        plans = [p if p.rows is not None else own_part(faults, i, lambda s=s, p=p: p._replace(
            rows=s.store.select_rows(layer, p.seen, p.seen))) for i, (s, p) in enumerate(zip(sessions, plans))]
        if any(p is None for p in plans):
            return _without(layer, q, k, v, sessions, spans, plans, scale, buffers, faults)
        return _attend_rows(layer, q, k, v, sessions, spans, plans, scale, buffers, faults)
    slots = [s.store.append(layer, _part(k, a, b), _part(v, a, b), p.cur)
             for s, p, (a, b) in zip(sessions, plans, spans)]
    if len(sessions) == 1:  # every used slot, read in place, the token among them
        out = attention.attend_all(q, *sessions[0].store.used_keys_values(layer), scale)
    else:
        out = attention.attend_masked(q, *_stack(q, k, sessions, spans, layer, buffers), scale)
    for s, slot, (a, b) in zip(sessions, slots, spans):
        s._appended(layer, slot, _part(k, a, b), _part(v, a, b))
    return out


def _stack(q, k, sessions, spans, layer: int, buffers: StepBuffers):
    """Every session's used slots (its token stored among them) in buffers [N,Hkv,n,d], each row's padded to the
    longest, and the mask [N,Hkv,n] of each row's own. Returns keys, values, mask."""
    entries = [s.store.used_keys_values(layer) for s in sessions]
    sizes = [e[0].shape[2] for e in entries]
    n = max(sizes)
    kp, vp = buffers.views(q.shape[0], k.shape[1], n, k)
    length = torch.tensor([m for m, (a, b) in zip(sizes, spans) for _ in range(a, b)], device=q.device)
    mask = torch.arange(n, device=q.device) < length[:, None, None]  # [rows, 1, n]: each row's own entries
    for (ks, vs), (a, b) in zip(entries, spans):
        kp[a:b, :, :ks.shape[2]], vp[a:b, :, :ks.shape[2]] = ks, vs
    return kp, vp, mask.expand(q.shape[0], k.shape[1], n)


def _attend_rows(layer: int, q, k, v, sessions, spans, plans, scale: float, buffers: StepBuffers,
                 faults: dict | None = None):
    """`attend_sessions` when every session reads packed rows. A session whose store the attention may read in
    place (`KVStore.reads_rows`) stores its token first and reads it among its rows; any other store hands its
    rows over in a fast buffer with a spare row per (batch row, KV head) (`KVStore.hand_rows`: an offloaded
    pool's fetched rows, a coded or pool-limited store's copied ones), the token is written there and stored
    after the attention. Each session: one C++ (on CUDA, Triton) call over its rows where they lie, as it makes
    decoded alone; where a policy observes the weights or the kernel cannot take the tensors, every row is
    gathered into one buffer, one masked fused call."""
    if len(sessions) == 1 and not faults and _reads_in_place(q, sessions[0], layer):
        return _one_in_place(layer, q, k, v, sessions[0], plans[0], scale, buffers)
    in_place = [s.store.reads_rows() for s in sessions]
    stored = [s.store.append(layer, _part(k, a, b), _part(v, a, b), p.cur) if ip else None
              for s, p, ip, (a, b) in zip(sessions, plans, in_place, spans)]
    remainders = [s.policy.remainder_at(layer, s) for s in sessions]  # before the tokens' append: they were read
    wants_lse = any(r is not None for r in remainders)
    observes = any(s.policy.needs_weights for s in sessions)

    def source(i: int) -> HandedRows:
        """Where session i's rows and tokens lie: its store, or the buffer its store hands them in."""
        s, p, (a, b) = sessions[i], plans[i], spans[i]
        if in_place[i]:
            keys, values = buffers.flat_store(s.store, layer)
            return HandedRows(keys, values, p.rows.rows, buffers.own_rows_at(stored[i], s.store.capacity))
        handed = s.store.hand_rows(layer, p.rows, buffers.handed, every=p.idx is ALL)
        own = handed.own.reshape(-1)
        handed.keys.index_copy_(0, own, _part(k, a, b).reshape(own.numel(), -1).to(handed.keys.dtype))
        handed.values.index_copy_(0, own, _part(v, a, b).reshape(own.numel(), -1).to(handed.values.dtype))
        return handed

    weights = None
    if not observes and all(fused_select.usable(q, s.store.k[layer]) for s in sessions):
        atts = []  # each session's rows read where they lie by one C++ (or Triton) call of its own
        for i, (s, p, (a, b)) in enumerate(zip(sessions, plans, spans)):
            if p.idx is not ALL:  # a read of ALL counted its rows already (`_read`)
                s.stats.record_rows(layer, p.rows.rows.numel() if p.rows.read is None else p.rows.read)
            src = own_part(faults, i, source, i)
            if src is None:  # its rows could not be read
                atts.append(None)
                continue
            att, mixed = _attend_rows_in_place(_part(q, a, b), src, p.rows.counts, scale, remainders[i] is not None,
                                               remainders[i])
            if mixed:  # the kernel mixed the remainder in
                remainders[i] = None
            atts.append(att)
    else:
        def own_source(i: int) -> HandedRows | None:
            return own_part(faults, i, source, i)
        att, weights = _attend_rows_gathered(layer, q, k, sessions, spans, plans, own_source, scale, buffers,
                                             wants_lse, observes)
        atts = [att.rows(a, b) for a, b in spans]
    outs = []
    for i, (s, p, remainder, slots, (a, b)) in enumerate(zip(sessions, plans, remainders, stored, spans)):
        if faults and i in faults:  # its rows attended nothing: nothing to store
            outs.append(torch.zeros_like(q[a:b]))
            continue
        outs.append(attention.with_remainder(atts[i], remainder))
        seen = None
        if s.policy.needs_weights:  # each past row's weight and row in the store, then the tokens'
            w = weights[a:b]
            hkv = k.shape[1]
            n = p.rows.rows.shape[1]
            seen = (w[:, -hkv - n:-hkv], p.rows.rows, w[:, -hkv:])
        if in_place[i]:
            if seen is not None:
                s.policy.observe(layer, *seen, s)
            s._appended(layer, slots, _part(k, a, b), _part(v, a, b))
        else:
            own_part(faults, i, s._write, layer, p, seen, _part(k, a, b), _part(v, a, b))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _reads_in_place(q, session, layer: int) -> bool:
    """Whether one session's packed rows are attended where they lie by the C++ kernel (`_one_in_place`): a store
    read in place, no weights wanted, the kernel usable for q and the store."""
    store = session.store
    return store.reads_rows() and not session.policy.needs_weights and fused_select.usable(q, store.k[layer])


def _one_in_place(layer: int, q, k, v, session, plan, scale: float, buffers: StepBuffers) -> torch.Tensor:
    """`_attend_rows` for one session whose store the attention reads in place, no weights wanted, the kernel
    built (a decoding step's common case): the token stored first, one C++ call over its rows and its own (the
    remainder mixed in there on a CPU), the policy and listeners told of the append."""
    store = session.store
    slots = store.append(layer, k, v, plan.cur)
    remainder = session.policy.remainder_at(layer, session)  # (read before the token's append: it was read)
    if plan.idx is not ALL:  # a read of ALL counted its rows already (`_read`)
        session.stats.record_rows(layer, plan.rows.rows.numel())
    keys, values = buffers.flat_store(store, layer)
    own = buffers.own_rows_at(slots, store.capacity)
    if fused_select.native_rows(q):  # the C++ kernel, the remainder mixed in there
        out = fused_select.attend_rows(q, keys, values, plan.rows.rows, plan.rows.counts, own, scale,
                                       remainder=remainder)[0]
    else:
        src = HandedRows(keys, values, plan.rows.rows, own)
        att, mixed = _attend_rows_in_place(q, src, plan.rows.counts, scale, remainder is not None, remainder)
        out = att.out if mixed else attention.with_remainder(att, remainder)
    session._appended(layer, slots, k, v)
    return out


def _attend_rows_in_place(q, src: HandedRows, counts, scale: float, wants_lse: bool, remainder=None):
    """One session's packed rows and tokens read where they lie (`src`: its store, or the buffer its store
    handed them in): one C++ call, which returns what the remainder needs as well, or (on a CPU) mixes the
    session's `remainder` in itself. Returns the attention and whether the remainder is mixed in."""
    b, h, _, d = q.shape
    native = fused_select.native_rows(q)  # the C++ kernel: q [B, H, 1, d] as it is, a remainder mixed in there
    mixes = remainder is not None and native
    extra = {"remainder": remainder} if mixes else {"far": src.far} if src.far is not None else {}
    out, lse, read_sum = fused_select.attend_rows(q if native else q.view(b, h, d), src.keys, src.values, src.rows,
                                                  counts, src.own, scale, **extra)
    out = out if native else out.view(b, h, 1, d)
    if not wants_lse or mixes:
        return attention.Attended(out), mixes
    hkv = counts.shape[1]
    return attention.Attended(out, lse.view(b, hkv, h // hkv, 1), read_sum, counts), False


def _attend_rows_gathered(layer: int, q, k, sessions, spans, plans, source, scale: float, buffers: StepBuffers,
                          wants_lse: bool, observes: bool):
    """Every session's packed rows and its tokens gathered into one buffer [N, m, d] (padding first), one
    masked fused call over every row (`attention.attend_packed`); with `observes`, the weight [N, m] each
    column received too (else None)."""
    hkv = k.shape[1]
    cols = [plans[i].rows.rows.shape[1] + hkv for i in range(len(sessions))]
    m = max(cols)
    kp, vp = buffers.rows(q.shape[0] * m, k)
    head = torch.full((q.shape[0], m), -1, dtype=torch.long, device=q.device)
    own_head = torch.arange(hkv, device=q.device)
    for i, (s, p, (a, b)) in enumerate(zip(sessions, plans, spans)):
        src = source(i)  # (a buffer a store hands its rows in is reused by the next session: copied out now)
        pad = m - cols[i]
        if src is None:  # its rows could not be read: they attend nothing (every column padding)
            continue
        head[a:b, pad:] = torch.cat([p.rows.head, own_head.expand(b - a, hkv)], 1)  # padding first, the tokens last
        index = F.pad(torch.cat([src.rows, src.own], 1), (pad, 0)).reshape(-1)
        if src.far is None:
            torch.index_select(src.keys, 0, index, out=kp[a * m:b * m])
            torch.index_select(src.values, 0, index, out=vp[a * m:b * m])
        else:  # some rows lie in pinned host memory: the GPU gathers them over the bus
            far_k, far_v, split = src.far
            fused_select.gather_rows(src.keys, far_k, split, index, out=kp[a * m:b * m])
            fused_select.gather_rows(src.values, far_v, split, index, out=vp[a * m:b * m])
        if p.idx is not ALL:  # a read of ALL counted its rows already (`_read`)
            s.stats.record_rows(layer, (b - a) * (m - hkv) if p.rows.read is None else p.rows.read)
    kp, vp = kp.view(q.shape[0], 1, m, -1), vp.view(q.shape[0], 1, m, -1)
    att = attention.attend_packed(q, kp, vp, head, hkv, scale, wants_lse)
    return att, attention.packed_weights(q, kp, head, hkv, scale) if observes else None


def _part(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows a..b-1 of x: one session's of several; all of them (one session) without a slicing call."""
    return x if a == 0 and b == x.shape[0] else x[a:b]
