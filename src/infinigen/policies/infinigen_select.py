"""InfiniGen's selection rules: which cached entries a row reads, given its speculated scores.

`choose` is the rule (tokens within `alpha` of a query head's maximum, counted per `budget`, at most a cap);
`top_n_per_row` and `choose_blocks` are its cuts. `select_row` applies it to one decoding row against the
store's slots; `sequence_rows` to every decoding row of a teacher-forced sequence with the same shapes per row,
so bit for bit the same selection; `rows_in_blocks` to blocks of rows at once (calibration's scoring: the same
up to float summation order). Each records, where the policy adds it, the log of the attention mass its
selection leaves unread (`remainder_lse`), which the runtime turns into the remainder.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache import SelectedRows
from ..kernels import block_select, fused_select
from ..kernels.int4 import PackedKeys
from .base import ALL
from . import infinigen_rerank as reranking
from .cuts import layer_total, remainder_lse, top_n_per_row
from .speculation import INT4_GROUP

ROWS_PER_CHOICE = 64  # teacher-forced rows per `choose` call in `rows_in_blocks`
ROWS_PER_FUSED_CHOICE = 256  # teacher-forced rows per fused selection call in `rows_fused`
SCORE_BLOCK = 2 ** 27  # speculated scores per call when a teacher-forced pass scores its rows in blocks


# ---- sparse only where it pays (dense_below) ------------------------------------------------------------
# A row's cached length is its position: the real tokens before it, the same number in decoding (left
# padding aside) and in teacher-forced scoring, so both read densely at the same rows. Each row is decided
# alone (a row below the threshold keeps everything even when the rows beside it select): a row's
# tokens never depend on what else is in the batch, and a mixed step only happens while the rows of a
# batch straddle the threshold, at most as many steps as their prompts differ in length.


def pass_lengths(session) -> tuple:
    """Per token of the current pass: the fewest and the most cached tokens over the batch's rows."""
    st, pos = session.state, session.positions
    if st.lengths[0] is not pos:  # a new pass (a step, a replay, a teacher-forced sequence)
        st.lengths = (pos, pos.amin(0).tolist(), pos.amax(0).tolist())
    return st.lengths[1], st.lengths[2]


def dense_pass(session) -> bool:
    """Every row of the current pass is below `dense_below`: nothing to speculate, every layer reads ALL."""
    below = session.state.dense_below
    return below > 0 and max(pass_lengths(session)[1]) < below


def dense_rows(session, row: int) -> torch.Tensor | None:
    """Bool [B]: the batch's rows below `dense_below` at token `row` of the pass; None when there is none."""
    below = session.state.dense_below
    if below == 0 or pass_lengths(session)[0][row] >= below:
        return None
    return session.positions[:, row] < below


def in_window(cfg, valid, pos, cur):
    w = cfg.sliding_window
    return valid if w is None else valid & (cur - pos < w)


