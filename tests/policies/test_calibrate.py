"""Per-model calibration of InfiniGen's settings (`policies/calibrate.py`).

Two tiny random Llama models that differ only in their attention statistics: "peaked" (queries scaled up,
so each head attends to about one entry) and "flat" (queries zeroed, so every head spreads its attention
evenly). The MLPs are damped so that the residual after a layer's attention predicts the next layer's query
(speculation works as on a trained model). The peaked model keeps the full cache's loss with a few entries,
the flat one loses accuracy with any subset: calibration has to choose differently for them.
"""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import torch

from support.models import attention_model
from infinigen.errors import UserError
from infinigen.eval.ppl import perplexity
from infinigen.policies import calibrate as cal
from infinigen.policies.infinigen import _CHOICES, _SKEWS, InfiniGen
from infinigen.policies.infinigen_calibration import candidate, remainder_starts, search_setup
from infinigen.skew import Skew, remember

REF = 64  # calibration tokens (budget_ref): the first 8 are the prompt
BOUND = 0.8  # a tiny model's 64 tokens leave little to select from: a loose bound, still binding for "flat"
TARGET = 0.01


class ByteTokenizer:
    """Token ids from characters (the tiny models' vocabulary is 256)."""

    def __call__(self, text, verbose=False, **kw):
        return {"input_ids": [ord(c) % 256 for c in text]}




@pytest.fixture(scope="module")
def peaked():
    return attention_model(50.0)


@pytest.fixture(scope="module")
def flat():
    return attention_model(0.0)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    g = torch.Generator().manual_seed(5)
    letters = "abcdefghijklmnopqrstuvwxyz ,."
    body = "".join(letters[int(i)] for i in torch.randint(0, len(letters), (4000,), generator=g))
    path = tmp_path_factory.mktemp("calib") / "calibration.txt"
    path.write_text(body)
    return path


def calibrated(model, text, **knobs):
    """A calibrating InfiniGen on a tiny model (no skew: nothing to calibrate it on), prepared. Without the
    remainder: on the flat model the mean of the unread values is its attention itself, so no subset would
    miss the target and the search would not be tested."""
    pol = InfiniGen(**(dict(calibrate=True, skew=False, budget_ref=REF, min_fetch=0, calibrate_text=str(text),
                            calibrate_bound=BOUND, calibrate_target=TARGET, remainder=False) | knobs))
    return pol.prepare(model, ByteTokenizer())


