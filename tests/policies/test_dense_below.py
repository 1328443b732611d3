"""InfiniGen's `dense_below` ("sparse only where it pays"): a row with fewer cached tokens
than the knob reads every layer densely. A step whose every row is below it does no speculation at all and
takes the full cache's fused path (the same logits, bit for bit); a sequence that crosses the threshold
mid-decode selects exactly as teacher-forced scoring does; 0 selects everywhere, as before the knob."""
from __future__ import annotations

import json

import pytest
import torch

from infinigen import runtime
from infinigen.runtime import attention
from infinigen.errors import UserError
from infinigen.kernels.int4 import PackedKeys
from infinigen.placement import Placement
from infinigen.policies import crossing, make_policy
from infinigen.policies.infinigen import InfiniGen
from infinigen.policies.infinigen_calibration import candidate
from infinigen.policies.knobs import make_policy_from_cli
from infinigen.policies.speculation import SpeculationKeys
from infinigen.selection import ALL

T, P = 36, 12


from support.speculation import random_skew, random_tokens  # noqa: E402  InfiniGen's tests' skew and tokens


def _policy(model, **knobs):
    base = dict(alpha=1.0, max_fetch_ratio=0.3, min_fetch=0, dense_layers=(0,))
    return make_policy("infinigen", **(base | knobs)).with_skew(random_skew(model))


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
    scores, packed = SpeculationKeys.scores, PackedKeys.scores

    def counted_scores(self, *a, **kw):
        calls["scores"] += 1
        return scores(self, *a, **kw)

    def counted_packed(self, *a, **kw):
        calls["packed"] += 1
        return packed(self, *a, **kw)
    monkeypatch.setattr(SpeculationKeys, "scores", counted_scores)
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
    tokens = random_tokens(model)
    full, _ = _decode(model, make_policy("full"), tokens)
    calls = _count_speculation(monkeypatch)
    pol = _policy(model, key_mode=key_mode, exact_first=exact_first, dense_below=T)
    sess = Placement().new_session(model, 2, T, pol, listeners=[reads := _Reads(plans=True)])
    out = [runtime.prefill(model, tokens[:, :P], sess)]
    _count_queries(model, calls)  # the prefill's queries aside: decoding steps only from here
    fused = {"dense": 0}
    dense = attention.attend_all

    def attend_all(*a, **kw):
        fused["dense"] += 1
        return dense(*a, **kw)
    monkeypatch.setattr(attention, "attend_all", attend_all)
    for t in range(P, T - 1):
        out.append(runtime.decode(model, tokens[:, t], sess))
    assert calls == {"query": 0, "scores": 0, "packed": 0}  # no speculative query, no scoring
    # every layer took the fused dense call over the store in place, as the full cache does
    assert fused["dense"] == (T - 1 - P) * model.cfg.num_layers
    assert torch.equal(torch.stack(out, 1), full)
    assert reads.plans and all(p is ALL for p in reads.plans)  # placement would fetch everything
    assert all(r == "all" for rs in reads.seen.values() for r in rs)
    # nothing was packed for speculation while every step read densely (int4 keys are built at the crossing);
    # the paper's partial keys need the prompt's queries, so they are kept up to date from the prefill on
    st = sess.state
    if key_mode == "int4":  # nor were the remainder's value sums kept: summed from the store at the crossing
        assert st.lazy_keys and not st.spec_keys and not st.value_sums
    else:
        assert set(st.spec_keys) == st.spec_layers


@pytest.mark.parametrize("below, lazy", [(P, False), (P + 3, True)])
def test_a_prompt_at_the_crossing_packs_its_keys_at_prefill(make_tiny, below, lazy):
    """The int4 keys of a prompt that already reaches the crossing are packed by the prefill, as without a
    crossing, not inside the first decoding step (which would time them as decoding); a shorter prompt's wait
    for the step that crosses. At the crossing every decoding row selects, as with no crossing at all."""
    _, model = make_tiny("llama", num_hidden_layers=3)
    tokens = random_tokens(model)
    pol = _policy(model, key_mode="int4", dense_below=below)
    sess = Placement().new_session(model, 2, T, pol)
    runtime.prefill(model, tokens[:, :P], sess)
    st = sess.state
    assert st.lazy_keys is lazy and (not st.spec_keys if lazy else set(st.spec_keys) == st.spec_layers)
    out = [runtime.decode(model, tokens[:, t], sess) for t in range(P, T - 1)]
    if not lazy:
        everywhere, _ = _decode(model, _policy(model, key_mode="int4", dense_below=0), tokens)
        assert torch.equal(torch.stack(out, 1), everywhere[:, 1:])