def select_row(policy, layer: int, row: int, session, packs: bool = False) -> torch.Tensor | SelectedRows:
    """Selection [B, Hkv, S] over the store's slots for decoding row `row`; with `packs` (the runtime reads
    packed rows, every used slot valid) and the fused kernel built, budget "layer" makes the packed rows
    and the remainder's log-sum-exp in one C++ call (`fused_select.select_packed`: the same cut). Blocks read
    whole (every used slot valid, the kernel built): `block_select.select_blocks` makes them, packed or not."""
    st, store, model = session.state, session.store, session.model
    n = store.length[layer]
    spec_keys = policy.speculation.keys(st, layer, session)
    adds = policy._adds_remainder(st, layer)
    every_valid = not store.padded and model.cfg.sliding_window is None
    where = spec_keys.codes.device if isinstance(spec_keys, PackedKeys) else spec_keys.device  # the scores'
    rerank = reranking.reranks(policy, st, layer, decoding_row=row)
    if every_valid and packs and fuses_selection(policy, where):
        cut = policy._cut(st, model, layer, n, store.capacity, adds)
        if rerank:  # the scores are wanted again for the re-rank's candidates
            scores = policy.speculation.scores(st, layer, row, spec_keys, n)
            keep, rows, head, counts, _ = fused_select.select_packed(scores.clone(), **cut)
            keep, rows, head, counts, lse, beside = reranking.rerank_packed(
                policy, keep, counts, scores, policy.speculation.row_query(st, layer, row), store.past(layer)[0],
                model.scale, store.capacity)
            st.keys_beside[layer] = beside.unsqueeze(-1)
        else:
            got = policy.speculation.scores_cut(st, layer, row, spec_keys, n, **cut)  # scored and cut in one call
            if got is None:
                got = fused_select.select_packed(policy.speculation.scores(st, layer, row, spec_keys, n), **cut)
            keep, rows, head, counts, lse = got
        if adds:
            st.remainders[layer] = lse.unsqueeze(-1)  # (a method: indexing with None costs several times more)
        return SelectedRows(keep, rows, head, counts)
    cap = policy._cap(st, model, layer, n)
    scores = policy.speculation.scores(st, layer, row, spec_keys, n)  # [B, Hkv, G, S]
    # the blocks, and (packs) their rows, in one call
    if every_valid and not rerank and selects_blocks_natively(policy, scores):
        total = policy._layer_total(cap, n, scores.shape[1], n)
        keep, rows, head, counts, lse = block_select.select_blocks(scores, model.scale, st.alpha, total,
                                                                   policy.block, store.capacity, adds, packs)
        if adds:
            st.remainders[layer] = lse[..., None]
        return SelectedRows(keep, rows, head, counts) if packs else keep
    scores = scores[:, :, :, None]  # [B, Hkv, G, 1, S]
    valid = store.valid[layer][:, :, :n]
    cur = session.positions[:, row]
    valid = in_window(model.cfg, valid, store.pos[layer][:, :, :n], cur[:, None, None])
    # every row has n valid tokens unless a prompt was padded or a window hides some: then the caps
    # are known on the host and the selection needs no synchronization (see `choose`)
    shared_length = n if not store.padded and model.cfg.sliding_window is None else None
    s = scores * model.scale
    keep = policy._choose(s.clone() if adds and not rerank else s, valid[:, :, None, :], st.alpha, shared_length, cap)
    if rerank:  # the own query [B, Hkv, G, d] on the exact keys of the candidates
        keep, lse, beside = reranking.rerank_rows(policy, keep, scores, valid if shared_length is None else None,
                                                  policy.speculation.row_query(st, layer, row), store.past(layer)[0],
                                                  model.scale)
        st.keys_beside[layer] = beside
        if adds:
            st.remainders[layer] = lse
    elif adds:  # `choose` worked on a copy: s holds the scores
        st.remainders[layer] = remainder_lse(s, valid[:, :, None, :] & ~keep)
    return keep[:, :, 0]


