"""Per-layer budgets (infinigen.policies.budgets): one all-layer bound, shared by calibrated sparsity."""
from __future__ import annotations

import math

import pytest
import torch

from infinigen import runtime
from infinigen.errors import UserError
from infinigen.policies.budgets import attention_sparsity, layer_caps, water_fill
from support.speculation import prefill_then_decode, random_skew, random_tokens, record_selections


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


# ---- the InfiniGen policy: one all-layer bound ----------------------------------------------------------
def _skew_with_sparsity(model, sparsity):
    from infinigen.skew import Skew
    c = model.cfg
    g = torch.Generator().manual_seed(3)
    mats = torch.linalg.qr(torch.randn(c.num_layers, c.num_kv_heads, c.head_dim, c.head_dim, generator=g,
                                       dtype=torch.float64))[0].float()
    e = torch.ones(c.num_layers, c.num_kv_heads, c.head_dim)
    return Skew(mats, e, e, sparsity=torch.tensor(sparsity, dtype=torch.float32))


def _run(model, pol, t=256, p=176, b=1):
    from infinigen.placement import Placement
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.cfg.vocab_size, (b, t), generator=g)
    sess = Placement().new_session(model, b, t, pol)
    runtime.teacher_forced(model, tokens, p, sess)
    return sess


@pytest.mark.parametrize("layers", [4, 30])
@pytest.mark.parametrize("power", [0.0, 1.0])
def test_budget_preset_bound_holds_on_any_depth(make_tiny, layers, power):
    """The budget preset's all-layer bound (kv_budget, dense layers counting 100%) holds on a tiny model
    with 4 layers and with 30: every entry of every layer qualifies (alpha huge), so the caps bind. The
    context (176 cached tokens and more) is where min_fetch (32 tokens) is below 20%; caps spread by
    sparsity go lower, where min_fetch would lift them (it is off for those)."""
    from infinigen.policies import make_policy
    _, model = make_tiny("llama", num_hidden_layers=layers)
    sparsity = [0.5] + [0.02 + 0.3 * (i % 3) for i in range(1, layers)]  # flat and peaked layers
    knobs = dict(budget_power=power, min_fetch=0) if power else {}
    knobs.update(kv_budget=0.2, budget_growth=1.0)  # the flat bound (the preset's own grows with the length)
    pol = make_policy("infinigen", preset="budget", alpha=1e9, **knobs).with_skew(_skew_with_sparsity(model, sparsity))
    assert pol.kv_budget == 0.2 and pol.exact_first and pol.dense_layers == ()
    sess = _run(model, pol)
    per = sess.stats.per_layer()
    caps = pol.layer_caps(model)
    assert sorted(caps) == list(range(layers)) and sum(caps.values()) == pytest.approx(0.2 * layers)
    assert sess.stats.overall() <= 0.2 + 1e-9
    assert sess.stats.overall() >= 0.2 - 0.01  # and it is spent
    assert all(f <= caps[i] + 1e-9 for i, f in enumerate(per))
    if power:
        assert caps[0] > caps[1]  # layer 0 is the flattest: it gets more


@pytest.mark.parametrize("dense", [(0,), (0, 1)])
def test_bound_holds_with_dense_layers(make_tiny, dense):
    """Dense layers the caller keeps count 100%: the other layers' caps shrink so that the total holds
    (min_fetch off: 32 tokens are over their 14% of these short contexts)."""
    from infinigen.policies import make_policy
    _, model = make_tiny("llama", num_hidden_layers=30)
    pol = make_policy("infinigen", preset="budget", alpha=1e9, dense_layers=dense, min_fetch=0,
                      kv_budget=0.2, budget_growth=1.0).with_skew(random_skew(model, seed=0))
    sess = _run(model, pol)
    per = sess.stats.per_layer()
    assert all(per[i] == pytest.approx(1.0) for i in dense)
    assert sess.stats.overall() <= 0.2 + 1e-9
    cap = (0.2 * 30 - len(dense)) / (30 - len(dense))
    assert max(per[i] for i in range(30) if i not in dense) <= cap + 1e-9


