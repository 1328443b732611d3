"""Calibration's scoring through the fused kernel (`infinigen_select.rows_fused`, `runtime.attend_rows`):
the teacher-forced rows of a candidate selected and attended per row in C++ score as the torch path does.

Tiny random Llama models as in test_calibrate.py: "peaked" (each head attends to about one entry) and "flat"
(every head spreads its attention evenly), the MLPs damped so that speculation works as on a trained model.
"""
from __future__ import annotations

import pytest
import torch

from support.calibration import calibration_tokens, selecting_policy
from support.models import attention_model, build_gemma
from infinigen.kernels import fused_select
from infinigen.placement import Placement
from infinigen.policies import calibrate as cal
from infinigen.policies import infinigen_select as select
from infinigen.selection import Rows

PROMPT = 12

pytestmark = pytest.mark.skipif(not fused_select.available(), reason="the fused kernel is not built here")


@pytest.fixture(scope="module")
def models():
    return [attention_model(scale, num_hidden_layers=3) for scale in (50.0, 0.0, 3.0)]


@pytest.fixture(scope="module")
def tokens():
    return calibration_tokens()


KNOBS = [dict(), dict(remainder=True, remainder_from=1), dict(kv_budget=0.08, remainder=True, remainder_from=0),
         dict(alpha=1.0, min_fetch=8), dict(exact_first=False, dense_layers=(0,), kv_budget=0.2)]


@pytest.mark.parametrize("knobs", KNOBS)
def test_fused_rows_score_as_the_torch_blocks(models, tokens, knobs, monkeypatch):
    """A candidate's window score (mean NLL, share read) is the same with the fused kernel as with the torch
    blocks, and the fused path is the one taken."""
    calls = []
    fused = select.rows_fused
    monkeypatch.setattr(select, "rows_fused", lambda *a, **k: calls.append(1) or fused(*a, **k))
    for model in models:
        win = cal.window(model, tokens, PROMPT)
        pol = selecting_policy(**knobs)
        calls.clear()
        got = cal.score_window(model, win, pol)
        assert calls, "the fused path was not taken"
        monkeypatch.setattr(fused_select, "enabled", False)
        want = cal.score_window(model, win, pol)
        monkeypatch.setattr(fused_select, "enabled", True)
        assert got[0] == pytest.approx(want[0], abs=1e-5) and got[1] == pytest.approx(want[1], abs=1e-6), knobs


def _selection(model, tokens, pol, layer: int):
    """The selection of every row after the prompt at `layer` ([1, Hkv, R, T] bool), the remainder's log-mass,
    and the packed rows where the fused kernel made it."""
    t = tokens.shape[1]
    sess = Placement().new_session(model, 1, t, pol, prompt_len=PROMPT)
    sess.state.rows_in_blocks = True
    positions = torch.arange(t)[None]
    sess.begin_teacher(positions, PROMPT)
    with torch.no_grad():
        h = model.embed(tokens, positions)
        rope = model.rope(positions)
        captured = {}

        def attend(i, q, k, v):
            if i == layer:
                cols = positions
                rows = Rows(first=PROMPT, positions=positions[:, PROMPT:], entry_pos=cols[None],
                            valid=(cols < positions[0, PROMPT:, None])[None, None], in_store=False,
                            query=q[:, :, PROMPT:], own_keys=k[:, :, PROMPT:], keys=k)
                captured["keep"] = sess.policy.keep(i, rows, sess)
                captured["lse"] = sess.policy.remainder_at(i, sess)
            return torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(q.shape[1] // k.shape[1], 1),
                                                                    v.repeat_interleave(q.shape[1] // k.shape[1], 1),
                                                                    is_causal=True)

        for block in model.layers[:layer + 1]:
            h = block(h, rope, attend, lambda *a: None)
    sess.store.close()
    return captured["keep"], captured["lse"]


def test_fused_rows_select_as_the_torch_blocks(models, tokens, monkeypatch):
    """Row by row the fused kernel keeps the entries the torch blocks keep, each row under its own cap, packs
    them head-major in the sequence's flat keys, and leaves the same mass unread."""
    pol = selecting_policy(kv_budget=0.15, remainder=True, remainder_from=0, min_fetch=2)
    for model in models:
        for layer in (0, 2):
            sel, lse = _selection(model, tokens, pol, layer)
            monkeypatch.setattr(fused_select, "enabled", False)
            keep, want_lse = _selection(model, tokens, pol, layer)
            monkeypatch.setattr(fused_select, "enabled", True)
            assert isinstance(sel, tuple) and hasattr(sel, "rows") and not isinstance(keep, tuple)
            t = tokens.shape[1]
            assert torch.equal(sel.keep.permute(1, 0, 2)[None], keep)
            assert torch.equal(sel.counts.T[None], keep.sum(-1))
            hkv = keep.shape[1]
            for r in (0, 7, t - PROMPT - 1):  # the packed rows are the kept entries of each head in order
                want = [kh * t + j for kh in range(hkv) for j in keep[0, kh, r].nonzero()[:, 0].tolist()]
                assert sel.rows[r, :len(want)].tolist() == want
                assert (sel.head[r, len(want):] == -1).all()
            assert torch.allclose(lse.lse, want_lse.lse, atol=1e-4, rtol=0)


def test_a_model_with_local_layers_scores_as_the_runtime(tokens, monkeypatch):
    """On a model mixing local window layers (read densely, one fused attention call) and global ones (selected
    by the fused kernel), the window score is the runtime's teacher-forced score."""
    calls = []
    fused = select.rows_fused
    monkeypatch.setattr(select, "rows_fused", lambda *a, **k: calls.append(1) or fused(*a, **k))
    _, model = build_gemma()
    win = cal.window(model, tokens, PROMPT)
    for knobs in (dict(), dict(remainder=True, remainder_from=1), dict(exact_first=False, kv_budget=0.2)):
        pol = selecting_policy(**knobs)
        nll, kv = cal.score(model, tokens, PROMPT, pol)
        got = cal.score_window(model, win, pol)
        assert got[0] == pytest.approx(nll, abs=1e-4) and got[1] == pytest.approx(kv, abs=1e-6), knobs
    assert calls