# ---- crossing the threshold ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("key_mode,budget,exact_first,centre", [
    ("int4", "layer", False, False), ("partial", "mean", False, False), ("int4", "union", True, False),
    ("int4", "layer", True, True)])  # centred keys: the mean of the keys cached when the keys are first packed
def test_crossing_mid_decode_equals_teacher_forced(make_tiny, key_mode, budget, exact_first, centre):
    _, model = make_tiny("llama", num_hidden_layers=3)
    tokens = random_tokens(model)
    below = 20  # rows at positions 12..19 read densely, 20..34 select
    knobs = dict(key_mode=key_mode, budget=budget, exact_first=exact_first, dense_below=below, key_centre=centre)
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
    long_row, short_row = random_tokens(model, b=1, seed=4)[0], random_tokens(model, b=1, seed=5)[0, :T - 6]
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
    tokens = random_tokens(model)
    calls = _count_speculation(monkeypatch)
    off, _ = _decode(model, _policy(model, dense_below=0), tokens)
    steps = T - P - 1
    assert calls["scores"] == steps * 2  # layers 1 and 2, every step
    at_prompt, _ = _decode(model, _policy(model, dense_below=P), tokens)
    assert torch.equal(off, at_prompt)
    one_more, _ = _decode(model, _policy(model, dense_below=P + 1), tokens)
    assert not torch.equal(off[:, 1], one_more[:, 1])  # the first decoding row read densely there


# ---- the default preset's threshold: where selection pays, measured once per model and machine -----------------
def _crossing_policy(model, **knobs):
    base = dict(alpha=1.0, max_fetch_ratio=0.3, min_fetch=0, dense_layers=(0,), calibrate=False)
    return make_policy("infinigen", **(base | knobs)).with_skew(random_skew(model))


@pytest.fixture
def long_tiny(make_tiny, tmp_path, monkeypatch):
    """A tiny model with enough positions to be measured, and a cache of its own."""
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    return make_tiny("llama", num_hidden_layers=3, max_position_embeddings=2048)[1]


