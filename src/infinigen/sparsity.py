"""How concentrated attention is: the share of a row's entries that holds most of its mass. Calibration
(`infinigen.skew`) records it per layer; the per-layer budgets (`policies.budgets`) share the all-layer
bound by it."""
from __future__ import annotations

import torch


def attention_sparsity(probs: torch.Tensor, mass: float = 0.9) -> torch.Tensor:
    """Share of the entries holding `mass` of the attention, per row: probs [..., S] (rows sum to 1 over
    their valid entries; masked entries 0) -> [...], the smallest k/n with the top-k entries reaching
    `mass`, n the row's count of entries with nonzero weight (at least 1)."""
    p = probs.float()
    top = p.sort(-1, descending=True).values.cumsum(-1)
    k = (top < mass * top[..., -1:]).sum(-1) + 1  # entries before the cumulative mass reaches `mass`, plus it
    n = (p > 0).sum(-1).clamp(min=1)
    return (k.clamp(max=n).float() / n.float())