@pytest.mark.parametrize("key_mode", ["int4", "partial"])
def test_exact_first_selects_layer_zero_with_its_own_query(make_tiny, key_mode):
    """exact_first: layer 0 reads its cap (no prefetch plan: it is not `known_ahead` there), decoding
    row by row picks what the teacher-forced path picks, and with no cap and every entry qualifying the
    logits are the dense ones."""
    from infinigen.placement import Placement
    from infinigen.policies import make_policy
    _, model = make_tiny("llama", num_hidden_layers=3)
    mats = random_skew(model, seed=0)
    tokens = random_tokens(model, b=1, t=200, seed=0)
    dense = runtime.teacher_forced(model, tokens, 40, Placement().new_session(model, 1, 200))
    every = make_policy("infinigen", preset="budget", alpha=1e30, kv_budget=1.0, key_mode=key_mode,
                        partial_ratio=1.0).with_skew(mats)
    out = runtime.teacher_forced(model, tokens, 40, Placement().new_session(model, 1, 200, every))
    assert (out - dense).abs().max() <= 1e-4
    pol = make_policy("infinigen", preset="budget", alpha=1.0, kv_budget=0.3, budget_growth=1.0, min_fetch=0,
                      key_mode=key_mode).with_skew(mats)
    sess = Placement().new_session(model, 1, 200, pol)
    tf = runtime.teacher_forced(model, tokens, 40, sess)
    assert 0 < sess.stats.per_layer()[0] <= 0.3 + 1e-9 and pol.selects(0)
    # decoding: the same selections and logits as teacher-forced
    sess = Placement().new_session(model, 1, 200, pol)
    out = [runtime.prefill(model, tokens[:, :40], sess)]
    assert not pol.known_ahead(0, sess) and sess.planned(0) is None
    for t in range(40, 199):
        out.append(runtime.decode(model, tokens[:, t], sess))
    assert (torch.stack(out, 1) - tf[:, 39:199]).abs().max() <= 1e-4


def test_budget_knobs():
    from infinigen.policies import make_policy
    d = make_policy("infinigen", preset="budget")
    assert (d.kv_budget, d.max_fetch_ratio, d.exact_first, d.budget_growth) == (0.13, None, True, 0.5)
    assert d.settings()["kv_budget"] == 0.13 and d.settings()["budget_growth"] == 0.5
    m = make_policy("infinigen", preset="budget", max_fetch_ratio=0.3)  # a per-layer cap replaces the all-layer one
    assert (m.kv_budget, m.max_fetch_ratio) == (None, 0.3)
    p = make_policy("infinigen", preset="paper", kv_budget=0.1)  # and the reverse
    assert (p.kv_budget, p.max_fetch_ratio, p.exact_first, p.dense_layers) == (0.1, None, False, (0, 1))
    assert make_policy("infinigen", preset="paper").max_fetch_ratio == 0.2
    for bad in (dict(kv_budget=0.2, max_fetch_ratio=0.2), dict(kv_budget=0.0), dict(kv_budget=1.5),
                dict(budget_power=-1.0), dict(exact_first="yes")):
        with pytest.raises(UserError):
            make_policy("infinigen", preset="budget", **bad)


def test_cli_knobs(tiny_checkpoint, tmp_path, capfd):
    """`--knob kv_budget=...`, `exact_first=...`, `budget_power=...` reach the policy and the JSON record."""
    import json

    from infinigen.cli import main
    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 20)
    out = tmp_path / "r.json"
    code = main(["ppl", "--model", str(tiny_checkpoint), "--text", str(text), "--ctx", "64", "--prefill", "16",
                 "--policy", "infinigen", "--knob", "kv_budget=0.5", "--knob", "exact_first=false",
                 "--knob", "budget_power=0.5", "--knob", "skew=false", "--json", str(out)])
    assert code == 0, capfd.readouterr().err
    st = json.loads(out.read_text())["settings"]
    assert (st["kv_budget"], st["exact_first"], st["budget_power"], st["max_fetch_ratio"]) == (0.5, False, 0.5, None)
    assert main(["ppl", "--model", str(tiny_checkpoint), "--text", str(text), "--ctx", "64", "--prefill", "16",
                 "--policy", "infinigen", "--knob", "kv_budget=0.5", "--knob", "max_fetch_ratio=0.2"]) == 2


