"""Calibration's loss head over a large vocabulary (`calibrate._nll` from BF16_HEAD_VOCAB tokens on: Gemma 3's
262144): a bfloat16 product with each row's largest logits and its target's recomputed in float32, then the rest of
the log-sum-exp in one C++ call on the bfloat16 logits (`kernels.loss_head`), or torch's path where that is not
built or a softcap applies."""
from __future__ import annotations

import math

import torch

from ..kernels import loss_head

HEAD_EXACT = 64  # per row, its largest logits recomputed in float32 (`head_nll`)


def head_nll(h: torch.Tensor, weight: torch.Tensor, low: torch.Tensor, targets: torch.Tensor,
             cap: float | None = None, exact: int = HEAD_EXACT, buffers: dict | None = None) -> torch.Tensor:
    """Per row of `h` [n, d], the NLL of its target under the logits h @ weight.T (tanh-capped at `cap`), the
    logits computed as a bfloat16 product (`low`: the weight in bfloat16, 2.8x faster than float32 on CPU)
    except each row's `exact` largest and its target's, recomputed in float32: those carry the loss (the
    target's logit) and the bulk of the log-sum-exp, so what the bfloat16 rounding leaves is its error on the
    tail's small share of the mass. Without a softcap, where it is built, the rest is one C++ call on the bfloat16
    logits (`kernels.loss_head.row_nll`: the same largest logits, the loss within float32 summation order; a row
    holding an infinite or NaN logit goes the torch way); else torch: the logits copied to float32, the largest
    ranked on the bfloat16 ones, the log-sum-exp with torch.logsumexp's arithmetic in place. `buffers` (a dict,
    filled on first use): the logits' storage, kept for the next call."""
    n, vocab = h.shape[0], low.shape[0]
    if buffers is None:
        buffers = {}
    if buffers.get("low") is None or buffers["low"].shape[0] < n or buffers["low"].shape[1] != vocab:
        buffers.update(low=torch.empty(n, vocab, dtype=low.dtype, device=low.device), logits=None)
    low_logits = buffers["low"][:n]
    torch.mm(h.to(low.dtype), low.T, out=low_logits)
    k = min(exact, vocab)
    if not loss_head.usable(low_logits, cap):
        return _head_nll_torch(h, weight, low_logits, targets, cap, k, buffers)
    nll, _, finite = loss_head.row_nll(low_logits, h.float(), weight.float(), targets, k)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[:, 0]
        nll[bad] = _head_nll_torch(h[bad], weight, low_logits[bad], targets[bad], cap, k, {})
    return nll


def _head_nll_torch(h, weight, low_logits, targets, cap, k: int, buffers: dict) -> torch.Tensor:
    """`head_nll`'s torch path from the bfloat16 logits [n, vocab]; `buffers["logits"]`: the float32 copy's
    storage, made here where it is missing or too small."""
    n, vocab = low_logits.shape
    held = buffers.get("logits")
    if held is None or held.shape[0] < n or held.shape[1] != vocab:
        held = buffers["logits"] = torch.empty(n, vocab, device=low_logits.device)
    logits = held[:n]
    logits.copy_(low_logits)
    # the largest logits as bfloat16 (the same values as their float32 copies, half the bytes to read)
    idx = torch.cat([low_logits.topk(k, dim=-1).indices, targets[:, None]], 1)
    logits.scatter_(1, idx, torch.einsum("nd,nkd->nk", h.float(), weight[idx].float()))
    if cap is not None:
        logits.div_(cap).tanh_().mul_(cap)
    target = logits.gather(1, targets[:, None])[:, 0]
    top = logits.amax(-1, keepdim=True)
    top.masked_fill_(top.abs() == math.inf, 0)
    return logits.sub_(top).exp_().sum(-1).log_().add_(top[:, 0]) - target
