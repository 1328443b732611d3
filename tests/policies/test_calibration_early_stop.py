"""Calibration's candidates scored in blocks of rows and stopped once they certainly miss the target
(`calibrate.score_rows`, policies/calibrate_stop.py).

Tiny random Llama models as in test_calibrate.py ("peaked": each head attends to about one entry; "flat": every
head spreads its attention evenly; the MLPs damped so that speculation works as on a trained model) and a tiny
Gemma 3 (local window layers and global ones).
"""
from __future__ import annotations

import math

import pytest
import torch

from support.calibration import REF, calibration_tokens, selecting_policy
from support.models import attention_model, build_gemma
from infinigen.policies import calibrate as cal
from infinigen.policies import calibrate_stop as stop_rule
from infinigen.policies.infinigen import _CHOICES, InfiniGen
from infinigen.policies.infinigen_calibration import candidate, remainder_starts, search_setup

PROMPT = 12
TOTAL = REF - PROMPT  # the window's tokens
BLOCK = 16


@pytest.fixture(scope="module")
def models():
    return {"peaked": attention_model(50.0, num_hidden_layers=3), "flat": attention_model(0.0, num_hidden_layers=3),
            "gemma": build_gemma()[1]}


@pytest.fixture(scope="module")
def tokens():
    return calibration_tokens()


KNOBS = [dict(), dict(remainder=True, remainder_from=0, kv_budget=0.1), dict(remainder=True, remainder_from=1),
         dict(exact_first=False, dense_layers=(0,), kv_budget=0.2), dict(budget="union"), dict(alpha=1.0, min_fetch=8)]


@pytest.mark.parametrize("knobs", KNOBS)
@pytest.mark.parametrize("blocks", [True, False])
def test_blocks_of_rows_score_as_one_pass(models, tokens, knobs, blocks):
    """A candidate's rows run a block at a time through every layer (each block reading the keys and values of the
    rows before it) give the loss and the reads of one pass over every row, with the fused kernel, the torch blocks
    or row by row."""
    for name, model in models.items():
        win = cal.window(model, tokens, PROMPT)
        pol = selecting_policy(**knobs)
        whole = cal.score_rows(model, win, pol, blocks, block_rows=REF)
        for rows in (BLOCK, 7):
            got = cal.score_rows(model, win, pol, blocks, block_rows=rows)
            assert got.rows == whole.rows == TOTAL
            assert got.nll == pytest.approx(whole.nll, abs=1e-5), (name, knobs, rows)
            assert got.kv == pytest.approx(whole.kv, abs=1e-6), (name, knobs, rows)


@pytest.fixture
def small_test(monkeypatch):
    """The stopping rule on a tiny model's 84 tokens: at least 32 tokens, batches of 4, blocks of 16 rows."""
    monkeypatch.setattr(stop_rule, "MIN_ROWS", 32)
    monkeypatch.setattr(stop_rule, "BATCH", 4)
    monkeypatch.setattr(cal, "BLOCK_ROWS", BLOCK)


def _first_end_past(min_rows: int) -> int:
    """The tokens scored at the end of the first block after which at least `min_rows` are (a block's rows
    score the token after each)."""
    end = PROMPT
    while end - PROMPT + 1 < min_rows:
        end += BLOCK
    return end - PROMPT + 1


def test_a_far_miss_stops_early_and_a_close_one_runs_to_the_end(models, tokens, small_test):
    """Against a target the candidate misses by far, its pass stops after the first block past the minimum of
    tokens, with its loss estimated from them; against a margin at its own loss over the whole window (as close as
    a candidate can be), or one it passes by far, it runs to the end with the loss of the pass that never stops."""
    for name, model in models.items():
        win = cal.window(model, tokens, PROMPT)
        for knobs in KNOBS[:3]:
            pol = selecting_policy(**knobs)
            whole = cal.score_rows(model, win, pol)
            diff = whole.nll - win.reference_nll
            far = cal.score_rows(model, win, pol, stop=lambda d: stop_rule.misses_certainly(d, TOTAL, diff - 2.0))
            assert far.rows == _first_end_past(32), (name, knobs)
            assert abs(far.nll - whole.nll) < 2.0
            for margin in (diff, diff + 1.0):
                ran = cal.score_rows(model, win, pol, stop=lambda d: stop_rule.misses_certainly(d, TOTAL, margin))
                assert ran.rows == TOTAL and ran.nll == whole.nll and ran.kv == whole.kv, (name, knobs, margin)


