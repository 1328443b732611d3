"""InfiniGen's re-rank (knob `rerank`): a layer's cut made at `rerank` times its cap (`widened`), then cut again to
the plain cut's count by the exact keys of its candidates and the layer's own query (`rerank_cut`; one C++ call
where kernels/rerank is built). `infinigen_select.select_row` and `sequence_rows` apply it where `reranks` says.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..kernels import rerank
from . import cuts as select


def reranks(policy, st, layer: int, decoding_row: int | None = None) -> bool:
    """Whether `layer`'s cut is re-ranked by the exact keys (`rerank`): the layer selects with its own query (layer
    0 always: its exact query, known at the embedding). `decoding_row`: a decoding step's row, re-ranked only where
    its query is the own one now (row 0 of the step, a layer > 0 at its attention), not in a plan made a layer
    ahead with the speculated query (offloaded, corrected: the attention re-ranks the own selection)."""
    if policy.rerank is None or not (layer == 0 or st.own_query):
        return False
    return decoding_row is None or (decoding_row == 0 and (layer == 0 or (layer not in st.spec
                                                                          and layer in st.spec_rows)))


@contextmanager
def widened(st, factor: float):
    """The layer caps asked for inside times `factor` (`st.widen`; 1: as they are)."""
    before, st.widen = st.widen, st.widen * factor
    try:
        yield
    finally:
        st.widen = before


def rerank_rows(policy, cand, s, valid, shared_length, cap, q, k, scale):
    """`rerank_cut` of a mask-made cut (`choose`'s, decoding row or teacher-forced row): the candidates cand
    [B, Hkv, 1, S] (the cut at `rerank` times the cap), s [B, Hkv, G, 1, S] the scaled 4-bit scores, valid
    [B|1, Hkv|1, 1, S], the plain cap `cap`. Returns the keep [B, Hkv, 1, S], the unread log-mass [B, Hkv, G, 1]
    and the candidates' keys not kept [B, Hkv, 1]."""
    b, hkv, _, n = cand.shape
    total = select.cut_total(policy.max_fetch_ratio if cap is None else cap, valid, shared_length, policy.min_fetch,
                             (b, hkv, 1, n))
    size = cand.sum((1, 3)).clamp(max=total).view(b)
    unread = select.remainder_lse(s, valid & ~cand)[..., 0]
    keep, _, _, _, lse, beside = rerank_cut(cand[:, :, 0], q, k, scale, size, unread, n)
    return keep[:, :, None], lse[..., None], beside[..., None]


def rerank_cut(cand, q, k, scale: float, size, unread, capacity: int):
    """The candidates cand [B, Hkv, n] (the cut at `rerank` times the layer's cap) re-ranked by the exact keys:
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
    kept = select.top_n_per_row(real, mass, size) & real
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