def rescore(model, text, pol):
    """(relative perplexity vs the full cache, all-layer KV share) of `pol` on the calibration tokens, measured
    by the perplexity evaluation (not by the search's own scoring)."""
    tokens = cal.calibration_tokens(ByteTokenizer(), text.read_text(), REF)
    full = perplexity(model, None, None, None, prefill=REF // 8, tokens=tokens)
    res = perplexity(model, None, None, pol, prefill=REF // 8, tokens=tokens)
    return res.perplexity / full.perplexity - 1, res.kv_all


def test_reaches_the_target_within_the_bound(peaked, text):
    pol = calibrated(peaked, text)
    rec = pol.calibration
    assert rec["reached"] and rec["source"] == "computed"
    loss, kv = rescore(peaked, text, pol)
    assert loss <= TARGET + 1e-9
    assert kv <= BOUND + 1e-9
    assert kv == pytest.approx(rec["kv"], abs=1e-9) and loss == pytest.approx(rec["vs_full"], abs=1e-5)
    # the caps themselves hold the bound, here and at 4x the length (halved: growth 0.5)
    assert cal.caps_share(pol, peaked, REF, REF // 8) <= BOUND + 1e-9
    assert cal.caps_share(pol, peaked, 4 * REF, REF // 2) <= BOUND / 2 + 1e-9
    # it searched below the largest budget the bound allows: the cheapest setting that reached the target
    assert pol.kv_budget < max(t["knobs"].get("kv_budget", 0) for t in pol.calibration["trials"])


def test_respects_the_bound_when_the_target_is_out_of_reach(flat, text):
    pol = calibrated(flat, text, budget="layer")  # set: no other way of counting the budget is tried
    rec = pol.calibration
    assert not rec["reached"]
    loss, kv = rescore(flat, text, pol)
    assert loss > TARGET  # the flat model cannot keep its loss with a subset...
    assert kv <= BOUND + 1e-9  # ...and the bound still holds: accuracy never buys more entries
    assert cal.caps_share(pol, flat, REF, REF // 8) <= BOUND + 1e-9


def test_out_of_reach_tries_the_other_budgets_then_warns(flat, text, capsys):
    """Where no candidate reaches the target, the search tries counting the budget per KV head ("union",
    "per_head") instead of pooled over the layer before giving up; still out of reach, it says so in a warning
    line with the loss and what it chose, and the record (every command's JSON) has `reached` false, the loss
    and the warning. The budget set by hand: no other way is tried."""
    _CHOICES.pop(flat, None)
    pol = calibrated(flat, text, calibrate_bound=0.3)
    rec = pol.settings(flat)["calibration"]
    json.dumps(rec)
    tried = [t["knobs"].get("budget") for t in rec["trials"]]
    assert tried.count(None) >= 1 and {"union", "per_head"} <= set(tried)
    assert not rec["reached"] and rec["vs_full"] > TARGET and rec["warning"]
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("warning:")]
    assert "did not reach its target" in line and f"{100 * rec['vs_full']:+.2f}%" in line
    assert f"kv_budget {pol.kv_budget}" in line
    # the other budgets were worth trying: the pooled cap's best loses more than the choice
    pooled = min(t["vs_full"] for t in rec["trials"] if "budget" not in t["knobs"])
    assert rec["vs_full"] < pooled
    fixed = calibrated(flat, text, calibrate_bound=0.3, budget="layer").calibration
    assert all("budget" not in t["knobs"] for t in fixed["trials"]) and not fixed["reached"]
    assert "warning:" in capsys.readouterr().err
    reached = calibrated(flat, text)  # within reach: no warning
    assert reached.calibration["warning"] is None
    assert "warning:" not in capsys.readouterr().err


def test_calibrate_command_warns_when_out_of_reach(cli, tiny_checkpoint, text_file, tmp_path, monkeypatch):
    """`infinigen calibrate` on a target out of reach (the search asked for a perplexity half the full
    cache's: the tiny random model reaches any positive target): exit 0, one warning line on stderr with the
    loss, and the JSON's calibration says reached false with the loss and the warning."""
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    search = cal.search
    monkeypatch.setattr(cal, "search", lambda *a, **k: search(*a[:7], -0.5, *a[8:], **k))
    args = [a for k, v in _file_knobs(text_file).items() for a in ("--knob", f"{k}={v}")]
    code, stdout, err = cli("calibrate", "--model", tiny_checkpoint, *args, "--json")
    assert code == 0, err
    rec = json.loads(stdout)["calibration"]
    assert rec["reached"] is False and rec["vs_full"] > -0.5 and rec["warning"]
    assert {"union", "per_head"} <= {t["knobs"].get("budget") for t in rec["trials"]}
    (line,) = [x for x in err.splitlines() if x.startswith("warning:")]
    assert line == f"warning: {rec['warning']}" and f"{100 * rec['vs_full']:+.2f}%" in line


def test_different_attention_different_settings(peaked, flat, text):
    a, b = calibrated(peaked, text), calibrated(flat, text)
    assert a.calibration["chosen"] != b.calibration["chosen"]
    assert a.calibration["kv"] < b.calibration["kv"] - 0.2  # the peaked model reads much less


def test_the_remainder_is_chosen_where_it_helps(flat, text):
    """Left to calibration, the remainder is one more candidate: on the flat model the unread entries' mean
    value is what attention would have added, so the remainder reaches the target that no subset reaches
    alone, and is chosen; set by hand, no candidate changes it."""
    pol = calibrated(flat, text, remainder=None)
    rec = pol.calibration
    # tried from layer 0 and from the layer after the first selecting one, before the budget search
    starts = [t["knobs"].get("remainder_from") for t in rec["trials"] if t["knobs"].get("remainder")]
    assert set(starts) >= {0, 1}
    assert pol.remainder is True and rec["chosen"]["remainder"] is True and rec["reached"]
    assert rec["chosen"]["remainder_from"] in (0, 1)
    # the budget search ran with the remainder: the choice reads less than the bound's largest budget
    assert pol.kv_budget < max(t["knobs"]["kv_budget"] for t in rec["trials"])
    loss, kv = rescore(flat, text, pol)
    assert loss <= TARGET and kv <= BOUND + 1e-9
    assert all("remainder" not in t["knobs"] for t in calibrated(flat, text).calibration["trials"])


def test_the_default_preset_calibrates_and_falls_back_without_a_tokenizer(peaked, text, capsys):
    """The default preset calibrates in prepare(); where calibration cannot run (no tokenizer) it keeps the
    preset's values and says so in one line, while a caller who asked for calibration gets the error."""
    pol = InfiniGen(skew=False).prepare(peaked)
    assert pol.calibration is None and pol.alpha == 9.0 and pol.kv_budget == 0.13 and pol.budget_growth == 0.5
    assert "not calibrated" in capsys.readouterr().err
    with pytest.raises(UserError, match="tokenizer"):
        InfiniGen(skew=False, calibrate=True, budget_ref=REF).prepare(peaked)
    auto = InfiniGen(skew=False, budget_ref=REF, min_fetch=0, calibrate_text=str(text), calibrate_bound=BOUND)
    assert auto.prepare(peaked, ByteTokenizer()).calibration["source"] in ("computed", "cached")


def test_a_knob_set_by_hand_wins(peaked, text):
    pol = calibrated(peaked, text, alpha=3.5, exact_first=True, dense_layers=())
    assert pol.alpha == 3.5 and pol.exact_first is True and pol.dense_layers == ()
    assert pol.calibration["set"] == ["alpha", "dense_layers", "exact_first", "remainder"]
    assert set(pol.calibration["chosen"]) == {"kv_budget", "max_fetch_ratio", "budget_growth"}
    # every candidate tried kept them
    assert all("alpha" not in t["knobs"] and "exact_first" not in t["knobs"] for t in pol.calibration["trials"])
    # a cap set by hand is the bound: calibration does not choose the budget then
    capped = calibrated(peaked, text, max_fetch_ratio=0.5)
    assert capped.max_fetch_ratio == 0.5 and capped.kv_budget is None
    assert "kv_budget" not in capped.calibration["chosen"]


def test_prepare_returns_the_policy_built_from_the_record_and_leaves_the_caller_s_as_it_was(peaked, text,
                                                                                          monkeypatch):
    """Calibration produces a record; `prepare` returns a new policy built from the caller's knobs and that record
    (the same knob values, nothing rewritten afterwards), holds no reference to the model, and leaves the policy
    it was called on as it was. Prepared again for its model, it keeps its calibration without searching."""
    import weakref
    mine = InfiniGen(calibrate=True, skew=False, budget_ref=REF, min_fetch=0, calibrate_text=str(text),
                     calibrate_bound=BOUND, calibrate_target=TARGET, remainder=False)
    before = mine.settings(peaked)
    prepared = mine.prepare(peaked, ByteTokenizer())
    assert prepared is not mine and mine.calibration is None and mine.settings(peaked) == before
    assert prepared.calibration["chosen"] and prepared.settings(peaked) != before
    rebuilt = InfiniGen(**mine.requested, calibration=prepared.calibration, crossing=prepared.crossing)
    assert rebuilt.settings(peaked) == prepared.settings(peaked)
    assert not any(v is peaked or (isinstance(v, weakref.ref) and v() is peaked) for v in vars(prepared).values())
    monkeypatch.setattr(cal, "search", lambda *a, **k: pytest.fail("searched again for the model it was built for"))
    _CHOICES.clear()
    assert prepared.prepare(peaked, ByteTokenizer()).settings(peaked) == prepared.settings(peaked)


def test_off_keeps_the_preset(peaked):
    pol = InfiniGen(skew=False, calibrate=False).prepare(peaked, ByteTokenizer())
    assert pol.calibration is None and pol.alpha == 9.0 and pol.kv_budget == 0.13 and pol.exact_first
    assert "calibration" not in pol.settings(peaked)
    flat = InfiniGen(skew=False, preset="flat").prepare(peaked, ByteTokenizer())
    assert flat.calibration is None and flat.alpha == 7.0 and flat.max_fetch_ratio == 0.14 and flat.remainder


def test_recorded_in_settings(peaked, text):
    pol = calibrated(peaked, text)
    s = pol.settings(peaked)
    json.dumps(s)
    assert s["calibration"]["chosen"] == pol.calibration["chosen"]
    assert s["kv_budget"] == pol.kv_budget and s["alpha"] == pol.alpha


def _with_artifact(model, tmp_path):
    """A skew artifact on disk for `model` (random orthogonal matrices), set as its skew."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    m = torch.linalg.qr(torch.randn(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim,
                                    generator=g, dtype=torch.float64))[0].float()
    e = torch.ones(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    skew = Skew(m, e, e.clone(), {"format": "2"})
    skew.save(tmp_path / "skew.safetensors")
    return skew


def test_choice_round_trips_through_the_artifact(peaked, text, tmp_path, monkeypatch):
    skew = _with_artifact(peaked, tmp_path)
    _SKEWS[peaked] = {None: skew}
    _CHOICES.pop(peaked, None)
    try:
        first = InfiniGen(calibrate=True, budget_ref=REF, min_fetch=0, calibrate_text=str(text),
                          calibrate_bound=BOUND).prepare(peaked, ByteTokenizer())
        assert first.calibration["source"] == "computed"
        stored = Skew.load(skew.path)
        assert f"calibration-{first.calibration['key']}" in stored.meta
        # a new process: nothing in memory, the artifact read again; the search must not run
        _CHOICES.pop(peaked, None)
        _SKEWS[peaked] = {None: stored}
        monkeypatch.setattr(cal, "search", lambda *a, **k: pytest.fail("searched again"))
        again = InfiniGen(calibrate=True, budget_ref=REF, min_fetch=0, calibrate_text=str(text),
                          calibrate_bound=BOUND).prepare(peaked, ByteTokenizer())
        assert again.calibration["source"] == "cached"
        assert again.calibration["chosen"] == first.calibration["chosen"]
        assert again.settings(peaked) | {"calibration": None} == first.settings(peaked) | {"calibration": None}
    finally:
        _SKEWS.pop(peaked, None)
        _CHOICES.pop(peaked, None)


@pytest.mark.parametrize("damage", ["not json", "foreign key", "bad knob", "unknown knob", "nan"])
def test_broken_stored_choice_is_recomputed(peaked, text, tmp_path, damage):
    skew = _with_artifact(peaked, tmp_path)
    _SKEWS[peaked] = {None: skew}
    _CHOICES.pop(peaked, None)
    knobs = dict(calibrate=True, budget_ref=REF, min_fetch=0, calibrate_text=str(text), calibrate_bound=BOUND)
    try:
        first = InfiniGen(**knobs).prepare(peaked, ByteTokenizer())
        name = f"calibration-{first.calibration['key']}"
        good = json.loads(skew.meta[name])
        bad = {"not json": "{", "foreign key": json.dumps(good | {"key": "0" * 16}),
               "bad knob": json.dumps(good | {"knobs": good["knobs"] | {"kv_budget": 7.0}}),
               "unknown knob": json.dumps(good | {"knobs": good["knobs"] | {"block": 4}}),
               "nan": json.dumps(good | {"nll": float("nan")})}[damage]
        remember(skew, name, bad)
        _CHOICES.pop(peaked, None)
        _SKEWS[peaked] = {None: Skew.load(skew.path)}
        again = InfiniGen(**knobs).prepare(peaked, ByteTokenizer())
        assert again.calibration["source"] == "computed"  # not trusted
        assert again.calibration["chosen"] == first.calibration["chosen"]
        assert json.loads(Skew.load(skew.path).meta[name]) == good  # and written back whole
    finally:
        _SKEWS.pop(peaked, None)
        _CHOICES.pop(peaked, None)


def test_the_key_follows_the_search_settings(peaked, text):
    a = calibrated(peaked, text)
    b = calibrated(peaked, text, calibrate_target=0.05)
    c = calibrated(peaked, text, alpha=8.0)
    assert len({a.calibration["key"], b.calibration["key"], c.calibration["key"]}) == 3


def test_bad_calibration_knobs():
    for bad in (dict(calibrate_target=0.0), dict(calibrate_target=1.5), dict(calibrate_bound=0.0),
                dict(calibrate_bound=1.2), dict(calibrate="yes")):
        with pytest.raises(UserError):
            InfiniGen(**bad)


def test_needs_a_tokenizer_and_enough_text(peaked, tmp_path):
    with pytest.raises(UserError, match="tokenizer"):
        InfiniGen(calibrate=True, skew=False, budget_ref=REF, calibrate_bound=BOUND).prepare(peaked)
    short = tmp_path / "short.txt"
    short.write_text("only a few words")
    with pytest.raises(UserError, match="fewer than budget_ref"):
        InfiniGen(calibrate=True, skew=False, budget_ref=REF, calibrate_text=str(short)).prepare(
            peaked, ByteTokenizer())


def test_caps_share_matches_what_a_run_reads(peaked):
    """The bound is checked on the caps: with every entry over the threshold (alpha huge) a run reads exactly
    the caps, so `caps_share` is what the runtime measures."""
    tokens = torch.randint(0, 256, (1, REF), generator=torch.Generator().manual_seed(0))
    for knobs in (dict(exact_first=True, dense_layers=()), dict(exact_first=False, dense_layers=(0,))):
        pol = InfiniGen(skew=False, budget_ref=REF, min_fetch=0, alpha=1e9, kv_budget=0.4, budget_growth=0.5,
                        **knobs)
        _, kv = cal.score(peaked, tokens, REF // 8, pol)
        assert kv == pytest.approx(cal.caps_share(pol, peaked, REF, REF // 8), abs=1e-6)
        assert not math.isnan(kv)


@pytest.mark.parametrize("first", [REF // 8, REF - 24])
def test_the_window_scores_as_the_runtime(peaked, flat, first):
    """A candidate's score on the window (the rows from `first` on, the tokens before them computed once in a
    shared dense pass, its rows chosen a block at a time or row by row) is the runtime's teacher-forced score
    with a prompt of `first` tokens, for every way of counting the budget, with the remainder, with layer 0
    dense, with centred keys; the full cache's loss too."""
    tokens = torch.randint(0, 256, (1, REF), generator=torch.Generator().manual_seed(0))
    for model in (peaked, flat):
        win = cal.window(model, tokens, first)
        assert win.reference_nll == pytest.approx(cal.score(model, tokens, first, None)[0], abs=1e-5)
        for knobs in (dict(), dict(remainder=True, remainder_from=1, skew=True), dict(budget="union"),
                      dict(budget="per_head", alpha=2.0), dict(exact_first=False, dense_layers=(0,)),
                      dict(kv_budget=0.1, remainder=True, remainder_from=0, skew=True),
                      dict(key_centre=True, remainder=True, remainder_from=0, skew=True)):
            pol = InfiniGen(**(dict(skew=False, budget_ref=REF, min_fetch=0, alpha=5.0, kv_budget=0.3,
                                    budget_growth=0.5, calibrate=False, dense_below=0) | knobs))
            if pol.skew:
                pol.with_skew(_with_artifact(model, Path(tempfile.mkdtemp())))
            nll, kv = cal.score(model, tokens, first, pol)
            assert kv < 0.9
            for blocks in (True, False):  # (the tiny models' int4 scores are tiled matmuls: last bits may differ)
                got = cal.score_window(model, win, pol, blocks)
                assert got[0] == pytest.approx(nll, abs=1e-4) and got[1] == pytest.approx(kv, abs=1e-6), (knobs, blocks)


def test_the_fast_search_chooses_as_the_exhaustive_one(peaked, flat, text):
    """The search as `prepare` runs it (the full cache's loss and the prompt's keys and values from one shared
    dense pass, each candidate's rows chosen a block at a time) tries the same candidates, measures the same
    losses and chooses the same setting as the search scoring each candidate with the runtime's row-by-row
    teacher-forced pass."""
    tokens = cal.calibration_tokens(ByteTokenizer(), text.read_text(), REF)
    for model in (peaked, flat, attention_model(3.0)):
        pol = InfiniGen(calibrate=True, skew=False, budget_ref=REF, min_fetch=0, calibrate_bound=BOUND,
                        calibrate_target=TARGET)
        setup = search_setup(pol, model)
        assert setup["own_query"]

        def run(own_query):
            return cal.search(model, tokens, REF // 8, lambda k: candidate(pol, model, k, setup["growth"]),
                              setup["structures"], setup["alphas"], setup["budget_free"], TARGET, BOUND,
                              setup["growth"], REF, "key", "text", remainder_starts=lambda k: remainder_starts(
                                  pol, model, k, setup["growth"]), own_query=own_query,
                              budgets=tuple(setup["budgets"]))
        fast, exhaustive = run(True), run(False)
        assert fast.knobs == exhaustive.knobs and fast.reached == exhaustive.reached
        assert [t["knobs"] for t in fast.trials] == [t["knobs"] for t in exhaustive.trials]
        for a, b in zip(fast.trials, exhaustive.trials):
            assert a["nll"] == pytest.approx(b["nll"], abs=1e-5) and a["kv"] == pytest.approx(b["kv"], abs=1e-6)


def test_largest_budget_is_the_bound(peaked):
    """The budget the search starts from is the largest whose caps hold the bound at ref tokens and, halved,
    at 4x ref: a little more breaks one of them. Without a floor the run at 4x ref binds (the caps shrink with
    the bound); with `min_fetch` 8 the floor lifts the short rows of the run at ref, so that check binds alone."""
    def make(b, min_fetch=0, **knobs):
        return InfiniGen(skew=False, budget_ref=REF, min_fetch=min_fetch, alpha=9.0, kv_budget=b, budget_growth=0.5,
                         **knobs)
    exact, dense0 = dict(exact_first=True, dense_layers=()), dict(exact_first=False, dense_layers=(0,))
    floored = dict(exact, min_fetch=8)
    top = cal.largest_budget(lambda b: make(b, **floored), peaked, REF, 0.4, 0.5)
    assert cal.caps_share(make(top, **floored), peaked, 4 * REF, REF // 2) < 0.2 - 0.005  # the run at ref binds
    for bound, knobs in ((0.3, exact), (0.6, exact), (0.6, dense0), (0.4, floored)):
        top = cal.largest_budget(lambda b: make(b, **knobs), peaked, REF, bound, 0.5)
        assert cal.caps_share(make(top, **knobs), peaked, REF, REF // 8) <= bound + 1e-9
        assert cal.caps_share(make(top, **knobs), peaked, 4 * REF, REF // 2) <= bound / 2 + 1e-9
        over = make(top * 1.01, **knobs)
        assert (cal.caps_share(over, peaked, REF, REF // 8) > bound
                or cal.caps_share(over, peaked, 4 * REF, REF // 2) > bound / 2)
    # one dense layer of four reads 25%: no budget fits a 30% bound that is 15% at 4x the length
    assert cal.largest_budget(lambda b: make(b, dense_layers=(0,)), peaked, REF, 0.3, 0.5) is None


def test_ppl_records_the_choice(tiny_checkpoint, text_file, tmp_path, capsys):
    """`infinigen ppl` prints the choice and records it in its JSON; --calib (the skew's text) keeps the knobs
    left to calibration left."""
    from infinigen.cli import main
    out = tmp_path / "ppl.json"
    args = ["ppl", "--model", str(tiny_checkpoint), "--text", str(text_file), "--ctx", "64", "--prefill", "8",
            "--dtype", "float32", "--policy", "infinigen", "--knob", "calibrate=true", "--knob", "budget_ref=64",
            "--knob", f"calibrate_text={text_file}", "--knob", "calibrate_bound=0.8", "--knob", "min_fetch=0",
            "--knob", "alpha=8", "--calib", str(text_file), "--json", str(out)]
    assert main(args) == 0
    assert "InfiniGen calibrated" in capsys.readouterr().err
    res = json.loads(out.read_text())
    rec = res["settings"]["calibration"]
    assert rec["set"] == ["alpha"] and "kv_budget" in rec["chosen"] and "exact_first" in rec["chosen"]
    assert res["settings"]["kv_budget"] == rec["chosen"]["kv_budget"] and res["settings"]["alpha"] == 8.0
    assert res["kv_all"] <= 0.8 + 1e-9


# ---- one calibration per model file; shipped, cached, computed; `infinigen calibrate` ----------------------
def _file_knobs(text_file):
    """A calibrating InfiniGen for the tiny checkpoint: skew and search both on `text_file`."""
    return dict(calibrate=True, budget_ref=64, calibrate_text=str(text_file), calib=str(text_file),
                calibrate_bound=0.8, min_fetch=0)


def test_one_calibration_serves_float32_and_bfloat16(tiny_checkpoint, text_file, tmp_path, monkeypatch):
    """The settings chosen on the float32 load are the bfloat16 load's too: read from the artifact, no search."""
    from infinigen.loading import load
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    f32, tok, _ = load(tiny_checkpoint, dtype="float32", weights="fp32", progress=False)
    first = InfiniGen(**_file_knobs(text_file)).prepare(f32, tok)
    assert first.calibration["source"] == "computed"
    monkeypatch.setattr(cal, "search", lambda *a, **k: pytest.fail("calibrated again for another dtype"))
    bf16, _, _ = load(tiny_checkpoint, dtype="bfloat16", progress=False)
    again = InfiniGen(**_file_knobs(text_file)).prepare(bf16, tok)
    assert again.calibration["source"] == "cached"
    assert again.calibration["chosen"] == first.calibration["chosen"]
    assert len(list((tmp_path / "cache" / "skew").iterdir())) == 1


@pytest.mark.parametrize("args, needle", [
    (["--dtype", "float8"], "dtype"),
    (["--weights", "int3"], "--weights"),
    (["--device", "tpu"], "device"),
    (["--knob", "calibrate=false"], "calibrate"),
    (["--knob", "skew=false"], "skew"),
    (["--knob", "no_such_knob=1"], "no_such_knob"),
    (["--knob", "calibrate_target=2"], "target"),
    (["--knob", "calib=/no/such/text.txt"], "/no/such/text.txt"),
    (["--out", "calibration.json"], "--out"),
    (["--out", "/dev/null/x"], "--out"),
    (["--model", "/no/such/model"], "/no/such/model"),
])
def test_calibrate_command_bad_input(cli, tmp_path, monkeypatch, args, needle):
    """One line, exit 2, before the model loads (a missing model: when loading it)."""
    import infinigen.commands.calibrate as command
    from support.cli import one_line_error
    if "--model" not in args:
        monkeypatch.setattr(command, "load_model", lambda *a, **k: pytest.fail("loaded before the bad input"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    code, _, err = cli("calibrate", *args)
    one_line_error(code, err, needle)
    assert not (tmp_path / "cache" / "skew").exists()


def test_calibrate_command_computes_writes_and_ships(cli, tiny_checkpoint, text_file, tmp_path, monkeypatch):
    """`infinigen calibrate`: computed with a progress bar, then cached; `--out` writes the artifact that, put
    in the package's data/calibration, is the "shipped" calibration of an empty cache."""
    from infinigen import skew as skew_module
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    knobs = [a for k, v in _file_knobs(text_file).items() for a in ("--knob", f"{k}={v}")]
    out = tmp_path / "shipped"
    out.mkdir()
    code, stdout, err = cli("calibrate", "--model", tiny_checkpoint, *knobs, "--out", out, "--json")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["source"] == "computed" and "calibrating InfiniGen:" in err  # the bar: passes done, an ETA
    assert "pass/s" in err or "s/pass" in err
    written = Path(res["out"])
    assert written.parent == out and written.name == Path(res["artifact"]).name
    stored = Skew.load(written)
    assert f"calibration-{res['calibration']['key']}" in stored.meta and stored.meta["made_with"]
    code, stdout, _ = cli("calibrate", "--model", tiny_checkpoint, *knobs, "--json", "--dtype", "bfloat16",
                          "--weights", "auto")
    assert code == 0 and json.loads(stdout)["source"] == "cached"
    monkeypatch.setattr(skew_module, "shipped_calibration_dir", lambda: out)
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "empty"))
    code, stdout, _ = cli("calibrate", "--model", tiny_checkpoint, *knobs, "--json")
    again = json.loads(stdout)
    assert code == 0 and again["source"] == "shipped" and again["calibration"]["chosen"] == res["calibration"]["chosen"]
    assert not (tmp_path / "empty" / "skew").exists()
    # --force computes both again, whatever is shipped or cached
    code, stdout, _ = cli("calibrate", "--model", tiny_checkpoint, *knobs, "--json", "--force")
    assert code == 0 and json.loads(stdout)["source"] == "computed"


def test_calibrate_command_interrupted_leaves_nothing_half_written(cli, tiny_checkpoint, text_file, tmp_path,
                                                                   monkeypatch):
    """Ctrl-C during the search: exit 130; the cache holds the finished skew artifact only, with no choice in
    it, and no partial file; the next run computes the choice."""
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    knobs = [a for k, v in _file_knobs(text_file).items() for a in ("--knob", f"{k}={v}")]
    search = cal.search
    monkeypatch.setattr(cal, "search", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    code, _, err = cli("calibrate", "--model", tiny_checkpoint, *knobs, "--out", tmp_path / "out.safetensors")
    assert code == 130 and "interrupted" in err
    files = list((tmp_path / "cache" / "skew").iterdir())
    assert len(files) == 1 and not any(k.startswith("calibration-") for k in Skew.load(files[0]).meta)
    assert not (tmp_path / "out.safetensors").exists()
    monkeypatch.setattr(cal, "search", search)
    code, stdout, _ = cli("calibrate", "--model", tiny_checkpoint, *knobs, "--json")
    assert code == 0 and json.loads(stdout)["source"] == "computed"


def test_progress_callback_counts_passes_with_an_eta(peaked, text):
    """`prepare(..., progress=callback)` (a server's log): the reference and every candidate pass reported,
    done rising to the total, an ETA once a pass is done, none left at the end."""
    _CHOICES.pop(peaked, None)
    seen = []
    pol = InfiniGen(calibrate=True, skew=False, budget_ref=REF, min_fetch=0, calibrate_text=str(text),
                    calibrate_bound=BOUND, calibrate_target=TARGET, remainder=False)
    pol = pol.prepare(peaked, ByteTokenizer(), progress=lambda *a: seen.append(a))
    _CHOICES.pop(peaked, None)
    passes = [s for s in seen if s[0] == "calibrating InfiniGen"]
    done = [s[1] for s in passes]
    assert done[0] == 0 and passes[0][3] is None and done == sorted(done)
    assert done[-1] == passes[-1][2] == 1 + len(pol.calibration["trials"])  # the reference and each candidate
    assert all(s[3] is not None and s[3] >= 0 for s in passes[1:]) and passes[-1][3] == 0


def test_shipped_choice_found_behind_a_cached_skew_without_it(cli, tiny_checkpoint, text_file, tmp_path,
                                                               monkeypatch):
    """A cache holding this model's skew but not the choice (an interrupted calibration, an earlier version's
    artifact): the package's artifact that holds the choice is used, its matrices with it, never searched."""
    from infinigen import skew as skew_module
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    knobs = [a for k, v in _file_knobs(text_file).items() for a in ("--knob", f"{k}={v}")]
    out = tmp_path / "shipped"
    out.mkdir()
    code, _, err = cli("calibrate", "--model", tiny_checkpoint, *knobs, "--out", out)
    assert code == 0, err
    monkeypatch.setattr(skew_module, "shipped_calibration_dir", lambda: out)
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "user"))
    search = cal.search
    monkeypatch.setattr(cal, "search", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    code, _, _ = cli("calibrate", "--model", tiny_checkpoint, *knobs, "--force")
    assert code == 130  # the user's cache: the skew computed, no choice in it
    (cached,) = (tmp_path / "user" / "skew").iterdir()
    assert not any(k.startswith("calibration-") for k in Skew.load(cached).meta)
    monkeypatch.setattr(cal, "search", lambda *a, **k: pytest.fail("the shipped setting was searched again"))
    code, stdout, err = cli("calibrate", "--model", tiny_checkpoint, *knobs, "--json")
    assert code == 0 and json.loads(stdout)["source"] == "shipped", err
    monkeypatch.setattr(cal, "search", search)


@pytest.mark.integration
def test_the_default_model_finds_its_shipped_choice_in_an_empty_cache(default_model, monkeypatch, tmp_path):
    """The package's artifact answers the default InfiniGen of the default model with an empty cache, with no
    search: a choice's key that moves (a knob added at its default, a setting renamed) makes every first user of
    `--policy infinigen` calibrate for minutes."""
    from infinigen import paths
    from infinigen.eval.policyset import prepare
    from infinigen.policies import make_policy
    model, tok = default_model
    monkeypatch.setattr(paths, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(cal, "search", lambda *a, **k: pytest.fail("searched: the shipped choice was not found"))
    monkeypatch.setitem(_CHOICES, model, {})
    monkeypatch.setitem(_SKEWS, model, {})
    prepared = prepare({"infinigen": make_policy("infinigen", dense_below=0)}, model, tok)["infinigen"]
    assert prepared.calibration["source"] == "shipped"
    assert not any(tmp_path.iterdir())  # nothing written to the cache
