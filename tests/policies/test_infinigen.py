"""The InfiniGen policy: exact with an unlimited budget, the true top tokens when speculation is exact,
GQA groups covered, and the vectorized teacher-forced path equal to row-by-row decoding."""
from __future__ import annotations

import itertools
import math
import types

import pytest
import torch

from infinigen import runtime
from infinigen.cache import SelectedRows
from infinigen.errors import UserError
from infinigen.policies import make_policy
from infinigen.policies.infinigen import BUDGETS, InfiniGen, fake_int4
from infinigen.pool import KVPool
from infinigen.placement import Placement
from support.speculation import P, T, prefill_then_decode, random_skew, random_tokens, record_selections

MODES = list(itertools.product(("mean", "per_head", "union", "layer"), ("attn_in", "attn_out"), ("partial", "int4")))


# ---- unlimited budget = dense ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "opt"])
@pytest.mark.parametrize("budget,spec_input,key_mode", MODES)
def test_unlimited_budget_is_dense(make_tiny, kind, budget, spec_input, key_mode):
    _, model = make_tiny(kind)
    tokens = random_tokens(model)
    dense = runtime.teacher_forced(model, tokens, P, Placement().new_session(model, 2, T))
    for skew in (False, True):
        pol = make_policy("infinigen", alpha=1e30, max_fetch_ratio=1.0, dense_layers=(), budget=budget,
                          spec_input=spec_input, key_mode=key_mode, skew=skew).with_skew(random_skew(model))
        sess = Placement().new_session(model, 2, T, pol)
        out = runtime.teacher_forced(model, tokens, P, sess)
        assert (out - dense).abs().max() <= 1e-4
        assert sess.stats.overall() == pytest.approx(1.0)
    pol = make_policy("infinigen", alpha=1e9, max_fetch_ratio=1.0, dense_layers=(), budget=budget,
                      spec_input=spec_input, key_mode=key_mode).with_skew(random_skew(model))
    dec, _ = prefill_then_decode(model, pol, tokens)
    assert (dec - dense[:, P - 1:-1]).abs().max() <= 1e-4


# ---- selection semantics on constructed scores ------------------------------------------------------
def _chooser(budget, alpha, cap=1.0):
    pol = InfiniGen(budget=budget, max_fetch_ratio=cap, min_fetch=0)
    return types.SimpleNamespace(_choose=lambda s, valid: pol._choose(s, valid, alpha))


def test_min_fetch_floor_on_short_contexts():
    """14% of 40 tokens is 5: the default's floor lets up to 32 per KV head through, the paper has none."""
    s = torch.linspace(0, 1, 40, dtype=torch.float32).expand(1, 2, 2, 1, 40).clone()  # flat: all above max - alpha
    valid = torch.ones(1, 1, 1, 40, dtype=torch.bool)
    for budget in BUDGETS:
        pol = InfiniGen(budget=budget, max_fetch_ratio=0.14)
        assert pol.min_fetch == 32
        assert pol._choose(s.clone(), valid, 7.0).sum(-1).flatten().tolist() == [32, 32], budget
        pol = InfiniGen(budget=budget, max_fetch_ratio=0.14, min_fetch=0)
        counts = pol._choose(s.clone(), valid, 7.0).sum(-1).flatten().tolist()
        assert (sum(counts) == 11) if budget == "layer" else (counts == [5, 5]), (budget, counts)  # layer: 14% of 80
        pol = InfiniGen(budget=budget, max_fetch_ratio=0.14, min_fetch=64)  # more than there is: all of it
        assert pol._choose(s.clone(), valid, 7.0).sum(-1).flatten().tolist() == [40, 40], budget
    assert InfiniGen.paper().min_fetch == 0


