"""InfiniGen's knob `query`: which query selects a layer's entries. "ahead" is the paper's
speculation one layer ahead (its rows can be fetched while the layer before runs); "own" is each layer's own
query at its attention, scored against the same 4-bit speculation keys (nothing is known ahead); "auto", the
default preset's, is "own" where the KV is in fast memory and, where placement fetches it from a slower tier,
"ahead" for the prefetch corrected by the own query (`Placement.correct`; tests/placement/
test_offload_correction.py) or, without the correction, "ahead" alone. Checked here: the own query is what
selects (its output is closer to dense than the speculated one, and decoding equals teacher-forced scoring);
nothing is planned ahead with it; "auto" without the correction speculates exactly where the store is
offloaded (then it decodes as "ahead" does in fast memory); with an unlimited budget
it is the dense result; `remainder_from` leaves the layers before it without the remainder."""
from __future__ import annotations

import pytest
import torch

from infinigen import runtime
from infinigen.placement import Placement
from infinigen.policies import make_policy

T, P, B = 28, 9, 2  # sequence length, prefill length, batch
# a budget that really leaves entries unread (min_fetch 0: the default floor of 32 would read all 28 tokens)
LIMITED = dict(max_fetch_ratio=0.3, min_fetch=0, dense_layers=(), exact_first=True, skew=False, remainder=False)
UNCORRECTED = Placement(kv_offload="cpu", correct=False)  # the offloaded layer reads what was speculated



def _tokens(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (B, T), generator=g)


def _teacher(model, policy, tokens, placement=None):
    sess = (placement or Placement()).new_session(model, B, T, policy)
    try:
        return runtime.teacher_forced(model, tokens, P, sess)
    finally:
        sess.store.close()


def _decode(model, policy, tokens, placement=None, probe=None):
    sess = (placement or Placement()).new_session(model, B, T, policy)
    try:
        out = [runtime.prefill(model, tokens[:, :P], sess)]
        for t in range(P, T):
            out.append(runtime.decode(model, tokens[:, t], sess))
            if probe:
                probe(sess)
        return torch.stack(out, 1), sess
    finally:
        sess.store.close()


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_the_own_query_selects_closer_to_dense_than_the_speculated_one(arch):
    """Attention over what each layer read against attention over every cached entry (cosine, same query),
    per decoding row and layer, at the same budget and keys: the own query's selection is at least the
    oracle's top entries' (the layer's budget pooled over its KV heads) and above the speculated one's. On a
    random model the layer before predicts a layer's query poorly; queries scaled up make attention peaked."""
    from support.models import build_tiny
    from infinigen.eval.analyze import attention_similarity
    _, model = build_tiny(arch)
    with torch.no_grad():
        for blk in model.layers:
            blk.attn.q_proj.weight.mul_(5.0)
    policies = {"own": make_policy("infinigen", query="own", **LIMITED),
                "ahead": make_policy("infinigen", query="ahead", **LIMITED),
                "oracle": make_policy("oracle", ratio=LIMITED["max_fetch_ratio"])}
    cos = attention_similarity(model, _tokens(model)[:1], policies, P)
    assert cos["own"].mean() > cos["ahead"].mean() and cos["own"].min() > cos["ahead"].min()
    assert cos["own"].mean() >= cos["oracle"].mean() - 0.01


@pytest.mark.parametrize("remainder", [False, True])
def test_decoding_with_the_own_query_equals_teacher_forced_scoring(tiny, remainder):
    tokens = _tokens(tiny)
    knobs = dict(LIMITED, query="own", remainder=remainder, remainder_from=0)
    scored = _teacher(tiny, make_policy("infinigen", **knobs), tokens)
    decoded, _ = _decode(tiny, make_policy("infinigen", **knobs), tokens)
    torch.testing.assert_close(decoded[:, 1:], scored[:, P:], rtol=1e-4, atol=1e-4)


def _known_ahead(model, pol, tokens) -> list[bool]:
    """Whether layer i+1's selection was known right after layer i's speculation point, each decoding step."""
    sess = Placement().new_session(model, 1, T, pol)
    runtime.prefill(model, tokens[:1, :P], sess)
    ready = []
    hook = pol.on_hidden

    def on_hidden(layer, point, x, s):
        hook(layer, point, x, s)
        if point == pol.spec_input and layer + 1 in s.state.spec_layers:
            ready.append(pol.known_ahead(layer + 1, s))
    object.__setattr__(pol, "on_hidden", on_hidden)
    for t in range(P, P + 3):
        runtime.decode(model, tokens[:1, t], sess)
    return ready


