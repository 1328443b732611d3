"""InfiniGen's re-rank (knob `rerank`): a layer's cut, plus `rerank` times its count of the pairs with the most 4-bit
mass, as candidates (`candidates`), cut again to the plain cut's count by the exact keys of the candidates and the
layer's own query (`rerank_cut`; one C++ call where kernels/rerank is built). `infinigen_select.select_row` and
`sequence_rows` apply it where `reranks` says.
"""
from __future__ import annotations

import torch

from ..kernels import fused_select, rerank
from . import cuts

NO_THRESHOLD = 1e30  # an alpha no score falls below: the candidates are cut by mass alone


def reranks(policy, st, layer: int, decoding_row: int | None = None) -> bool:
    """Whether `layer`'s cut is re-ranked by the exact keys (`rerank`): the layer selects with its own query (layer
    0 always: its exact query, known at the embedding). `decoding_row`: a decoding step's row, re-ranked only where
    its query is the own one now (row 0 of the step, a layer > 0 at its attention), not in a plan made a layer
    ahead with the speculated query (offloaded, corrected: the attention re-ranks the own selection)."""
    if policy.rerank is None or not (layer == 0 or st.own_query):
        return False
    return decoding_row is None or (decoding_row == 0 and (layer == 0 or (layer not in st.spec
                                                                          and layer in st.spec_rows)))


def candidates(policy, keep, size, scores, scale: float, valid=None) -> tuple:
    """A re-rank's candidates: the plain cut keep [B, Hkv, n] and, per batch row, the ceil(rerank * size) (KV head,
    slot) pairs (size [B]: the cut's count) with the most 4-bit attention mass, the threshold not applied (an entry
    just below it is one), from the unscaled scores [B, Hkv, G, n] (left as they are); valid [B, Hkv, n], None where
    every slot is. Returns the candidates [B, Hkv, n] and the scaled scores' log-mass outside those pairs [B, Hkv,
    G]. Mass as the cut's: each query head's softmax over the valid slots, summed over the group; the fused kernel
    where every slot is valid and it is built (decoding and teacher-forced rows alike), else these torch calls."""
    total = (size.double() * policy.rerank).ceil().long()
    if valid is None and scores.is_cpu and fused_select.available():
        mine = scores.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # the cut overwrites it
        top, _, _, _, unread = fused_select.select_packed_rows(mine, total, scale, NO_THRESHOLD, scores.shape[-1], True)
        return top | keep, unread
    b, hkv, g, n = scores.shape
    s = scores.float() * scale
    ok = torch.ones(b, hkv, n, dtype=torch.bool, device=s.device) if valid is None else valid.expand(b, hkv, n)
    lse = s.masked_fill(~ok[:, :, None], float("-inf")).logsumexp(-1, keepdim=True)
    mass = (s - lse).exp().sum(2).masked_fill(~ok, -1.0)
    top = cuts.top_n_per_row(ok.reshape(b, hkv * n), mass.reshape(b, hkv * n), total).view(b, hkv, n)
    return top | keep, cuts.remainder_lse(s[:, :, :, None], (ok & ~top)[:, :, None])[..., 0]


def rerank_rows(policy, keep, scores, valid, q, k, scale: float) -> tuple:
    """`rerank_cut` of a mask-made cut (`choose`'s, a decoding or a teacher-forced row): keep [B, Hkv, 1, S] the
    plain cut, scores [B, Hkv, G, 1, S] its unscaled 4-bit scores, valid [B, Hkv, S] (None: every slot), q the own
    query [B, Hkv, G, d], k the keys. Returns the keep [B, Hkv, 1, S], the unread log-mass [B, Hkv, G, 1] and the
    candidates' keys not kept [B, Hkv, 1]."""
    plain = keep[:, :, 0]
    size = plain.sum((1, 2))
    cand, unread = candidates(policy, plain, size, scores[:, :, :, 0], scale, valid)
    keep, _, _, _, lse, beside = rerank_cut(cand, q, k, scale, size, unread, plain.shape[-1])
    return keep[:, :, None], lse[..., None], beside[..., None]


