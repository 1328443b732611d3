"""Calibration's bound on what a candidate reads, checked on its caps (policies/calibrate.py says why): the share
of the entries the caps allow over a run, and the largest all-layer budget whose caps stay under the bound."""
from __future__ import annotations

import math

LONG = 4  # the bound is also checked at LONG * ref tokens
POSITIONS = 256  # cached lengths sampled to average the caps over a run


def counted_layers(model) -> list[int]:
    """The layers the bound is over: those a policy may read sparsely (not a model's local window layers)."""
    return [i for i in range(model.cfg.num_layers) if not model.cfg.local(i)]


def caps_share(policy, model, ctx: int, prefill: int, samples: int = POSITIONS) -> float:
    """The share of the entries the policy's caps allow, over `counted_layers`, averaged over the decoding
    rows of a run of `ctx` tokens with a `prefill`-token prompt (about `samples` rows, evenly spaced): what a
    selection reads at most (dense layers 100%, a cap at least `min_fetch` tokens per KV head)."""
    layers = counted_layers(model)
    step = max(1, (ctx - prefill) // samples)
    ns = range(prefill + step // 2, ctx, step)  # row r has r cached tokens
    hkv = model.cfg.num_kv_heads
    pooled = policy.budget == "layer"  # the cap is over the layer's KV heads together (`infinigen_select.choose`)
    floor = max(1, policy.min_fetch)
    total = 0.0
    for n in ns:
        caps = policy.layer_caps(model, n)
        for i in layers:
            if i in caps:
                if pooled:
                    tokens = max(math.floor(caps[i] * n * hkv), floor * hkv) / hkv
                else:
                    tokens = max(math.floor(caps[i] * n), floor)
                total += min(1.0, tokens / n)
            else:
                total += 1.0
    return total / (len(ns) * len(layers))


def largest_budget(make, model, ref: int, bound: float, growth: float, lo: float = 1e-3) -> float | None:
    """The largest kv_budget whose caps (policy `make(kv_budget)`) stay within the bound over a run of `ref`
    tokens and, scaled by the growth, of LONG * ref tokens (prompts 1/8 of the run). None: even the smallest
    budget exceeds it (the layers read densely alone do)."""
    long_bound = bound * (1 / LONG) ** (1 - growth)

    def fits(b):
        try:
            pol = make(b)
        except Exception:  # the dense layers alone exceed this budget
            return False
        return (caps_share(pol, model, ref, ref // 8) <= bound + 1e-9
                and caps_share(pol, model, LONG * ref, LONG * ref // 8, POSITIONS // 2) <= long_bound + 1e-9)

    if fits(1.0):
        return 1.0
    if not fits(lo):
        return None
    a, b = lo, 1.0
    for _ in range(14):  # to ~1e-4 of the budget
        mid = (a + b) / 2
        a, b = (mid, b) if fits(mid) else (a, mid)
    return a