def sequence_rows(policy, layer, rows, session):
    """All decoding rows of `layer` at once (teacher-forced): the same selection as `select_row`
    makes for each row, with the keys of every earlier position in the partial or packed key cache."""
    st, model = session.state, session.model
    q, k = rows.query, rows.keys
    p, t = rows.first, k.shape[2]
    b, hkv, _, d = k.shape
    dev = k.device
    if dense_pass(session):
        return ALL
    # rows before `first` have every batch row below dense_below: they keep everything, nothing is scored
    most = pass_lengths(session)[1]
    first = next(r for r in range(p, t) if most[r] >= st.dense_below)
    if layer == 0 or st.own_query:  # the rows' own queries (rows before p are never scored)
        h = q.shape[1]
        st.spec[layer] = torch.cat([q[:, :, :1].expand(b, h, p, d), q], 2).view(b, hkv, h // hkv, t, d)
    if policy.key_mode == "int4":
        spec_keys = PackedKeys(b, hkv, t, d, group=INT4_GROUP, layout=st.layout, device=dev)
        # centred on the keys decoding packs first: the prompt's, or (lazy_keys) those before the first row
        # that selects
        before = torch.arange(t, device=dev) < (first if st.lazy_keys else p)
        spec_keys.write(0, policy.speculation.centre(st, layer, policy.speculation.rotate(st, k, layer),
                                                     before.expand(b, hkv, t)))
    else:
        spec_keys = policy.speculation.project(st, k, layer).to(st.key_dtype)  # [B, Hkv, T, c]
    batched = isinstance(spec_keys, PackedKeys) and spec_keys.layout == "tinygemm"
    rerank = reranking.reranks(policy, st, layer)
    if rerank:  # per row, the candidates' keys read beside its selection
        beside = st.keys_beside[layer] = torch.zeros(b, hkv, t - p, dtype=torch.long, device=dev)
    every, block = None, (first, first)
    # each score of the int4 kernel is its own dot product, the same bits whatever the other rows of the
    # call: score a block of rows in one call and cut per row (blocks of at most SCORE_BLOCK scores: at
    # 32K tokens all rows at once would be 15 GB, and past 2**31 scores the kernel faults)
    rows_per_block = max(1, SCORE_BLOCK // max(1, b * q.shape[1] * t))
    out = torch.zeros(b, hkv, t - p, t, dtype=torch.bool, device=dev)
    out[:, :, :first - p] = True  # the runtime keeps each row's past of these
    unread_lse = None
    if policy._adds_remainder(st, layer):  # rows before `first` read everything: nothing unread
        unread_lse = torch.full((b, hkv, q.shape[1] // hkv, t - p), float("-inf"), device=dev)
    for r in range(first, t):
        # row r sees the r cached tokens before it: the same shapes, so the same float32 numbers,
        # as `select_row` when decoding (row by row: the selection's reductions depend on shapes)
        valid = in_window(model.cfg, torch.ones(b, hkv, 1, r, dtype=torch.bool, device=dev),
                             torch.arange(r, device=dev), r)
        if batched and r >= block[1]:
            block = (r, min(t, r + rows_per_block))
            qs = policy.speculation.queries(st, layer, slice(*block))  # [B, Hkv, G, R, d]
            g = qs.shape[2]
            flat = qs.reshape(b, hkv, g * (block[1] - r), d).contiguous()
            every = policy.speculation.shifted(st, layer, spec_keys.scores(flat, block[1]), flat)
            every = every.view(b, hkv, g, block[1] - r, block[1])
        if every is not None:
            scores = every[:, :, :, r - block[0], None, :r]
        else:
            scores = policy.speculation.scores(st, layer, r, spec_keys, r)[:, :, :, None]  # [B, Hkv, G, 1, r]
        shared_length = r if model.cfg.sliding_window is None else None
        cap = policy._cap(st, model, layer, r)
        s = scores * model.scale
        row = policy._choose(s.clone() if unread_lse is not None and not rerank else s, valid, st.alpha, shared_length,
                             cap)
        lse = None
        if rerank:  # row r's own query on the exact keys of its candidates
            row, lse, beside[:, :, r - p:r - p + 1] = reranking.rerank_rows(
                policy, row, scores, valid[:, :, 0] if shared_length is None else None,
                q[:, :, r - p].view(b, hkv, -1, d), k[:, :, :r], model.scale)
        row = row[:, :, 0]
        dense = dense_rows(session, r)
        if dense is not None:
            row |= dense[:, None, None]
            lse = None if lse is None else lse.masked_fill(dense[:, None, None, None], float("-inf"))
        out[:, :, r - p, :r] = row
        if unread_lse is not None:
            unread_lse[:, :, :, r - p] = (remainder_lse(s, valid & ~row[:, :, None]) if lse is None else lse)[..., 0]
    if unread_lse is not None:
        st.remainders[layer] = unread_lse
    return out


def fuses_selection(policy, device) -> bool:
    """Whether `fused_select.select_packed` makes this selection: budget "layer" slot by slot, the scores on the
    CPU (`device`: the speculation keys', where they are scored), the kernel built."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return (policy.budget == "layer" and policy.block <= 1 and kind == "cpu" and fused_select.packs_selection
            and fused_select.available())


def selects_blocks_natively(policy, scores: torch.Tensor) -> bool:
    """Whether `block_select.select_blocks` makes this selection: budget "layer" in blocks read whole (no
    `block_fetch`), scores on the CPU, the kernel built."""
    return (policy.budget == "layer" and policy.block > 1 and policy.block_fetch is None
            and scores.device.type == "cpu" and block_select.available())


def rows_in_blocks(policy, layer, rows, session, block: int = ROWS_PER_CHOICE):
    """`sequence_rows` with the rows chosen `block` at a time (one `choose` of each block, every row its
    own length and cap): the same selection up to float summation order over the block's longer rows,
    so not bit for bit the decoding path's, several times faster (calibration's scoring: `state.rows_in_blocks`).
    Where it does not apply (partial keys, `dense_below`, a query speculated ahead): `sequence_rows`; where the
    fused kernel makes it (`fuses_rows`): `rows_fused`, packed rows instead of a mask."""
    st, model = session.state, session.model
    q, k = rows.query, rows.keys
    if (policy.key_mode != "int4" or st.dense_below or q is None or not (layer == 0 or st.own_query)
            or reranking.reranks(policy, st, layer)):
        return sequence_rows(policy, layer, rows, session)
    if fuses_rows(policy, session, rows):
        return rows_fused(policy, layer, rows, session)
    p, t = rows.first, k.shape[2]
    b, hkv, _, d = k.shape
    h = q.shape[1]
    g = h // hkv
    dev = k.device
    st.spec[layer] = torch.cat([q[:, :, :1].expand(b, h, p, d), q], 2).view(b, hkv, g, t, d)
    spec_keys = PackedKeys(b, hkv, t, d, group=INT4_GROUP, layout=st.layout, device=dev)
    spec_keys.write(0, _centred_keys(policy, st, layer, k, p))
    out = torch.zeros(b, hkv, t - p, t, dtype=torch.bool, device=dev)
    unread_lse = torch.empty(b, hkv, g, t - p, device=dev) if policy._adds_remainder(st, layer) else None
    for r0 in range(p, t, block):
        r1 = min(t, r0 + block)
        n = r1 - 1  # the block's last row sees the most tokens
        qs = policy.speculation.queries(st, layer, slice(r0, r1))  # [B, Hkv, G, R, c]
        flat = qs.reshape(b, hkv, g * (r1 - r0), d).contiguous()
        scores = policy.speculation.shifted(st, layer, spec_keys.scores(flat, n), flat)
        s = scores.view(b, hkv, g, r1 - r0, n) * model.scale
        lengths = torch.arange(r0, r1, device=dev)
        valid = in_window(model.cfg, torch.arange(n, device=dev) < lengths[:, None], torch.arange(n, device=dev),
                             lengths[:, None])[None, None]  # [1, 1, R, n]: row r sees the r tokens before it
        # each row's cap, [1, R]: `choose` multiplies it by each row's length (float32, as a row's own call)
        caps = row_caps(policy, st, model, layer, p, t)[None, r0 - p:r1 - p]
        keep = policy._choose(s.clone() if unread_lse is not None else s, valid, st.alpha, None, caps.to(dev))
        out[:, :, r0 - p:r1 - p, :n] = keep
        if unread_lse is not None:
            unread_lse[..., r0 - p:r1 - p] = remainder_lse(s, valid & ~keep)
    if unread_lse is not None:
        st.remainders[layer] = unread_lse
    return out


def _centred_keys(policy, st, layer: int, k: torch.Tensor, first: int) -> torch.Tensor:
    """The keys k [B, Hkv, T, d] rotated and, with key_centre, less the mean of the `first` prompt keys: what
    decoding packs (`sequence_rows`), so the blocks score centred keys as decoding does."""
    b, hkv, t, _ = k.shape
    before = (torch.arange(t, device=k.device) < first).expand(b, hkv, t)
    return policy.speculation.centre(st, layer, policy.speculation.rotate(st, k, layer), before)


def row_caps(policy, st, model, layer: int, first: int, t: int) -> torch.Tensor:
    """The layer's cap of each teacher-forced row first..t-1 (row r has r cached tokens), float32 [t - first], as
    `_cap` gives it; every layer's caps at every length are computed once per sequence (`state.row_caps`)."""
    if st.row_caps[0] != (first, t):
        grows = policy.budget_growth != 1 and policy.kv_budget is not None
        st.row_caps = ((first, t), [policy.layer_caps(model, r) for r in range(first, t)] if grows else None, {})
    _, per_length, done = st.row_caps
    if layer not in done:
        caps = [c[layer] for c in per_length] if per_length is not None else [st.caps[layer]] * (t - first)
        done[layer] = torch.tensor(caps, dtype=torch.float32)
    return done[layer]


def rows_fused(policy, layer, rows, session, block: int = ROWS_PER_FUSED_CHOICE) -> SelectedRows:
    """`rows_in_blocks`' selection made by the fused kernel (`fused_select.select_packed_rows`, budget "layer":
    the same cut up to float rounding), `block` rows per call, packed per row for the fused attention
    (`runtime.attend_rows`): SelectedRows with the rows as its batch, keep [R, Hkv, T], rows [R, m] each
    row's entries in the sequence's flat [Hkv * T, d] keys, head-major (padding: head -1), counts [R, Hkv].
    The unread mass per row (the remainder's log-sum-exp) goes to `state.remainders` as `rows_in_blocks` puts it."""
    st, model = session.state, session.model
    q, k = rows.query, rows.keys
    p, t = rows.first, k.shape[2]
    _, hkv, _, d = k.shape
    h = q.shape[1]
    g = h // hkv
    dev = k.device
    st.spec[layer] = torch.cat([q[:, :, :1].expand(1, h, p, d), q], 2).view(1, hkv, g, t, d)
    spec_keys = PackedKeys(1, hkv, t, d, group=INT4_GROUP, layout=st.layout, device=dev)
    spec_keys.write(0, _centred_keys(policy, st, layer, k, p))
    adds = policy._adds_remainder(st, layer)
    lengths = torch.arange(p, t, device=dev)  # row r sees the r tokens before it
    # each row's cap over the layer's KV heads, as `layer_total` makes it (float32), at least min_fetch per KV head
    floors = lengths.clamp(max=max(1, policy.min_fetch)) * hkv
    totals = torch.maximum((row_caps(policy, st, model, layer, p, t) * (lengths * hkv)).floor().long(), floors)
    parts = []
    for r0 in range(p, t, block):
        r1 = min(t, r0 + block)
        n = r1 - 1  # the block's last row sees the most tokens
        qs = policy.speculation.queries(st, layer, slice(r0, r1))  # [1, Hkv, G, R, c]
        flat = qs.reshape(1, hkv, g * (r1 - r0), d).contiguous()
        scores = policy.speculation.shifted(st, layer, spec_keys.scores(flat, n), flat)
        scores = scores.view(hkv, g, r1 - r0, n).permute(2, 0, 1, 3).contiguous()  # [R, Hkv, G, n]
        scores.masked_fill_(torch.arange(n, device=dev) >= lengths[r0 - p:r1 - p, None, None, None],
                            float("-inf"))
        keep, packed, head, counts, lse = fused_select.select_packed_rows(
            scores, totals[r0 - p:r1 - p], model.scale, st.alpha, t, adds)
        # the kernel's rows index a [R * Hkv * t] store: each row's own [Hkv * t] keys are the sequence's
        packed = packed - (torch.arange(r1 - r0, device=dev) * (hkv * t))[:, None]
        parts.append((F.pad(keep, (0, t - n)), packed, head, counts, lse))
    m = max(part[1].shape[1] for part in parts)
    keep = torch.cat([part[0] for part in parts])
    packed = torch.cat([F.pad(part[1], (0, m - part[1].shape[1])) for part in parts])
    head = torch.cat([F.pad(part[2], (0, m - part[2].shape[1]), value=-1) for part in parts])
    counts = torch.cat([part[3] for part in parts])
    if adds:  # [R, Hkv, G] -> [1, Hkv, G, R]
        st.remainders[layer] = torch.cat([part[4] for part in parts]).permute(1, 2, 0)[None]
    return SelectedRows(keep, packed, head, counts)


def fuses_rows(policy, session, rows) -> bool:
    """Whether `rows_fused` makes this teacher-forced selection: budget "layer" slot by slot, one sequence on
    the CPU, no model-wide sliding window, the kernel built."""
    return (policy.budget == "layer" and policy.block <= 1 and rows.keys.device.type == "cpu"
            and rows.keys.shape[0] == 1 and session.model.cfg.sliding_window is None and fused_select.available())


def choose(s: torch.Tensor, valid: torch.Tensor, alpha: float, budget: str, ratio: float, min_fetch: int, block: int,
           shared_length: int | None = None, block_fetch: float | None = None) -> torch.Tensor:
    """Scores s [B, Hkv, G, R, S] (float32) of R rows over S slots, valid [B|1, Hkv|1, R, S] ->
    keep [B, Hkv, R, S]: per query head, the tokens above max - `alpha`, counted per `budget`:

      mean      (paper) every query head of the layer takes its top-n, n the mean of the heads'
                counts, at most the cap; a KV head fetches the union of its query heads' picks
      per_head  the same with n the mean over the KV head's own query heads
      union     a KV head fetches every token any of its query heads selects; above the cap, the
                tokens closest to their head's max
      layer     the union, with the cap pooled over the layer's KV heads (the transfer volume of a
                layer): above it, the entries with the most speculated attention mass (summed over
                the group's query heads) win, so peaked heads give up nothing to flat ones
    With `block` > 1 ("layer" only) the blocks of `block` slots are chosen (`choose_blocks`) and read whole;
    `block_fetch` then chooses blocks holding that many times the cap and keeps, within them, the tokens
    the token rule keeps (qualifying, the most speculated mass up to the cap): what is read is those blocks,
    what is attended those tokens.
    The cap is `ratio` (the layer's cap, `layer_caps`; None: `max_fetch_ratio`) of the cached tokens
    (per KV head; per layer for "layer"), at least `min_fetch` tokens per KV head. `shared_length`: every
    row's count of valid tokens, when the caller knows it is one number (no padding, no window).

    Host synchronizations per call (what a CUDA decoding step pays per speculated layer): "union" and
    "layer" with `shared_length` known: none (caps are host numbers, the cut is a top-k with a host k over
    every row, kept rows restored with `where`); on CPU, "layer" checks once whether any row is over its cap
    (a free check there, and it skips the cut). Otherwise (padding, a window; "mean" and "per_head",
    whose counts are data) 3-4: the rows to cut (nonzero), the largest count (top-k size) and whether
    the counts are all equal. The runtime's packing of the chosen slots adds 2 (`KVStore.select_rows`: nonzero
    and the largest batch row's total, data-dependent sizes)."""
    # both paths call this with the same shapes per row (`sequence_rows`), so float32 is exact enough
    relative = s.float()
    if shared_length is None:  # else every slot is valid
        relative = relative.masked_fill_(~valid[:, :, None], float("-inf"))
    relative -= relative.amax(-1, keepdim=True).clamp(min=torch.finfo(relative.dtype).min)  # to each head's max
    floor = min(max(1, min_fetch), s.shape[-1])  # a floor over the slots reads them all anyway
    # host numbers when every row has `shared_length` tokens; the same float32 arithmetic as on the device
    # [B|1, Hkv|1, R] cached tokens
    length = valid.sum(-1) if shared_length is None else torch.tensor(shared_length).view(1, 1, 1)
    cap = (ratio * length).floor().clamp(min=floor).long()
    if budget in ("union", "layer"):
        # [B, Hkv, R, S]: the max over the group, slice by slice (a strided amax over dim 2 takes 20x
        # longer on a CPU)
        group_max = relative[:, :, 0].clone()
        for g in range(1, relative.shape[2]):
            torch.maximum(group_max, relative[:, :, g], out=group_max)
        keep = group_max > -alpha
        if budget == "union":
            n = int(cap) if shared_length is not None else cap.expand(group_max.shape[:-1])
            return top_n_per_row(keep, group_max, n)
        b, hkv, r, n = keep.shape
        if shared_length is None:
            total = (ratio * length.expand(b, hkv, r).sum(1)).floor().clamp(min=floor * hkv).long()  # [B, R]
        else:
            total = layer_total(ratio, shared_length, hkv, s.shape[-1], min_fetch)
        if block > 1 and block_fetch is None:
            return choose_blocks(relative, keep, valid, total, block)
        if block > 1:  # the token rule within the blocks read
            keep = keep & choose_blocks(relative, keep, valid, scaled(total, block_fetch), block)
        over = keep.sum((1, 3)) > total
        if not keep.is_cuda and not over.any():  # free on a CPU (and skips the cut); on CUDA a synchronization
            return keep
        # speculated attention weights per query head, in place: `relative` is not read again, and a new
        # [B, Hkv, G, R, S] tensor per step costs page faults on a CPU (the same numbers either way)
        p = relative.exp_()
        p /= p.sum(-1, keepdim=True)
        mass = p.sum(2)  # [B, Hkv, R, S]
        flat = lambda x: x.permute(0, 2, 1, 3).reshape(b, r, hkv * n)  # noqa: E731 (KV head, slot) per row
        cut = top_n_per_row(flat(keep), flat(mass.masked_fill_(~keep, -1.0)), total, as_is=~over)
        return cut.view(b, r, hkv, n).permute(0, 2, 1, 3)
    above = relative > -alpha  # [B, Hkv, G, R, S]
    counts = above.sum(-1)  # [B, Hkv, G, R]
    if budget == "mean":  # paper: every head of the layer fetches the mean count
        n = counts.float().mean((1, 2), keepdim=True)
    else:  # per_head: each KV head its own count, the mean over its query heads
        n = counts.float().mean(2, keepdim=True)
    n = torch.minimum(torch.ceil(n - 1e-6).long(), cap[:, :, None].to(n.device)).expand_as(counts)
    # each query head its own top-n tokens: where n equals the head's count that is `above` itself
    return top_n_per_row(above, relative, n, as_is=counts == n).any(2)


def scaled(total, factor: float):
    """A cap (a host number or a tensor per row) times `factor`, rounded down."""
    if isinstance(total, int):
        return int(total * factor)
    return (total.double() * factor).floor().long()


def choose_blocks(relative, keep, valid, total, block: int):
    """budget "layer" in blocks of `block` consecutive slots per KV head: a block qualifies when any of
    its tokens does, the blocks with the most speculated mass win until their tokens reach the cap
    (`total` tokens per row over the layer's KV heads: total // block blocks), and a chosen block is
    read whole (its valid slots). Rows whose qualifying blocks hold at most `total` valid tokens keep them
    all (so an unlimited cap reads everything: partial blocks, padding and the last block included)."""
    b, hkv, r, n = keep.shape
    k = min(block, n)  # a block over the cached slots is all of them
    nb = -(-n // k)
    pad = nb * k - n
    p = relative.exp()
    mass = (p / p.sum(-1, keepdim=True)).sum(2)  # [B, Hkv, R, S]
    if pad:
        keep = torch.nn.functional.pad(keep, (0, pad))
        mass = torch.nn.functional.pad(mass, (0, pad))
    kb = keep.view(b, hkv, r, nb, k).any(-1)
    mb = mass.view(b, hkv, r, nb, k).sum(-1).masked_fill(~kb, -1.0)
    nblocks = max(1, total // k) if isinstance(total, int) else (total // k).clamp(min=1)
    flat = lambda x: x.permute(0, 2, 1, 3).reshape(b, r, hkv * nb)  # noqa: E731
    held = valid.expand(b, hkv, r, n)  # each block's valid tokens
    held = torch.nn.functional.pad(held, (0, pad)) if pad else held
    fits = (kb * held.reshape(b, hkv, r, nb, k).sum(-1)).sum((1, 3)) <= total  # [B, R]
    cut = top_n_per_row(flat(kb), flat(mb), nblocks, as_is=fits).view(b, r, hkv, nb).permute(0, 2, 1, 3)
    out = cut[..., None].expand(b, hkv, r, nb, k).reshape(b, hkv, r, nb * k)[..., :n]
    return out & valid  # a block past the valid tokens (padding, a window) reads only its valid slots


