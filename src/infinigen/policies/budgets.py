"""Per-layer fetch budgets from one all-layer bound.

The bound the user states is over all layers: `kv_budget` is the share of the cached entries that
attention may read, averaged over every layer, dense layers counting 100%. The per-layer caps are
derived from it, never the reverse, so the bound holds whatever the number of layers and of dense
layers: the selecting layers share `kv_budget * L - dense` layer-equivalents.

How they share it comes from calibration (`infinigen.skew` records it): a layer's attention
sparsity is the share of the entries that holds 90% of its attention mass. A flat layer (high share)
needs more entries than a peaked one to keep the same mass, so its cap is larger. `power` blends:
0 gives every selecting layer the same cap, 1 makes caps proportional to the sparsity. Caps never
exceed 1 (a layer cannot read more than everything); what a capped layer cannot take goes to the
others (water-filling), so the total is kept exactly while there is room for it.
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from ..sparsity import attention_sparsity  # noqa: F401 (re-exported: what calibration records)


def water_fill(weights: list[float], total: float, hi: float = 1.0) -> list[float]:
    """Shares proportional to `weights` (non-negative, not all zero) summing to `total`, none above `hi`:
    a share that would exceed `hi` is set to `hi` and the rest is spread over the others by weight.
    Needs total <= hi * len(weights)."""
    n = len(weights)
    if n == 0:
        return []
    if total > hi * n + 1e-9:
        raise ValueError(f"total {total} exceeds {n} shares of at most {hi}")
    w = [max(0.0, float(x)) for x in weights]
    if sum(w) <= 0:
        w = [1.0] * n
    out = [0.0] * n
    free = list(range(n))
    left = total
    while free:
        sw = sum(w[i] for i in free)
        if sw <= 0:  # zero-weight layers take the remainder evenly
            for i in free:
                out[i] = left / len(free)
            break
        over = [i for i in free if left * w[i] / sw > hi]
        if not over:
            for i in free:
                out[i] = left * w[i] / sw
            break
        for i in over:
            out[i] = hi
            left -= hi
        free = [i for i in free if i not in over]
    return out


def layer_caps(num_layers: int, selecting: list[int] | set[int], kv_budget: float,
               sparsity: list[float] | torch.Tensor | None = None, power: float = 1.0) -> dict[int, float]:
    """Cap (share of the cached entries read) per selecting layer such that, with every other layer
    read in full, the mean over all `num_layers` layers is `kv_budget`:
    sum(caps) + (num_layers - len(selecting)) == kv_budget * num_layers.
    `sparsity` [num_layers] (calibration; None: the same cap everywhere) weighs the layers by
    sparsity ** power. A UserError when the dense layers alone read more than the budget."""
    sel = sorted(set(selecting))
    if not 0 < kv_budget <= 1:
        raise UserError(f"kv budget must be in (0, 1], got {kv_budget}")
    if not sel:
        return {}
    dense = num_layers - len(sel)
    total = kv_budget * num_layers - dense
    if total <= 0:
        raise UserError(f"the {dense} dense layer(s) of {num_layers} alone read {100 * dense / num_layers:.1f}% of "
                        f"the KV, over the kv budget of {100 * kv_budget:.1f}%: keep fewer layers dense")
    if sparsity is None or power == 0:
        w = [1.0] * len(sel)
    else:
        s = [float(x) for x in sparsity]
        if len(s) != num_layers or not all(math.isfinite(x) and x >= 0 for x in s):
            raise UserError(f"layer sparsity must be {num_layers} non-negative numbers, got {len(s)}")
        w = [s[i] ** power for i in sel]
    return dict(zip(sel, water_fill(w, total)))
