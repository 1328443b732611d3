"""InfiniGen's `dense_below` (issue 18 item 5, "sparse only where it pays"): a row with fewer cached tokens
than the knob reads every layer densely. A step whose every row is below it does no speculation at all and
takes the full cache's fused path (the same logits, bit for bit); a sequence that crosses the threshold
mid-decode selects exactly as teacher-forced scoring does; 0 selects everywhere, as before the knob."""
from __future__ import annotations

import pytest
import torch

from infinigen import runtime
from infinigen.errors import UserError
from infinigen.kernels.int4 import PackedKeys
from infinigen.placement import Placement
from infinigen.policies import make_policy
from infinigen.policies.infinigen import InfiniGen
from infinigen.policies.knobs import make_policy_from_cli
from infinigen.selection import ALL

T, P = 36, 12


from test_infinigen import _mats, _tokens  # noqa: E402  the same random skew matrices and tokens


def _policy(model, **knobs):
    base = dict(alpha=1.0, max_fetch_ratio=0.3, min_fetch=0, dense_layers=(0,))
    return make_policy("infinigen", **(base | knobs)).with_skew(_mats(model))


class _Reads(runtime.Listener):
    """What each decoding row read per layer: "all" (the runtime was told ALL) or the kept mask of each row
    over its past positions; and, when asked, the plan placement would fetch one layer ahead."""

    def __init__(self, plans=False):
        self.seen, self.plans, self.ask_plans = {}, [], plans

    def on_hidden(self, layer, point, x, session):
        if self.ask_plans and session.decoding and layer + 1 < session.model.cfg.num_layers:
            self.plans.append(session.planned(layer + 1))

    def on_select(self, layer, rows, keep, session):
        out = self.seen.setdefault(layer, [])
        if rows.in_store:
            out.append("all" if keep is ALL else keep[:, :, 0, :rows.positions[0, 0]].clone())
        else:
            for r in range(rows.count):
                out.append("all" if keep is ALL else keep[:, :, r, :rows.first + r].clone())


def _count_speculation(monkeypatch):
    """Count the speculation's work: queries of the next layer, partial-key and packed-key scoring."""
    calls = {"query": 0, "scores": 0, "packed": 0}
    scores, packed = InfiniGen._scores, PackedKeys.scores

    def counted_scores(self, *a, **kw):
        calls["scores"] += 1
        return scores(self, *a, **kw)

    def counted_packed(self, *a, **kw):
        calls["packed"] += 1
        return packed(self, *a, **kw)
    monkeypatch.setattr(InfiniGen, "_scores", counted_scores)
    monkeypatch.setattr(PackedKeys, "scores", counted_packed)
    return calls


def _count_queries(model, calls):
    inner = model.query

    def query(*a, **kw):
        calls["query"] += 1
        return inner(*a, **kw)
    model.query = query  # an instance attribute: this model only


def _decode(model, pol, tokens, p=P, listeners=()):
    sess = Placement().new_session(model, tokens.shape[0], tokens.shape[1], pol, listeners=listeners)
    logits = [runtime.prefill(model, tokens[:, :p], sess)]
    for t in range(p, tokens.shape[1] - 1):
        logits.append(runtime.decode(model, tokens[:, t], sess))
    return torch.stack(logits, 1), sess


# ---- the knob ---------------------------------------------------------------------------------------------------
def test_knob_is_checked_and_recorded():
    for bad in (-1, True, 1.5, "512"):
        with pytest.raises(UserError, match="dense.below"):
            InfiniGen(dense_below=bad)
    assert InfiniGen(dense_below=4096).settings()["dense_below"] == 4096
    assert make_policy_from_cli("infinigen", ["dense_below=300"]).dense_below == 300
    with pytest.raises(UserError):
        make_policy_from_cli("infinigen", ["dense_below=-5"])


# ---- below the threshold: the full cache, no speculation --------------------------------------------------------
@pytest.mark.parametrize("key_mode,exact_first", [("int4", False), ("partial", False), ("int4", True)])
def test_below_threshold_is_the_full_cache_without_speculation(make_tiny, monkeypatch, key_mode, exact_first):
    _, model = make_tiny("llama", num_hidden_layers=3)
    tokens = _tokens(model)
    full, _ = _decode(model, make_policy("full"), tokens)
    calls = _count_speculation(monkeypatch)
    pol = _policy(model, key_mode=key_mode, exact_first=exact_first, dense_below=T)
    sess = Placement().new_session(model, 2, T, pol, listeners=[reads := _Reads(plans=True)])
    out = [runtime.prefill(model, tokens[:, :P], sess)]
    _count_queries(model, calls)  # the prefill's queries aside: decoding steps only from here
    fused = {"step": 0}
    step = runtime.attend_step

    def attend_step(*a, **kw):
        fused["step"] += 1
        return step(*a, **kw)
    monkeypatch.setattr(runtime, "attend_step", attend_step)
    for t in range(P, T - 1):
        out.append(runtime.decode(model, tokens[:, t], sess))
    assert calls == {"query": 0, "scores": 0, "packed": 0}  # no speculative query, no scoring
    assert fused["step"] == 0  # every layer took the fused dense call, as the full cache does
    assert torch.equal(torch.stack(out, 1), full)
    assert reads.plans and all(p is ALL for p in reads.plans)  # placement would fetch everything
    assert all(r == "all" for rs in reads.seen.values() for r in rs)
    # nothing was packed for speculation while every step read densely (int4 keys are built at the crossing);
    # the paper's partial keys need the prompt's queries, so they are kept up to date from the prefill on
    st = sess.state
    if key_mode == "int4":
        assert st.lazy_keys and not st.spec_keys
    else:
        assert set(st.spec_keys) == st.spec_layers


