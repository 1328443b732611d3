"""Per-layer budgets (infinigen.policies.budgets): one all-layer bound, shared by calibrated sparsity."""
from __future__ import annotations

import math

import pytest
import torch

from infinigen.errors import UserError
from infinigen.policies.budgets import attention_sparsity, layer_caps, water_fill


@pytest.mark.parametrize("layers,dense", [(4, ()), (4, (0,)), (30, ()), (30, (0,)), (30, (0, 1)), (24, (0, 1, 2))])
@pytest.mark.parametrize("budget", [0.1, 0.2, 0.5])
@pytest.mark.parametrize("power", [0.0, 0.5, 1.0])
def test_caps_sum_to_the_global_budget(layers, dense, budget, power):
    """Dense layers count 100%: caps of the selecting layers + dense == budget * layers, each in (0, 1]."""
    g = torch.Generator().manual_seed(layers)
    sparsity = (torch.rand(layers, generator=g) ** 3 * 0.6 + 0.01).tolist()  # peaked and flat layers
    sel = [i for i in range(layers) if i not in dense]
    if budget * layers <= len(dense):
        with pytest.raises(UserError, match="dense"):
            layer_caps(layers, sel, budget, sparsity, power)
        return
    caps = layer_caps(layers, sel, budget, sparsity, power)
    assert sorted(caps) == sel
    assert sum(caps.values()) + len(dense) == pytest.approx(budget * layers, rel=1e-9)
    assert all(0 < c <= 1 + 1e-12 for c in caps.values())


def test_flat_layers_get_more():
    sparsity = [0.5, 0.02, 0.1, 0.1, 0.3, 0.05]
    caps = layer_caps(6, range(6), 0.2, sparsity, 1.0)
    order = sorted(range(6), key=lambda i: sparsity[i])
    assert [caps[i] for i in order] == sorted(caps.values())  # monotone in the sparsity
    assert caps[1] < 0.2 < caps[0]
    half = layer_caps(6, range(6), 0.2, sparsity, 0.5)  # power 0.5: between uniform and proportional
    assert caps[1] < half[1] < 0.2 < half[0] < caps[0]
    assert layer_caps(6, range(6), 0.2, sparsity, 0.0) == pytest.approx({i: 0.2 for i in range(6)})
    assert layer_caps(6, range(6), 0.2, None, 1.0) == pytest.approx({i: 0.2 for i in range(6)})


def test_water_fill_caps_at_one_and_keeps_the_total():
    out = water_fill([10.0, 1.0, 1.0, 0.5], 2.5)
    assert out[0] == 1.0 and sum(out) == pytest.approx(2.5)
    assert out[1] == pytest.approx(out[2]) and out[3] == pytest.approx(out[1] / 2)
    assert water_fill([1.0, 1.0], 2.0) == [1.0, 1.0]
    with pytest.raises(ValueError):
        water_fill([1.0, 1.0], 2.5)


def test_bad_budgets():
    for b in (0.0, -0.1, 1.5, math.nan):
        with pytest.raises(UserError):
            layer_caps(4, [1, 2, 3], b)
    with pytest.raises(UserError, match="sparsity"):
        layer_caps(4, [1, 2, 3], 0.5, [0.1, 0.2], 1.0)
    with pytest.raises(UserError, match="dense"):
        layer_caps(30, range(2, 30), 0.05)  # 2 dense layers of 30 already read 6.7%


def test_attention_sparsity():
    """Share of the entries holding 90% of the mass; masked (zero) entries do not count."""
    flat = torch.full((10,), 0.1)
    assert attention_sparsity(flat).item() == pytest.approx(0.9)
    peaked = torch.tensor([0.95, 0.05, 0.0, 0.0])
    assert attention_sparsity(peaked).item() == pytest.approx(0.5)  # one of the 2 valid entries
    two = torch.tensor([0.5, 0.45, 0.05, 0.0, 0.0])
    assert attention_sparsity(two).item() == pytest.approx(2 / 3)
    rows = torch.softmax(torch.randn(3, 4, 50), -1)
    s = attention_sparsity(rows)
    assert s.shape == (3, 4) and bool(((s > 0) & (s <= 1)).all())