def _no_measuring(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("measured although a crossing was stored or set")
    monkeypatch.setattr(crossing, "measure", refuse)


def _fake_measuring(monkeypatch, below):
    """`measure` returns a record with this crossing and counts its calls (no timing in a test)."""
    calls = []

    def fake(model, policy, **kw):
        calls.append(model)
        return {"lengths": [64, 256], "full_ms": [1.0, 2.0], "policy_ms": [1.5, 1.5], "ratio": [1.5, 0.75],
                "dense_below": below, "seconds": 0.0}
    monkeypatch.setattr(crossing, "measure", fake)
    return calls


def test_a_stored_crossing_sets_the_threshold(long_tiny, monkeypatch):
    """Given a stored crossing, `prepare` reads it (no measurement): rows below it read ALL, rows from it on
    select, exactly as the knob set by hand to that value; the JSON says where the value came from."""
    model = long_tiny
    pol = _crossing_policy(model)
    assert pol.dense_below is None and pol.settings()["dense_below_source"] == "not prepared"
    crossing.store(crossing.crossing_key(model, pol), {"dense_below": 20, "lengths": [64], "ratio": [0.9]})
    _no_measuring(monkeypatch)
    pol = pol.prepare(model)
    s = pol.settings(model)
    assert pol.dense_below == 20 and s["dense_below"] == 20 and s["dense_below_source"] == "cached"
    assert s["crossing"]["ratio"] == [0.9]
    tokens = random_tokens(model)
    got = _Reads()
    out, _ = _decode(model, pol, tokens, listeners=[got])
    by_hand, _ = _decode(model, _crossing_policy(model, dense_below=20), tokens)
    assert torch.equal(out, by_hand)
    for layer, rows in got.seen.items():
        if layer == 0:
            continue  # a dense layer
        for r, read in enumerate(rows):
            if P + r < 20:
                assert read == "all", (layer, r)
            else:
                assert read != "all" and not read.all(), (layer, r)  # selected, and dropped entries


def test_an_explicit_knob_wins_over_the_stored_crossing(long_tiny, monkeypatch):
    model = long_tiny
    pol = _crossing_policy(model, dense_below=5)
    crossing.store(crossing.crossing_key(model, pol), {"dense_below": 30})
    _no_measuring(monkeypatch)
    pol = pol.prepare(model)
    assert pol.dense_below == 5 and pol.settings(model)["dense_below_source"] == "set"
    # not the default preset
    flat = make_policy("infinigen", preset="flat").with_skew(random_skew(model)).prepare(model)
    assert flat.dense_below == 0 and flat.settings(model)["dense_below_source"] == "preset"


def test_unlimited_crossing_is_the_full_cache(long_tiny, monkeypatch):
    """A crossing beyond every row (selection never pays here) reads every layer densely: the full cache's
    logits, bit for bit."""
    model = long_tiny
    _fake_measuring(monkeypatch, 2048)
    pol = _crossing_policy(model).prepare(model)
    assert pol.dense_below == 2048 and pol.settings(model)["dense_below_source"] == "measured"
    tokens = random_tokens(model)
    full, _ = _decode(model, make_policy("full"), tokens)
    out, _ = _decode(model, pol, tokens)
    assert torch.equal(out, full)


@pytest.mark.parametrize("stored", ["{not json", '{"dense_below": -4, "key": null}', "foreign", '"a string"'])
def test_a_corrupt_or_foreign_crossing_is_measured_again(long_tiny, monkeypatch, stored):
    model = long_tiny
    pol = _crossing_policy(model)
    key = crossing.crossing_key(model, pol)
    path = crossing._path(key)
    path.parent.mkdir(parents=True)
    if stored == "foreign":  # a valid record written for another machine under this file's name
        other = dict(key, machine=dict(key["machine"], cpu="another CPU"))
        path.write_text(json.dumps({"dense_below": 7, "key": other}))
    else:
        path.write_text(stored)
    calls = _fake_measuring(monkeypatch, 24)
    pol = pol.prepare(model)
    assert calls == [model]  # measured once
    assert pol.dense_below == 24 and pol.settings(model)["dense_below_source"] == "measured"
    assert crossing.load(key)["dense_below"] == 24  # stored over the bad file
    _no_measuring(monkeypatch)  # a later process reads it back
    assert crossing.measure_crossing(model, _crossing_policy(model)) | {"key": 0} == crossing.load(key) | {
        "key": 0, "source": "cached"}


def test_the_crossing_is_keyed_by_the_policy_and_the_model(long_tiny, make_tiny):
    model = long_tiny
    a = crossing.crossing_key(model, _crossing_policy(model))
    assert a == crossing.crossing_key(model, _crossing_policy(model, dense_below=100))  # not by the threshold
    assert a != crossing.crossing_key(model, _crossing_policy(model, alpha=2.0))
    other = make_tiny("llama", seed=9, num_hidden_layers=3, max_position_embeddings=2048)[1]
    assert a != crossing.crossing_key(other, _crossing_policy(other))
    assert {"cpu", "threads", "torch"} <= set(a["machine"])


def test_offloaded_store_selects_everywhere_under_a_measured_crossing(long_tiny, monkeypatch):
    """The crossing is measured with the KV in fast memory; an offloaded store keeps selecting (there the full
    cache moves every row), unless the caller set the knob."""
    model = long_tiny
    _fake_measuring(monkeypatch, 2048)
    pol = _crossing_policy(model).prepare(model)
    assert Placement().new_session(model, 1, 64, pol).state.dense_below == 2048
    assert Placement(kv_offload="cpu").new_session(model, 1, 64, pol).state.dense_below == 0
    set_by_hand = _crossing_policy(model, dense_below=2048)
    assert Placement(kv_offload="cpu").new_session(model, 1, 64, set_by_hand).state.dense_below == 2048


def test_short_models_are_not_measured(make_tiny, monkeypatch):
    _, model = make_tiny("llama", num_hidden_layers=3)  # 256 positions
    _no_measuring(monkeypatch)
    pol = _crossing_policy(model).prepare(model)
    assert pol.dense_below == 0 and pol.settings(model)["dense_below_source"].startswith("not measured")


def test_calibration_candidates_select_everywhere(long_tiny):
    model = long_tiny
    pol = _crossing_policy(model, dense_below=4096)
    assert candidate(pol, model, {"alpha": 3.0}, 0.5).dense_below == 0


@pytest.mark.parametrize("ratio,expected", [
    ([3.0, 2.0, 1.5], 8192),  # never pays: the whole context
    ([3.0, 1.5, 0.5], 2048 + round(0.5 * 6128)),  # between 2048 and 8176, where the line reaches 1
    ([1.5, 0.5, 0.4], 512 + round(0.5 * 1536)),
    ([0.9, 0.7, 0.5], 0),  # pays at 512 already: along the line through the first two points, at least 0
    ([0.98, 0.9, 0.5], 512 - round(0.02 * 1536 / 0.08)),
    ([0.9, 1.1, 0.8], 2048 + round(0.1 * 6128 / 0.3)),  # slower at 2048: only from there on
    ([0.8, 0.5, 1.2], 8192),  # slower at the longest length: never
    ([0.8, 0.9, 0.7], 512),  # pays everywhere, no slope to follow below the first length
])
def test_crossing_rule(ratio, expected):
    assert crossing.crossing_from([512, 2048, 8176], ratio, 8192) == expected


def test_measure_runs_on_synthetic_kv(long_tiny):
    """The measurement itself, on a tiny model between two short lengths: numbers, and a crossing within reach
    (which one depends on the machine: not asserted)."""
    model = long_tiny
    pol = _crossing_policy(model)
    got = crossing.measure(model, pol, lengths=[32, 96], steps=2)
    assert all(32 <= n <= 96 for n in got["lengths"]) and len(got["lengths"]) >= 2  # the middle and an end
    assert len(got["full_ms"]) == len(got["policy_ms"]) == len(got["pairs"]) == len(got["lengths"])
    assert all(x > 0 for x in got["full_ms"] + got["policy_ms"]) and all(1 <= p <= 2 for p in got["pairs"])
    assert 0 <= got["dense_below"] <= 2048
    assert pol.dense_below is None  # the policy measured is a copy selecting everywhere


def test_a_short_run_does_not_wait_for_the_measurement(long_tiny, monkeypatch):
    """A run that caches fewer tokens than the shortest length measured reads densely without measuring (a
    short chat's first token does not wait for it); the choice is not remembered, so a longer run in the same
    process measures; a stored crossing applies to a short run as to any."""
    model = long_tiny
    shortest = crossing.lengths_for(model)[0]
    _no_measuring(monkeypatch)
    pol = _crossing_policy(model).prepare(model, longest=shortest - 1)
    assert pol.dense_below == shortest
    assert pol.settings(model)["dense_below_source"].startswith("not measured (this run caches at most")
    tokens = random_tokens(model)
    full, _ = _decode(model, make_policy("full"), tokens)
    out, _ = _decode(model, pol, tokens)
    assert torch.equal(out, full)
    calls = _fake_measuring(monkeypatch, 24)
    pol = pol.prepare(model, longest=shortest)  # reaches the shortest length: measured
    assert calls == [model] and pol.dense_below == 24 and pol.settings(model)["dense_below_source"] == "measured"
    again = _crossing_policy(model)
    _no_measuring(monkeypatch)
    again = again.prepare(model, longest=8)  # known now: a short run uses it (this process remembers it, later ones
    assert again.dense_below == 24  # read it back)
    assert crossing.measure_crossing(model, again, longest=8)["source"] == "cached"


def test_calibrate_leaves_the_crossing_to_the_run_that_decodes(long_tiny, monkeypatch):
    """`infinigen calibrate` prepares with longest=0: its float32 search model is not the setup a command decodes
    in, so nothing is measured and nothing remembered; a later run in the same process measures its own."""
    model = long_tiny
    _no_measuring(monkeypatch)
    pol = _crossing_policy(model).prepare(model, longest=0)
    assert pol.settings(model)["dense_below_source"].startswith("not measured (it is measured by the first run")
    calls = _fake_measuring(monkeypatch, 24)
    assert _crossing_policy(model).prepare(model).dense_below == 24 and calls == [model]


def test_the_calibrate_command_measures_no_crossing(monkeypatch):
    """The command asks `prepare` for longest=0 (the case above)."""
    from infinigen.commands import calibrate as command
    from infinigen.policies.infinigen import InfiniGen
    asked = []

    def prepare(self, model, tokenizer=None, progress=False, longest=None, batch=1):
        asked.append(longest)
        raise SystemExit(0)
    monkeypatch.setattr(InfiniGen, "prepare", prepare)
    monkeypatch.setattr(command, "load_model", lambda *a, **k: (object(), None, "m"))
    with pytest.raises(SystemExit):
        command.calibrate(model="default", knob=[], force=False, out=None, as_json=True, device="cpu",
                          dtype="float32", weights="fp32")
    assert asked == [0]


def test_generate_tells_prepare_how_long_it_runs(make_tiny, monkeypatch):
    """`generate` passes the prompt plus the new tokens as the longest a session caches, and its batch."""
    from infinigen.generate import generate_ids
    seen = []
    pol = make_policy("full")
    monkeypatch.setattr(type(pol), "prepare", lambda self, model, tok=None, progress=False, longest=None, batch=1:
                        seen.append((longest, batch)) or self)
    generate_ids(make_tiny("llama")[1], [[1, 2, 3, 4, 5], [6, 7]], max_new_tokens=3, policy=pol)
    assert seen == [(5 + 3, 2)]


def test_a_fixed_batch_reads_densely_below_its_own_crossing(long_tiny, monkeypatch):
    """A run that decodes a batch of rows together is prepared with the crossing measured at that batch too:
    a session of that many rows (or more) reads densely below the batch's crossing, a session of fewer rows
    (a server's request: one) below the crossing of one row; decoding equals the knob set by hand to each."""
    model = long_tiny
    calls = []

    def fake(model, policy, lengths=None, batch=1, **kw):
        calls.append((batch, tuple(lengths)))
        below = {1: 40, 3: 20}[batch]
        return {"lengths": list(lengths), "full_ms": [1.0] * len(lengths), "policy_ms": [0.5] * len(lengths),
                "ratio": [0.5] * len(lengths), "dense_below": below, "seconds": 0.0}
    monkeypatch.setattr(crossing, "measure", fake)
    pol = _crossing_policy(model).prepare(model, batch=3, longest=300)
    assert [b for b, _ in calls] == [1, 3]
    assert max(calls[1][1]) <= 300 < max(calls[0][1])  # the batch measured only at the lengths the run reaches
    assert pol.crossing["by_batch"] == {"1": 40, "3": 20} and pol.dense_below == 40
    assert [pol.dense_below_at(r) for r in (1, 2, 3, 8)] == [40, 40, 20, 20]
    assert pol.prepare(model, batch=3, longest=300) is pol and len(calls) == 2  # prepared: as it is
    tokens = random_tokens(model)
    for rows, below in ((3, 20), (1, 40)):
        batch = tokens[:1].expand(rows, -1).contiguous()
        got = _Reads()
        out, _ = _decode(model, pol, batch, listeners=[got])
        by_hand, _ = _decode(model, _crossing_policy(model, dense_below=below), batch)
        assert torch.equal(out, by_hand), rows
        for layer, reads in got.seen.items():
            for r, read in enumerate(reads):
                if layer and P + r < below:
                    assert read == "all", (rows, layer, r)
                elif layer:
                    assert read != "all", (rows, layer, r)