# ---- crossing the threshold ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("key_mode,budget,exact_first", [("int4", "layer", False), ("partial", "mean", False),
                                                         ("int4", "union", True)])
def test_crossing_mid_decode_equals_teacher_forced(make_tiny, key_mode, budget, exact_first):
    _, model = make_tiny("llama", num_hidden_layers=3)
    tokens = _tokens(model)
    below = 20  # rows at positions 12..19 read densely, 20..34 select
    knobs = dict(key_mode=key_mode, budget=budget, exact_first=exact_first, dense_below=below)
    vec = _Reads()
    s_vec = Placement().new_session(model, 2, T, _policy(model, **knobs), listeners=[vec])
    out_vec = runtime.teacher_forced(model, tokens, P, s_vec)
    dec = _Reads()
    out_dec, s_dec = _decode(model, _policy(model, **knobs), tokens, listeners=[dec])
    assert (out_vec[:, P - 1:-1] - out_dec).abs().max() <= 1e-4
    assert set(vec.seen) == set(dec.seen)
    sparse = []
    for layer in dec.seen:
        for r, (a, b) in enumerate(zip(vec.seen[layer], dec.seen[layer])):
            if a == "all":  # a dense layer
                assert b == "all"
            elif P + r < below:  # decoding was told ALL; teacher-forced kept every past entry of the row
                assert b == "all" and a.all(), (layer, r)
            else:
                assert torch.equal(a, b), (layer, r)
                sparse.append(a.float().mean().item())
    assert 0 < sum(sparse) / len(sparse) < 0.9  # past the threshold, entries really were dropped


def test_mixed_batch_rows_decide_alone(make_tiny):
    """Left-padded rows straddling the threshold: each row reads as it would decoded alone (a short row keeps
    everything while the long row beside it selects)."""
    _, model = make_tiny("llama", num_hidden_layers=3)
    long_row, short_row = _tokens(model, b=1, seed=4)[0], _tokens(model, b=1, seed=5)[0, :T - 6]
    pol = _policy(model, dense_below=18)
    alone = []
    for row in (long_row, short_row):
        logits, _ = _decode(model, pol, row[None], p=P if row is long_row else P - 6)
        alone.append(logits[0])
    # one batch: the short prompt left-padded to the long one's length, both decoded together
    prompt = torch.zeros(2, P, dtype=torch.long)
    prompt[0], prompt[1, 6:] = long_row[:P], short_row[:P - 6]
    pad = torch.ones(2, P, dtype=torch.bool)
    pad[1, :6] = False
    sess = Placement().new_session(model, 2, T, pol)
    out = [runtime.prefill(model, prompt, sess, pad_mask=pad)]
    for i in range(T - P - 1):
        out.append(runtime.decode(model, torch.stack([long_row[P + i], short_row[P - 6 + i]]), sess))
    out = torch.stack(out, 1)
    assert (out[0] - alone[0]).abs().max() <= 1e-4
    assert (out[1] - alone[1][:out.shape[1]]).abs().max() <= 1e-4


# ---- 0: select everywhere, as before the knob ----------------------------------------------------------------------
def test_zero_selects_everywhere(make_tiny, monkeypatch):
    """dense_below 0 scores every speculated layer at every step, and gives the same logits bit for bit as a
    threshold at the prompt's length (where no decoding row is below it)."""
    _, model = make_tiny("llama", num_hidden_layers=3)
    tokens = _tokens(model)
    calls = _count_speculation(monkeypatch)
    off, _ = _decode(model, _policy(model, dense_below=0), tokens)
    steps = T - P - 1
    assert calls["scores"] == steps * 2  # layers 1 and 2, every step
    at_prompt, _ = _decode(model, _policy(model, dense_below=P), tokens)
    assert torch.equal(off, at_prompt)
    one_more, _ = _decode(model, _policy(model, dense_below=P + 1), tokens)
    assert not torch.equal(off[:, 1], one_more[:, 1])  # the first decoding row read densely there