def test_the_search_records_the_tokens_each_candidate_scored(models, tokens, small_test):
    """The search as `prepare` runs it: under a target every candidate misses by far, each candidate of its
    own search stops early (the structural options after it too, but centred keys: one block) and the choice
    records how many tokens each scored; under a target within reach, the candidates that reach it run to the
    end."""
    model = models["flat"]
    pol = InfiniGen(calibrate=True, skew=False, budget_ref=REF, min_fetch=0, calibrate_bound=0.8)
    setup = search_setup(pol, model)

    def run(target):
        growth = setup["growth"]
        return cal.search(model, tokens, PROMPT, lambda k: candidate(pol, model, k, growth), setup["structures"],
                          setup["alphas"], setup["budget_free"], target, 0.8, growth, REF, "key", "text",
                          remainder_starts=lambda k: remainder_starts(pol, model, k, growth),
                          budgets=tuple(setup["budgets"]), key_options=tuple(setup["keys"]))

    missed = run(-0.9)  # the full cache's perplexity cut tenfold: out of reach
    assert not missed.reached and missed.trials
    for t in missed.trials:
        if t["knobs"].get("key_centre"):
            assert t["rows"] == TOTAL, t
        else:
            assert _first_end_past(32) <= t["rows"] < TOTAL, t
    reached = run(1.0)
    assert reached.reached
    for t in reached.trials:
        assert t["rows"] == TOTAL or t["nll"] > reached.reference_nll + math.log1p(1.0), t


def test_the_rule_stops_a_far_miss_at_the_minimum_and_never_a_close_one():
    """On per-token differences whose neighbours correlate: a far miss stops once the minimum of tokens is
    scored and not before; a candidate missing by a hair, one exactly at the margin and one passing never stop;
    with every token scored the bound is their mean."""
    total, margin = 1792, math.log1p(0.005)
    gen = torch.Generator().manual_seed(0)

    def series(mean: float, sd: float = 0.05) -> torch.Tensor:
        noise = torch.randn(total, generator=gen, dtype=torch.float64) * sd
        for i in range(1, total):  # AR(1), phi 0.5
            noise[i] += 0.5 * noise[i - 1]
        return noise - noise.mean() + mean

    far = series(0.03)
    assert not stop_rule.misses_certainly(far[:stop_rule.MIN_ROWS - 1], total, margin)
    assert stop_rule.misses_certainly(far[:stop_rule.MIN_ROWS], total, margin)
    for mean in (margin + 0.0005, margin, 0.0):
        d = series(mean)
        assert not any(stop_rule.misses_certainly(d[:n], total, margin) for n in range(256, total, 256)), mean
    assert stop_rule.lower_bound(far, total, 0.999, 32) == pytest.approx(float(far.mean()), abs=1e-12)


def test_a_stopped_miss_is_a_miss_at_the_stated_confidence():
    """Over many correlated sequences whose whole mean sits just below the margin (they reach the target), the rule
    stops (wrongly) at most about the stated 0.1% of them, looking after every block."""
    total, margin, sims = 1792, 0.005, 400
    gen = torch.Generator().manual_seed(1)
    noise = torch.randn(sims, total, generator=gen, dtype=torch.float64) * 0.1
    for i in range(1, total):
        noise[:, i] += 0.5 * noise[:, i - 1]
    d = noise - noise.mean(1, keepdim=True) + margin - 1e-4
    looks = stop_rule.looks_of(total, 256)
    assert looks == 5
    wrong = sum(any(stop_rule.misses_certainly(d[s, :n], total, margin, looks) for n in range(512, total, 256))
                for s in range(sims))
    assert wrong <= 2


def test_the_t_quantile():
    """Student's t quantiles at 99.9% and 99.99% (tables: df 15 3.733 and 4.880, df 30 3.385 and 4.234, df 120
    3.160 and 3.837)."""
    for df, want, far in ((15, 3.733, 4.880), (30, 3.385, 4.234), (120, 3.160, 3.837)):
        assert stop_rule.t_quantile(0.999, df) == pytest.approx(want, rel=0.005)
        assert stop_rule.t_quantile(0.9999, df) == pytest.approx(far, rel=0.005)


class ByteTokenizer:
    """Token ids from characters (the tiny models' vocabulary is 256)."""

    def __call__(self, text, verbose=False, **kw):
        return {"input_ids": [ord(c) % 256 for c in text]}


def test_a_stopped_miss_is_held_to_the_bound_on_its_caps(monkeypatch, tmp_path):
    """Where nothing reaches the target, the lowest loss under the bound wins; a stopped candidate is held to the
    bound on its caps, not on what its first rows read (a shorter past: a larger share read)."""
    model = attention_model(3.0)
    text = tmp_path / "calibration.txt"
    text.write_text("the quick brown fox jumps over the lazy dog, " * 40)

    def scorer(m, tokens, prefill, own_query, margin):
        total = tokens.shape[1] - prefill

        def measure(pol):  # layer 0 read densely: the lower loss, stopped early, its first rows over the bound
            dense = 0 in pol.dense_layers
            return 2.0 + (0.1 if dense else 0.2), 0.99 if dense else 0.1, total // 2 if dense else total
        return measure, 2.0

    monkeypatch.setattr(cal, "_scorer", scorer)
    monkeypatch.setitem(_CHOICES, model, {})
    pol = InfiniGen(calibrate=True, skew=False, budget_ref=64, min_fetch=0, calibrate_text=str(text),
                    calibrate_bound=0.7, calibrate_target=0.01, remainder=False).prepare(model, ByteTokenizer())
    assert not pol.calibration["reached"]
    assert pol.calibration["chosen"]["dense_layers"] == [0]
    assert {t["rows"] for t in pol.calibration["trials"]} == {56, 28}