def test_choose_constructed_scores():
    # 1 row, 2 KV heads x 2 query heads, 8 cached tokens
    s = torch.tensor([[[10, 9, 3, 2, 1, 0, 0, 0], [0, 0, 10, 9.5, 9.2, 1, 0, 0]],
                      [[5, 5, 5, 5, 5, 5, 5, 4], [0, 1, 2, 3, 4, 5, 6, 20]]], dtype=torch.float64)[None, :, :, None]
    valid = torch.ones(1, 1, 1, 8, dtype=torch.bool)
    # union: every token within alpha of its head's max, per KV head the union of its query heads
    keep = _chooser("union", 2.0)._choose(s, valid)[0, :, 0]
    assert keep[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert keep[1].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # query head 2 is flat: all > 3
    # counts per query head: 2, 3, 8 (4 > 5 - 2), 1 -> mean 3.5 -> every head its top 4 (ties: lower slot)
    keep = _chooser("mean", 2.0)._choose(s, valid)[0, :, 0]
    assert keep[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]  # {0,1,2,3} | {2,3,4,5}
    assert keep[1].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # {0,1,2,3} | {4,5,6,7}
    # per_head: KV head 0 counts (2, 3) -> top 3 each; KV head 1 counts (8, 1) -> top 5 each
    keep = _chooser("per_head", 2.0)._choose(s, valid)[0, :, 0]
    assert keep[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]  # {0,1,2} | {2,3,4}
    assert keep[1].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # {0..4} | {3..7}
    # the cap: exactly floor(ratio * length) per KV head, the tokens closest to their head's max
    keep = _chooser("union", 2.0, cap=0.25)._choose(s, valid)[0, :, 0]
    assert keep[0].nonzero().flatten().tolist() == [0, 2]  # both query heads' maxima
    assert keep[1].nonzero().flatten().tolist() == [0, 1]  # all tied at their head's max: lower slots
    keep = _chooser("mean", 2.0, cap=0.25)._choose(s, valid)[0, :, 0]  # every head its top 2
    assert keep[0].nonzero().flatten().tolist() == [0, 1, 2, 3]
    # layer: the cap pooled over KV heads (2 x 8 x 0.25 = 4 entries), by speculated mass summed over the group
    keep = _chooser("layer", 2.0, cap=0.25)._choose(s, valid)[0, :, 0]
    assert keep[0].nonzero().flatten().tolist() == [0, 2, 3] and keep[1].nonzero().flatten().tolist() == [7]
    assert torch.equal(_chooser("layer", 2.0)._choose(s, valid), _chooser("union", 2.0)._choose(s, valid))
    # invalid slots are never selected, whatever their score
    v = valid.clone()
    v[..., 2] = False
    for b in ("union", "mean", "per_head", "layer"):
        assert not _chooser(b, 50.0)._choose(s, v)[0, :, 0, 2].any()


def test_int4_copy():
    x = torch.randn(3, 5, 64)
    q = fake_int4(x)
    g = x.view(3, 5, 2, 32)
    step = (g.amax(-1) - g.amin(-1)) / 15
    assert ((q - x).view(3, 5, 2, 32).abs() <= step[..., None] / 2 + 1e-6).all()
    assert (q - x).abs().max() > 0
    # 4 bits: at most 16 levels per group, and code 0 is the group's minimum itself (asymmetric)
    for grp_q, grp_x in zip(q.view(-1, 32), x.view(-1, 32)):
        assert grp_q.unique().numel() <= 16
        assert grp_q.min() == grp_x.min() and grp_q.max() == pytest.approx(grp_x.max().item(), abs=1e-5)


# ---- exact speculation: the true top tokens --------------------------------------------------------
def _pass_through(model):
    """Every block but the last adds nothing to the residual and all input norms are equal: the hidden
    state before layer i equals the one before layer i-1, so speculating from layer i-1 is exact."""
    with torch.no_grad():
        for blk in model.layers[:-1]:
            blk.attn.o_proj.weight.zero_()
            blk.mlp.down_proj.weight.zero_()
            for lin in (blk.attn.o_proj, blk.mlp.down_proj):
                if lin.bias is not None:
                    lin.bias.zero_()
        w = model.layers[0].attn_norm.weight.detach().clone()
        for blk in model.layers:
            blk.attn_norm.weight.copy_(w)
            blk.attn.q_proj.weight.mul_(6.0)  # peaked scores: selections that really choose
    return model


@pytest.mark.parametrize("budget", ["union", "mean", "per_head", "layer"])
@pytest.mark.parametrize("spec_input", ["attn_in", "attn_out"])
def test_exact_speculation_selects_true_top_tokens(make_tiny, budget, spec_input):
    _, model = make_tiny("llama", num_hidden_layers=4)
    model = _pass_through(model)
    alpha = 1.5
    pol = make_policy("infinigen", alpha=alpha, max_fetch_ratio=1.0, dense_layers=(0,), budget=budget,
                      spec_input=spec_input, key_mode="partial", partial_ratio=1.0).with_skew(random_skew(model))
    c = model.cfg
    checked, differ = [], []
    inner = pol.keep

    def select(layer, rows, sess):
        keep = inner(layer, rows, sess)
        keep = keep.keep if isinstance(keep, SelectedRows) else keep[:, :, 0]  # the packed rows' mask
        q = rows.query
        n = sess.store.length[layer]
        k = sess.store.k[layer][:, :, :n].double()
        qg = q.double().view(q.shape[0], c.num_kv_heads, c.group_size, c.head_dim)
        true = qg @ k.transpose(-1, -2) * model.scale  # [B, Hkv, G, S]: the real scores of layer `layer`
        rel = true - true.amax(-1, keepdim=True)
        above = rel > -alpha
        if budget in ("union", "layer"):  # no cap here: the layer's union
            own = above  # each query head's own picks
        else:
            counts = above.sum(-1).double()
            nn = counts.mean((1, 2), keepdim=True) if budget == "mean" else counts.mean(2, keepdim=True)
            nn = torch.ceil(nn - 1e-6).long().expand_as(counts)
            kth = true.sort(-1, descending=True).values.gather(-1, (nn - 1)[..., None])
            own = true >= kth
        # GQA: a KV head reads exactly the union of its query heads' own picks
        assert torch.equal(keep, own.any(2))
        checked.append((layer, keep.float().mean().item()))
        differ.append(bool((own != keep[:, :, None]).any()))  # some query head alone would read less
        return keep[:, :, None]
    object.__setattr__(pol, "keep", select)
    prefill_then_decode(model, pol, random_tokens(model, t=30), p=8)
    assert {layer for layer, _ in checked} == {1, 2, 3}
    assert sum(f for _, f in checked) / len(checked) < 0.8  # real choices were made
    assert any(differ)  # ... and query heads of a group disagree, so the union matters


def test_gqa_selection_covers_query_heads(make_tiny):
    """Whatever the speculation error, a KV head's selection holds each of its query heads' picks."""
    _, model = make_tiny("llama")
    pol = make_policy("infinigen", alpha=1.0, dense_layers=(0,), budget="union", key_mode="partial",
                      max_fetch_ratio=1.0).with_skew(random_skew(model))
    seen = []
    inner = pol._choose

    def choose(s, valid, alpha, same=None, ratio=None):
        keep = inner(s, valid, alpha, same, ratio)
        rel = s.float().masked_fill(~valid[:, :, None], float("-inf"))
        rel = rel - rel.amax(-1, keepdim=True)
        per_query_head = rel > -1.0  # [B, Hkv, G, R, S]
        assert (per_query_head & ~keep[:, :, None]).sum() == 0
        seen.append(per_query_head.shape[2])
        return keep
    object.__setattr__(pol, "_choose", choose)
    runtime.teacher_forced(model, random_tokens(model), P, Placement().new_session(model, 2, T, pol))
    assert seen and set(seen) == {model.cfg.group_size} and model.cfg.group_size > 1


# ---- teacher-forced = row by row = real decoding -----------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "opt"])
@pytest.mark.parametrize("budget,spec_input,key_mode", MODES)
def test_select_rows_equals_decoding(make_tiny, kind, budget, spec_input, key_mode):
    _, model = make_tiny(kind)
    tokens = random_tokens(model)
    # the selections bit for bit: without the remainder, whose mixing rounds differently per path (its own
    # test, tests/test_remainder.py, holds the paths to 1e-4)
    knobs = dict(alpha=1.0, max_fetch_ratio=0.3, min_fetch=0, dense_layers=(0,), budget=budget, spec_input=spec_input,
                 key_mode=key_mode, remainder=False)
    vec = record_selections(make_policy("infinigen", **knobs).with_skew(random_skew(model)))
    s_vec = Placement().new_session(model, 2, T, vec)
    out_vec = runtime.teacher_forced(model, tokens, P, s_vec)
    # the runtime replays row by row when a pool allocator is present (here one that never evicts)
    rep = record_selections(make_policy("infinigen", **knobs).with_skew(random_skew(model)))
    s_rep = Placement().new_session(model, 2, T, rep, allocator=KVPool())
    out_rep = runtime.teacher_forced(model, tokens, P, s_rep)
    dec = record_selections(make_policy("infinigen", **knobs).with_skew(random_skew(model)))
    out_dec, s_dec = prefill_then_decode(model, dec, tokens)
    assert (out_vec - out_rep).abs().max() <= 1e-5
    assert (out_vec[:, P - 1:-1] - out_dec).abs().max() <= 1e-4
    assert set(vec.seen) == set(rep.seen) == set(dec.seen) == set(range(1, model.cfg.num_layers))
    frac = []
    for layer in vec.seen:
        assert len(vec.seen[layer]) == len(rep.seen[layer]) == T - P
        for r in range(T - P - 1):  # real decoding stops before the last token
            assert torch.equal(vec.seen[layer][r], rep.seen[layer][r]), (layer, r)
            assert torch.equal(vec.seen[layer][r], dec.seen[layer][r]), (layer, r)
            frac.append(vec.seen[layer][r].float().mean().item())
    assert 0 < sum(frac) / len(frac) < 0.9  # entries really were dropped
    assert s_vec.stats.per_layer() == pytest.approx(s_rep.stats.per_layer())


@pytest.mark.parametrize("skew", [False, True])
def test_partial_index_holds_the_heaviest_columns(make_tiny, skew):
    """The paper's partial index (key_mode "partial"): per request and KV head, the ceil(r*d) columns with
    the largest |Q~| + |K~| mass over the prompt, in skewed coordinates. Constructed so that a few raw
    columns dominate, some through the queries (summed over the group's query heads), one through the
    keys; the skew is a permutation per KV head, so where those columns land is known."""
    _, model = make_tiny("llama")
    c = model.cfg
    b, t, d, g = 2, 10, c.head_dim, c.group_size
    perm = [torch.randperm(d, generator=torch.Generator().manual_seed(11 + h)) for h in range(c.num_kv_heads)]
    mats = torch.zeros(c.num_layers, c.num_kv_heads, d, d, dtype=torch.float64)
    for h, pm in enumerate(perm):
        mats[:, h, torch.arange(d), pm] = 1.0  # (x A)[:, pm[i]] = x[:, i]
    pol = InfiniGen.paper(dense_layers=(0,), skew=skew).with_skew(mats)
    cols = math.ceil(pol.partial_ratio * d)
    assert cols == 3
    gen = torch.Generator().manual_seed(4)
    q = 0.05 * torch.randn(b, c.num_heads, t, d, generator=gen)
    k = 0.05 * torch.randn(b, c.num_kv_heads, t, d, generator=gen)
    heavy = {(0, 0): (1, 6, 3), (0, 1): (0, 2, 7), (1, 0): (5, 4, 2), (1, 1): (3, 1, 6)}  # via q, q, k
    for (row, h), (qa, qb, kc) in heavy.items():
        heads = slice(h * g, (h + 1) * g)
        q[row, heads, :, qa] += 2.0
        q[row, heads, :, qb] -= 1.5  # the magnitude counts, not the sign
        k[row, h, :, kc] += 3.0 * g  # as heavy as a column of all the group's queries
        q[row, h * g, :, (kc + 1) % d] += 1.0  # a lighter column, in one query head only
    sess = Placement().new_session(model, b, t, pol)
    valid = torch.ones(b, t, dtype=torch.bool)
    positions = torch.arange(t).expand(b, t)
    sess.store.write_prompt(1, k, k, valid, positions)
    pol.on_prefill(1, q, k, k, sess)
    idx = sess.state.idx[1]
    assert idx.shape == (b, c.num_kv_heads, cols)
    for (row, h), raw in heavy.items():
        want = sorted(perm[h][list(raw)].tolist()) if skew else sorted(raw)
        assert idx[row, h].tolist() == want, (row, h)


# ---- knobs ------------------------------------------------------------------------------------------
def test_presets_and_knobs(make_tiny):
    p = InfiniGen.paper()
    assert (p.partial_ratio, p.max_fetch_ratio, p.dense_layers, p.budget, p.spec_input, p.key_mode, p.skew) == \
        (0.3, 0.2, (0, 1), "mean", "attn_in", "partial", True)
    _, llama = make_tiny("llama")
    _, opt = make_tiny("opt")
    for model, alpha in ((llama, 5.0), (opt, 4.0)):
        pol = InfiniGen.paper(skew=False)
        assert Placement().new_session(model, 1, 8, pol).state.alpha == alpha == pol.settings(model)["alpha"]
    d = make_policy("infinigen", dense_layers="0,1,2", alpha=6)
    assert d.dense_layers == (0, 1, 2) and d.alpha == 6 and d.preset == "default"
    assert make_policy("infinigen", dense_layers="").dense_layers == ()
    for bad in (dict(alpha=0), dict(partial_ratio=0), dict(max_fetch_ratio=1.5), dict(budget="max"),
                dict(spec_input="x"), dict(key_mode="int8"), dict(dense_layers="a"), dict(min_fetch=-1),
                dict(min_fetch=2.5)):
        with pytest.raises(UserError):
            make_policy("infinigen", **bad)
    with pytest.raises(UserError):
        InfiniGen(preset="nope")
    pol = make_policy("infinigen").with_skew(torch.zeros(2, 2, 2, 2))
    with pytest.raises(UserError):
        Placement().new_session(llama, 1, 8, pol)


def test_dense_layers_count_in_relative_kv(make_tiny):
    _, model = make_tiny("llama", num_hidden_layers=4)
    pol = make_policy("infinigen", alpha=0.5, max_fetch_ratio=0.2, min_fetch=0,
                      dense_layers=(0, 1)).with_skew(random_skew(model))
    sess = Placement().new_session(model, 2, T, pol)
    runtime.teacher_forced(model, random_tokens(model), P, sess)
    per = sess.stats.per_layer()
    assert per[0] == per[1] == pytest.approx(1.0)
    assert all(f <= 0.25 for f in per[2:])
    assert [pol.selects(i) for i in range(4)] == [False, False, True, True]


# ---- the default model ----------------------------------------------------------------------------
@pytest.mark.integration
def test_default_model_accuracy(default_model, tmp_path, monkeypatch):
    """A short perplexity run: the default InfiniGen (its preset's values: no calibration here) stays close to
    the full cache within what its caps allow (the share read grows as the context shrinks: 20% over a 2048-token
    run, its caps' share over this 768-token one), and beats the paper's configuration."""
    from infinigen.policies.calibrate import caps_share
    from infinigen.skew import load_or_compute_skew, read_tokens, resolve_text
    model, tok = default_model
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    skew = load_or_compute_skew(model, tok, "emma", tokens=1024)
    ids = torch.tensor([read_tokens(tok, resolve_text("prideprejudice"), 768)])
    p = 256

    def ppl(pol):
        sess = Placement().new_session(model, 1, ids.shape[1], pol)
        lg = runtime.teacher_forced(model, ids, p, sess)
        nll = -torch.log_softmax(lg[0, p - 1:-1].double(), -1).gather(-1, ids[0, p:, None]).mean()
        return math.exp(nll.item()), sess.stats.overall()

    full, _ = ppl(None)
    pol = make_policy("infinigen").with_skew(skew)
    ours, kv = ppl(pol)
    paper, kv_paper = ppl(InfiniGen.paper().with_skew(skew))
    print(f"\nfull {full:.3f}; infinigen default {ours:.3f} ({100 * (ours / full - 1):+.2f}%, KV {100 * kv:.1f}%); "
          f"paper {paper:.3f} ({100 * (paper / full - 1):+.2f}%, KV {100 * kv_paper:.1f}%)")
    assert kv <= caps_share(pol, model, ids.shape[1], p) + 1e-9 and kv < 0.3
    assert caps_share(pol, model, 2048, 256) <= 0.20
    assert ours / full - 1 < 0.03
    assert ours < paper