def test_budget_growth_shrinks_the_share_with_length():
    """budget_growth q: the tokens read grow as n ** q, kv_budget being the share at budget_ref tokens; q = 1
    is the same share at every length (the reduction to the flat bound); never more than everything."""
    from infinigen.policies import make_policy
    flat = make_policy("infinigen", preset="budget", kv_budget=0.2, budget_growth=1.0)
    assert [flat.budget_at(n) for n in (100, 2048, 8192)] == [0.2, 0.2, 0.2]
    g = make_policy("infinigen", preset="budget", kv_budget=0.2, budget_growth=0.5, budget_ref=2048)
    assert g.budget_at(2048) == pytest.approx(0.2) and g.budget_at(8192) == pytest.approx(0.1)
    assert g.budget_at(512) == pytest.approx(0.4) and g.budget_at(1) == 1.0
    for bad in (dict(budget_growth=0.0), dict(budget_growth=1.5), dict(budget_ref=0),
                dict(kv_budget=None, max_fetch_ratio=0.2, budget_growth=0.5)):
        with pytest.raises(UserError):
            make_policy("infinigen", preset="budget", **bad)


@pytest.mark.parametrize("layers", [4, 30])
def test_budget_growth_bound_holds_per_row_and_decoding_agrees(make_tiny, layers):
    """With growth 0.5 every row reads at most its own length's share in every layer (the caps bind: every
    entry qualifies), the all-layer mean is the mean of those shares, and decoding token by token makes
    the same selections (same logits) as the teacher-forced pass."""
    from infinigen.placement import Placement
    from infinigen.policies import make_policy
    _, model = make_tiny("llama", num_hidden_layers=layers)
    c = model.cfg
    pol = record_selections(make_policy("infinigen", preset="budget", alpha=1e9, kv_budget=0.3, budget_growth=0.5,
                              budget_ref=64, min_fetch=0).with_skew(random_skew(model, seed=0)))
    t, p = 200, 40
    tokens = random_tokens(model, b=1, t=t, seed=0)
    sess = Placement().new_session(model, 1, t, pol)
    tf = runtime.teacher_forced(model, tokens, p, sess)
    assert sorted(pol.seen) == list(range(layers))
    shares = []
    for r in range(p, t):
        share = pol.budget_at(r)
        assert share < 0.3 * (64 / p) ** 0.5 + 1e-9 and (r <= 64) == (share >= 0.3 - 1e-12)
        for i in range(layers):
            read = pol.seen[i][r - p].sum().item() / (c.num_kv_heads * r)
            assert read <= share + 1e-9 and read >= share - 1.0 / r - 1e-9  # the floor of share * r tokens
        shares.append(share)
    assert sess.stats.overall() == pytest.approx(sum(shares) / len(shares), abs=1.0 / p)
    if layers > 4:
        # 30 random layers: decoding's attention sums in another order, and the last-ulp differences reach
        # near-ties of the cut (every entry qualifies) by row ~100, with the flat budget too
        return
    logits, _ = prefill_then_decode(model, pol, tokens, p)
    assert (logits - tf[:, p - 1:t - 1]).abs().max() <= 1e-4


def test_block_selection_reads_whole_blocks_within_the_cap(make_tiny):
    """block=16: every slot read lies in a block whose other (cached) slots are read too, each layer
    reads at most its cap, and decoding picks what the teacher-forced pass picks."""
    from infinigen.placement import Placement
    from infinigen.policies import make_policy
    _, model = make_tiny("llama", num_hidden_layers=4)
    c = model.cfg
    t, p = 200, 40
    tokens = random_tokens(model, b=1, t=t, seed=0)
    pol = record_selections(make_policy("infinigen", alpha=1e9, max_fetch_ratio=0.25, min_fetch=0, block=16,
                              dense_layers=(0,)).with_skew(random_skew(model, seed=0)))
    sess = Placement().new_session(model, 1, t, pol)
    tf = runtime.teacher_forced(model, tokens, p, sess)
    for layer in (1, 2, 3):
        for r in range(p, t):
            keep = pol.seen[layer][r - p][0]  # [Hkv, r]
            assert keep.sum() <= int(0.25 * r * c.num_kv_heads)
            padded = torch.nn.functional.pad(keep, (0, -r % 16)).view(c.num_kv_heads, -1, 16)
            whole = padded.all(-1) | ~padded.any(-1)
            last = r // 16  # the last block is cut by the row's length: only its cached slots
            assert bool(whole[:, :last].all())
            if r % 16:
                tail = padded[:, last, : r % 16]
                assert bool((tail.all(-1) | ~tail.any(-1)).all())
    logits, _ = prefill_then_decode(model, pol, tokens, p)
    assert (logits - tf[:, p - 1:t - 1]).abs().max() <= 1e-4
    for bad in (dict(block=0), dict(block=16, budget="mean")):
        with pytest.raises(UserError):
            make_policy("infinigen", **bad)
