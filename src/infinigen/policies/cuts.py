"""The cuts InfiniGen's selection rules share: the top-n of each row (`top_n_per_row`), the layer's cap in (KV head,
slot) pairs (`layer_total`, `layer_totals`) and the log-mass a selection leaves unread
(`remainder_lse`). Used by `infinigen_select` (the rules) and `infinigen_rerank`.
"""
from __future__ import annotations

import math

import numpy as np
import torch


def remainder_lse(s: torch.Tensor, unread: torch.Tensor) -> torch.Tensor:
    """Scaled speculated scores s [B, Hkv, G, R, S] and the unread entries [B, Hkv, R, S] -> the log of
    their attention mass [B, Hkv, G, R] (-inf where none is unread)."""
    return torch.logsumexp(s.masked_fill(~unread[:, :, None], float("-inf")), -1)


def _kth_largest(score: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest value of each row (last dim) of `score`, [..., 1]: the cut's threshold. On a CPU,
    numpy's introselect (a partition, no sort) is 10x faster than torch's top-k, which sorts partially:
    0.6 against 5.6 ms for 8 rows of 3 x 8192 entries at k = 14%, one thread. Both give the same value."""
    if score.device.type == "cpu":
        a = score.contiguous().numpy()
        n = a.shape[-1]
        return torch.from_numpy(np.partition(a, n - k, axis=-1)[..., n - k:n - k + 1])
    return score.topk(k, dim=-1, sorted=False).values.amin(-1, keepdim=True)


def _cut_in_one_pass(score: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The k-th largest value of each row, [..., 1], and, on a CPU, `score >= it` when that is exactly the
    top k of every row: the (k+1)-th largest is smaller (no tie at the threshold left out) and the threshold
    is above -inf. Then the cut is this one pass instead of the tie-breaking cumulative sum; None otherwise
    (or on CUDA, where the check would synchronize). One introselect finds both values."""
    if score.device.type != "cpu":
        return _kth_largest(score, k), None
    a = score.contiguous().numpy()
    n = a.shape[-1]
    part = np.partition(a, [n - k - 1, n - k] if k < n else n - k, axis=-1)
    thr = torch.from_numpy(part[..., n - k:n - k + 1])
    if not bool((thr > float("-inf")).all()):
        return thr, None
    if k < n and not bool((torch.from_numpy(part[..., n - k - 1:n - k]) < thr).all()):
        return thr, None
    return thr, score >= thr


def layer_total(ratio: float, shared_length: int, hkv: int, slots: int, min_fetch: int) -> int:
    """budget "layer"'s cap of a row that has `shared_length` valid tokens per KV head: the (KV head, slot)
    pairs it may read over the layer's `hkv` KV heads, at least `min_fetch` per KV head (`slots` slots)."""
    floor = min(max(1, min_fetch), slots)
    # on the host, in float32 arithmetic as `choose` computes it on a tensor where the lengths are data: the ratio
    # and the count rounded to float32, their product (exact in float64) rounded once to float32
    product = np.float32(np.float32(ratio) * np.float32(shared_length * hkv))
    return max(math.floor(product), floor * hkv)


def layer_totals(ratios: list, shared_length: int, hkv: int, slots: int, min_fetch: int) -> list[int]:
    """`layer_total` of each of `ratios` at one length (the same float32 arithmetic, one numpy call for all)."""
    floor = min(max(1, min_fetch), slots)
    products = np.asarray(ratios, dtype=np.float32) * np.float32(shared_length * hkv)
    return [max(t, floor * hkv) for t in np.floor(products).astype(np.int64).tolist()]


def top_n_per_row(keep: torch.Tensor, score: torch.Tensor, n: torch.Tensor,
                   as_is: torch.Tensor | None = None) -> torch.Tensor:
    """Per row (last dim), exactly the top-n entries of `score` (ties: lower slot first) where `keep`
    holds more, or fewer, than n; rows in `as_is` (or with at most n kept, when `as_is` is None)
    keep `keep`. n: a tensor per row, or one host number for every row (then no synchronization: every
    row is cut, a top-k with an unsorted k, and the rows kept as they are put back)."""
    if as_is is None:
        as_is = keep.sum(-1) <= n  # nothing to cut
    if isinstance(n, int):
        k = min(n, score.shape[-1])
        if k == 0:
            return keep & as_is[..., None]
        thr, take = _cut_in_one_pass(score, k)
        if take is None:  # more ties at the threshold than places left: the lower slots first
            above = score > thr
            tie = (score == thr) & (score > float("-inf"))
            take = above | (tie & (tie.cumsum(-1) <= (n - above.sum(-1, keepdim=True))))
        if not score.is_cuda and not bool(as_is.any()):  # every row is cut (a free check on a CPU)
            return take
        return torch.where(as_is[..., None], keep, take)
    todo = (~as_is).nonzero(as_tuple=True)
    if todo[0].numel() == 0:
        return keep
    row_scores, row_n = score[todo], n[todo]  # [N, S], [N]
    kmax = min(int(row_n.max()), row_scores.shape[-1])
    if bool((row_n >= kmax).all()):  # one n for every row (the common case): no need to sort the top
        thr = _kth_largest(row_scores, kmax)
    else:
        thr = row_scores.topk(kmax, dim=-1, sorted=True).values.gather(-1, (row_n.clamp(1, kmax) - 1)[:, None])
    above = row_scores > thr
    tie = (row_scores == thr) & (row_scores > float("-inf"))
    take = above | (tie & (tie.cumsum(-1) <= (row_n[:, None] - above.sum(-1, keepdim=True))))
    keep = keep.clone()
    keep[todo] = take
    return keep