def rerank_packed(policy, keep, counts, scores, q, k, scale: float, capacity: int) -> tuple:
    """`rerank_cut` of decoding's fused cut (keep [B, Hkv, n], counts [B, Hkv]; scores [B, Hkv, G, n] unscaled,
    every slot valid): what `rerank_cut` returns, rows packed for a store of `capacity` slots."""
    size = counts.sum(-1)
    cand, unread = candidates(policy, keep, size, scores, scale)
    return rerank_cut(cand, q, k, scale, size, unread, capacity)


def rerank_cut(cand, q, k, scale: float, size, unread, capacity: int):
    """The candidates cand [B, Hkv, n] (`candidates`) re-ranked by the exact keys:
    per batch row the `size` [B] of them (the plain cut's count) with the most attention mass under the own
    query q [B, Hkv, G, d] on the keys k [B, Hkv, >= n, d]; a query head's mass is its probability over the
    candidates (exact scores) and the rest (unread [B, Hkv, G]: the 4-bit log-mass of the non-candidates),
    summed over the group; ties to the lower (KV head, slot). Only the candidates' keys are read. Returns
    `kernels.rerank.rerank_rows`'s keep, packed rows (of a flat store of `capacity` slots per (batch row, KV
    head)), heads, counts, the unread log-mass with the dropped candidates' exact scores added, and the dropped
    candidates per (batch row, KV head) (their keys were read to choose); the C++ call where it is built, else
    these torch calls (its reference)."""
    if rerank.usable(q, k):
        return rerank.rerank_rows(cand, q, k, unread, size, scale, capacity)
    b, hkv, n = cand.shape
    g = q.shape[2]
    flat = cand.reshape(b, hkv * n)
    count = flat.sum(-1)
    m = int(count.max())
    pos = torch.argsort((~flat).to(torch.uint8), dim=-1, stable=True)[:, :m]  # the candidates first, in order
    real = torch.arange(m, device=cand.device) < count[:, None]
    head = torch.div(pos, n, rounding_mode="floor")
    at = torch.arange(b, device=cand.device)[:, None]
    exact = (q[at, head].float() @ k[at, head, pos - head * n].float()[..., None]).squeeze(-1) * scale  # [B, m, G]
    exact = exact.masked_fill(~real[..., None], float("-inf"))
    per_head = (head[:, None] == torch.arange(hkv, device=cand.device)[:, None]) & real[:, None]  # [B, Hkv, m]
    by_head = exact[:, None].masked_fill(~per_head[..., None], float("-inf"))  # [B, Hkv, m, G]
    denominator = torch.logaddexp(by_head.logsumexp(2), unread).gather(1, head[..., None].expand(b, m, g))
    mass = (exact - denominator).exp().sum(-1).masked_fill(~real, -1.0)
    kept = cuts.top_n_per_row(real, mass, size) & real
    dropped = per_head & ~kept[:, None]
    keep = torch.zeros_like(flat).scatter_(1, pos, kept).view(b, hkv, n)
    unread = torch.logaddexp(unread, by_head.masked_fill(~dropped[..., None], float("-inf")).logsumexp(2))
    rows, head = kept_rows((at * hkv + head) * capacity + pos - head * n, head.masked_fill(~real, -1), kept)
    return keep, rows, head, keep.sum(-1), unread, dropped.sum(-1)


def kept_rows(rows: torch.Tensor, head: torch.Tensor, kept: torch.Tensor) -> tuple:
    """Packed rows [B, m] and their KV heads [B, m] (-1: padding) less those `kept` [B, m] drops, in order,
    padded (row 0, head -1) to the longest batch row's count."""
    order = torch.argsort((~kept).to(torch.uint8), dim=-1, stable=True)[:, :int(kept.sum(-1).max())]
    still = kept.gather(1, order)
    return rows.gather(1, order).masked_fill(~still, 0), head.gather(1, order).masked_fill(~still, -1)