def test_nothing_is_planned_ahead_with_the_own_query(tiny):
    """With "own" no selection exists before a layer's attention (placement has nothing to prefetch); with
    "ahead" every selecting layer's exists right after the layer before's speculation point, before it runs."""
    tokens = _tokens(tiny)
    own = _known_ahead(tiny, make_policy("infinigen", query="own", **LIMITED), tokens)
    ahead = _known_ahead(tiny, make_policy("infinigen", query="ahead", **LIMITED), tokens)
    assert own and not any(own)
    assert ahead and all(ahead)


def _fetched_on_demand(model, pol, tokens) -> tuple[torch.Tensor, int]:
    out, sess = _decode(model, pol, tokens, UNCORRECTED)
    return out, sess.store.stats.on_demand


def test_auto_speculates_ahead_exactly_where_the_kv_is_offloaded(tiny):
    """"auto" without the correction: the own query in fast memory, the speculation (every layer prefetched,
    nothing fetched on demand) on an offloaded tier, where it decodes as "ahead" does in fast memory, to the bit."""
    tokens = _tokens(tiny)
    fast_sess = Placement().new_session(tiny, B, T, make_policy("infinigen", **LIMITED))
    slow_sess = UNCORRECTED.new_session(tiny, B, T, make_policy("infinigen", **LIMITED))
    try:
        assert fast_sess.state.own_query and not slow_sess.state.own_query
    finally:
        fast_sess.store.close()
        slow_sess.store.close()
    offloaded, on_demand = _fetched_on_demand(tiny, make_policy("infinigen", **LIMITED), tokens)
    assert on_demand == 0
    ahead, _ = _decode(tiny, make_policy("infinigen", query="ahead", **LIMITED), tokens)
    torch.testing.assert_close(offloaded, ahead, rtol=1e-4, atol=1e-5)  # the offloaded rows: another gather order
    own, _ = _decode(tiny, make_policy("infinigen", **LIMITED), tokens)
    assert not torch.equal(own, ahead)
    # the own query asked for on an offloaded tier: every selecting layer fetched when its query came
    _, on_demand = _fetched_on_demand(tiny, make_policy("infinigen", query="own", **LIMITED), tokens)
    assert on_demand > 0


def test_auto_leaves_the_remainder_to_the_own_query_unless_set(tiny):
    """The preset's remainder (measured to cost accuracy with the speculated query) is used on an offloaded
    tier under "auto" without the correction only when the caller set it; with it (the own query) always."""
    def with_remainder(placement, **knobs):
        sess = placement.new_session(tiny, B, T, make_policy("infinigen", **knobs))
        try:
            return sess.state.with_remainder
        finally:
            sess.store.close()
    preset = {k: v for k, v in LIMITED.items() if k != "remainder"}
    assert with_remainder(Placement(), **preset)  # the default preset's remainder, own query
    assert not with_remainder(UNCORRECTED, **preset)
    assert with_remainder(UNCORRECTED, **preset, remainder=True)
    assert with_remainder(UNCORRECTED, **preset, query="ahead")  # the caller chose speculation
    assert with_remainder(Placement(kv_offload="cpu"), **preset)  # corrected: the own query selects


def test_an_unlimited_budget_is_the_dense_result(tiny):
    tokens = _tokens(tiny)
    knobs = dict(alpha=1e9, max_fetch_ratio=1.0, dense_layers=(), exact_first=True, skew=False, query="own")
    for remainder in (False, True):
        pol = make_policy("infinigen", remainder=remainder, **knobs)
        torch.testing.assert_close(_teacher(tiny, pol, tokens), _teacher(tiny, make_policy("full"), tokens),
                                   rtol=1e-5, atol=1e-5)


def test_remainder_from_leaves_the_layers_before_it_alone(tiny):
    tokens = _tokens(tiny)
    layers = tiny.cfg.num_layers
    knobs = dict(LIMITED, query="own", remainder=True)
    _, late = _decode(tiny, make_policy("infinigen", remainder_from=layers - 1, **knobs), tokens)
    assert set(late.state.value_sums) == {layers - 1}  # only that layer keeps the values' sums
    c = tiny.cfg
    assert late.policy.fast_tier_bytes(late.state)["remainder"] == B * c.num_kv_heads * (c.head_dim * 4 + 8)
    # the layers before it decode as without the remainder: the first layer's output is the same
    off = _teacher(tiny, make_policy("infinigen", **dict(knobs, remainder=False)), tokens)
    on_all = _teacher(tiny, make_policy("infinigen", remainder_from=0, **knobs), tokens)
    on_late = _teacher(tiny, make_policy("infinigen", remainder_from=layers - 1, **knobs), tokens)
    assert not torch.equal(on_all, off) and not torch.equal(on_late, off) and not torch.equal(on_late, on_all)
