"""Calibration's structural fallback (policies/calibrate_fallback.py): where no candidate of the search reaches its
target, centred 4-bit keys and then the other ways of counting the budget are tried one at a time on the best
setting; the first that reaches the target is chosen, and the record (every command's JSON) and the warning say
which were tried and what each lost.

The candidates are scored by an injected scorer (their loss set by their keys and their way of counting the
budget, their KV share their caps' true one): a target only a structural option reaches, without building a
model that fails that way."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from support.models import attention_model
from infinigen.policies import calibrate as cal
from infinigen.policies.infinigen import _CHOICES, InfiniGen
from infinigen.policies.infinigen_calibration import _stored_choice, search_setup

REF = 64
BOUND = 0.8
TARGET = 0.01
FULL_NLL = 3.0


class ByteTokenizer:
    def __call__(self, text, verbose=False, **kw):
        return {"input_ids": [ord(c) % 256 for c in text]}


@pytest.fixture(scope="module")
def model():
    return attention_model(3.0)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("fallback") / "calibration.txt"
    path.write_text("the quick brown fox jumps over the lazy dog, " * 40)
    return path


def scored_by(monkeypatch, model, loss):
    """Candidates scored by `loss(policy)` (relative perplexity over the full cache), reading their caps' share."""
    def scorer(m, tokens, prefill, own_query, margin):
        def measure(pol):  # (NLL, KV share, tokens scored)
            return FULL_NLL + math.log1p(loss(pol)), cal.caps_share(pol, m, REF, REF // 8), REF - prefill
        return measure, FULL_NLL
    monkeypatch.setattr(cal, "_scorer", scorer)
    monkeypatch.setitem(_CHOICES, model, {})


def calibrated(model, text, **knobs):
    pol = InfiniGen(**(dict(calibrate=True, skew=False, budget_ref=REF, min_fetch=0, calibrate_text=str(text),
                            calibrate_bound=BOUND, calibrate_target=TARGET, remainder=False) | knobs))
    return pol.prepare(model, ByteTokenizer())


def test_centred_keys_are_tried_first_and_chosen_where_they_reach_the_target(model, text, monkeypatch, capsys):
    scored_by(monkeypatch, model, lambda pol: 0.002 if pol.key_centre else 0.05)
    pol = calibrated(model, text)
    rec = pol.settings(model)["calibration"]
    json.dumps(rec)
    assert rec["reached"] and rec["warning"] is None and "warning:" not in capsys.readouterr().err
    assert pol.key_centre is True and rec["chosen"]["key_centre"] is True
    # the search's own candidates all missed; the stage stopped at the first option that reached
    assert all(t["vs_full"] > TARGET for t in rec["trials"] if "key_centre" not in t["knobs"])
    assert [f["knobs"] for f in rec["fallbacks"]] == [{"key_centre": True}]
    assert rec["fallbacks"][0]["reached"] and rec["fallbacks"][0]["vs_full"] == pytest.approx(0.002)
    # the choice is the largest budget under the bound with the option on the best setting
    assert rec["kv"] <= BOUND + 1e-9


def test_the_budget_options_follow_on_the_best_setting(model, text, monkeypatch):
    """Centred keys lower the loss but miss; counting the budget per KV head ("union") on top of them reaches."""
    def loss(pol):
        return (0.03 if pol.key_centre else 0.05) - (0.025 if pol.key_centre and pol.budget == "union" else 0)
    scored_by(monkeypatch, model, loss)
    pol = calibrated(model, text)
    rec = pol.calibration
    assert rec["reached"] and pol.key_centre is True and pol.budget == "union"
    assert [f["knobs"] for f in rec["fallbacks"]] == [{"key_centre": True}, {"budget": "union"}]
    assert [f["reached"] for f in rec["fallbacks"]] == [False, True]
    assert rec["fallbacks"][0]["vs_full"] == pytest.approx(0.03)  # per_head was not needed: not tried
    assert "per_head" not in {t["knobs"].get("budget") for t in rec["trials"]}


def test_out_of_reach_the_warning_names_every_option_tried(model, text, monkeypatch, capsys):
    scored_by(monkeypatch, model, lambda pol: 0.04 - 0.01 * pol.key_centre - 0.005 * (pol.budget == "per_head"))
    pol = calibrated(model, text)
    rec = pol.settings(model)["calibration"]
    json.dumps(rec)
    assert not rec["reached"]
    assert [f["knobs"] for f in rec["fallbacks"]] == [{"key_centre": True}, {"budget": "union"},
                                                     {"budget": "per_head"}]
    assert [round(f["vs_full"], 6) for f in rec["fallbacks"]] == [0.03, 0.03, 0.025]
    # the lowest loss under the bound is kept: both options on
    assert pol.key_centre is True and pol.budget == "per_head" and rec["vs_full"] == pytest.approx(0.025)
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:")]
    assert line == f"warning: {rec['warning']}"
    assert "key_centre True +3.00%, budget union +3.00%, budget per_head +2.50%" in line


def test_a_caller_s_own_choices_are_not_tried_again(model, text, monkeypatch):
    """Keys already centred, and a budget set by hand: nothing structural left to try."""
    scored_by(monkeypatch, model, lambda pol: 0.05)
    rec = calibrated(model, text, key_centre=True, budget="layer").calibration
    assert not rec["reached"] and rec["fallbacks"] == []
    assert search_setup(InfiniGen(key_mode="partial", remainder=False), model)["keys"] == []


def test_where_the_search_reaches_its_target_the_stage_does_not_run(model, text, monkeypatch):
    scored_by(monkeypatch, model, lambda pol: 0.002)
    rec = calibrated(model, text).calibration
    assert rec["reached"] and rec["fallbacks"] == []
    assert all("key_centre" not in t["knobs"] and "budget" not in t["knobs"] for t in rec["trials"])


def test_a_stored_miss_from_before_the_stage_is_searched_again(model, text, monkeypatch):
    """A stored choice that missed its target and records no fallbacks came from a search without them (the key
    leaves the keys' options out, so the choices that reached theirs keep their keys): not reused."""
    scored_by(monkeypatch, model, lambda pol: 0.05)
    pol = InfiniGen(calibrate=True, skew=False, budget_ref=REF, min_fetch=0, calibrate_text=str(text),
                    calibrate_bound=BOUND, calibrate_target=TARGET, remainder=False)
    first = pol.prepare(model, ByteTokenizer()).calibration
    key, setup = first["key"], search_setup(pol, model)
    stored = _CHOICES[model][key][0].to_dict()
    assert stored["fallbacks"]

    def found(d):
        skew = SimpleNamespace(meta={f"calibration-{key}": json.dumps(d)}, shipped=False, computed_now=False)
        return _stored_choice(pol, model, skew, key, setup)[0]
    assert found(stored) is not None
    assert found({k: v for k, v in stored.items() if k != "fallbacks"}) is None
    assert found(stored | {"fallbacks": [{"knobs": {"block": 4}, "nll": 1.0, "kv": 0.1, "reached": False}]}) is None
