"""Column sums of causal attention without the attention matrix (H2O's prefill scoring).

H2O starts every KV entry with the attention it received from the prompt: for key column j, the sum over
causal query rows i >= j (and the group's query heads) of softmax_i(q_i . k / sqrt d)[j]. Materializing
the probabilities costs [B, H, t, t] floats. Here each (sequence, KV head) is processed in row blocks:
one block's scores [G, rows, <= end] are computed once (a batched matmul with the causal and padding
mask folded in as an additive bias), normalized by their row's logsumexp, and reduced over rows and heads
with a matrix-vector product that also drops padding rows. Only the causal triangle is computed, and a
block is small enough to stay in cache, so the whole pass costs about one causal prefill attention
(one Q.K^T where attention does Q.K^T and P.V).
"""
from __future__ import annotations

import torch

BLOCK_BYTES = 4 << 20  # score bytes per block: a few MiB keeps the elementwise passes in L2/L3


def attention_column_sums(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, scale: float,
                          rows: int | None = None) -> torch.Tensor:
    """q [B, H, t, d], k [B, Hkv, t, d] (H a multiple of Hkv), valid [B, t] (False: padding).

    Returns [B, Hkv, t] float32: per key column, the causal softmax probabilities it gets, summed over
    the valid query rows and the Hkv group's query heads. Padding columns get 0; padding rows add 0.
    `rows`: query rows per block (default: about BLOCK_BYTES of scores).
    """
    b, h, t, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    if rows is None:
        rows = max(16, BLOCK_BYTES // (4 * g * max(t, 1)))
    out = torch.zeros(b, hkv, t, dtype=torch.float32, device=q.device)
    neg = torch.tensor(float("-inf"), device=q.device)
    zero = torch.zeros((), device=q.device)
    ar = torch.arange(t, device=q.device)
    for bi in range(b):
        key_bias = torch.where(valid[bi], zero, neg)  # [t]: padding keys get no probability
        row_w = valid[bi].float()  # padding rows contribute nothing
        for s in range(0, t, rows):
            e = min(t, s + rows)
            # [rows, e]: causal (column <= row) and padding mask as an additive bias
            bias = torch.where(ar[None, :e] <= ar[s:e, None], key_bias[None, :e], neg)
            w = row_w[s:e].repeat(g)  # [g*rows] in (head, row) order
            for hi in range(hkv):
                qb = q[bi, hi * g:(hi + 1) * g, s:e].float()  # [g, rows, d]
                kb = k[bi, hi, :e].float()  # [e, d]
                sc = torch.baddbmm(bias, qb, kb.T.expand(g, d, e), alpha=scale)  # [g, rows, e]
                lse = torch.logsumexp(sc, dim=-1, keepdim=True).nan_to_num_(neginf=0.0)  # all-masked rows: p = 0
                sc.sub_(lse).exp_()
                out[bi, hi, :e] += w @ sc.view(g * (e - s), e)
    return out

