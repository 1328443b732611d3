"""Calibration's loss head (`calibrate.head_nll`): a large vocabulary's logits as a bfloat16 product, each row's
largest logits and its target's recomputed in float32, scores as the float32 log-softmax does; and a candidate's
rows enter its first selecting layer with the shared dense pass's hidden states (`calibrate.shared_layers`).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from support.models import attention_model, build_gemma
from infinigen.kernels import loss_head
from infinigen.policies import calibrate as cal
from infinigen.policies.infinigen import InfiniGen

REF = 96


def head(vocab: int, d: int = 64, rows: int = 300, spread: float = 6.0, seed: int = 0):
    """(h, weight, targets): logits of a trained model's range (a few reach 20-30), targets mostly likely ones."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, d, generator=g)
    weight = torch.randn(vocab, d, generator=g) * spread / d ** 0.5
    logits = h @ weight.T
    likely = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)[:, 0]
    anywhere = torch.randint(0, vocab, (rows,), generator=g)
    targets = torch.where(torch.rand(rows, generator=g) < 0.8, likely, anywhere)
    return h, weight, targets


def exact_nll(h, weight, targets, cap=None):
    logits = h @ weight.T
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return F.cross_entropy(logits, targets, reduction="none")


@pytest.mark.parametrize("cap", [None, 15.0])
def test_every_logit_recomputed_is_the_float32_log_softmax_loss(cap):
    h, weight, targets = head(512)
    got = cal.head_nll(h, weight, weight.bfloat16(), targets, cap, exact=512)
    assert torch.allclose(got, exact_nll(h, weight, targets, cap), atol=1e-5, rtol=0)


def test_the_bfloat16_tail_moves_the_loss_far_less_than_what_separates_candidates():
    """With each row's 64 largest logits and its target's in float32, the bfloat16 rounding of the rest moves
    a row's loss by under 0.01 and the mean by under 1e-4 (Gemma 3's closest decision was 9e-4 apart); without
    the recompute, several times more."""
    h, weight, targets = head(8192)
    want = exact_nll(h, weight, targets).double()
    low = weight.bfloat16()
    err = (cal.head_nll(h, weight, low, targets).double() - want)
    rough = (cal.head_nll(h, weight, low, targets, exact=0).double() - want)
    assert err.abs().max() < 0.01 and abs(float(err.mean())) < 1e-4
    assert rough.abs().max() > 4 * err.abs().max()


@pytest.fixture(scope="module")
def models():
    return [attention_model(3.0, num_hidden_layers=3), build_gemma(final_logit_softcapping=30.0)[1]]


def test_the_window_scores_with_the_bfloat16_head_as_with_the_float32_one(models, monkeypatch):
    tokens = torch.randint(0, 256, (1, REF), generator=torch.Generator().manual_seed(1))
    pol = InfiniGen(skew=False, budget_ref=REF, min_fetch=0, alpha=5.0, kv_budget=0.3, budget_growth=0.5,
                    calibrate=False, dense_below=0)
    for model in models:
        scores = {}
        for vocab in (10 ** 9, 1):  # the float32 head, then the bfloat16 one on this small vocabulary
            monkeypatch.setattr(cal, "BF16_HEAD_VOCAB", vocab)
            assert (cal._bf16_head(model) is None) == (vocab > 1)
            win = cal.window(model, tokens, REF // 8)
            scores[vocab] = (win.reference_nll, *cal.score_window(model, win, pol))
        (full32, nll32, kv32), (full16, nll16, kv16) = scores.values()
        assert full16 == pytest.approx(full32, abs=2e-4) and nll16 == pytest.approx(nll32, abs=2e-4)
        assert kv16 == kv32


def test_a_head_it_cannot_split_keeps_float32(monkeypatch):
    monkeypatch.setattr(cal, "BF16_HEAD_VOCAB", 1)
    plain, doubled = (attention_model(3.0, num_hidden_layers=3) for _ in range(2))
    assert cal._bf16_head(plain) is not None
    doubled.head = lambda h: doubled.lm_head(h) * 2  # a head that is not the final norm then the projection
    assert cal._bf16_head(doubled) is None


def float32_copy_nll(h, weight, low, targets, cap=None, exact=cal.HEAD_EXACT):
    """`head_nll` as written first: the float32 copy of the bfloat16 logits ranked, a fresh tensor per step,
    torch.logsumexp."""
    logits = (h.to(low.dtype) @ low.T).float()
    idx = torch.cat([logits.topk(exact, dim=-1).indices, targets[:, None]], 1)
    logits.scatter_(1, idx, torch.einsum("nd,nkd->nk", h.float(), weight[idx].float()))
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return torch.logsumexp(logits, -1) - logits.gather(1, targets[:, None])[:, 0]


@pytest.mark.parametrize("cap", [None, 15.0])
def test_reused_buffers_and_the_in_place_log_sum_exp_change_no_bit(cap, monkeypatch):
    """The head's logits written into buffers kept between calls (more rows, then fewer, then more again), ranked
    as bfloat16 and their log-sum-exp taken in place: the same bits as fresh tensors and torch.logsumexp (the torch
    path; the C++ one is compared with it in test_calibration_loss_head_kernel.py)."""
    monkeypatch.setattr(loss_head, "enabled", False)
    h, weight, targets = head(4096, rows=300)
    low = weight.bfloat16()
    buffers = {}
    for rows in (slice(0, 200), slice(200, 260), slice(100, 300)):
        got = cal.head_nll(h[rows], weight, low, targets[rows], cap, buffers=buffers)
        assert torch.equal(got, float32_copy_nll(h[rows], weight, low, targets[rows], cap)), rows
        assert torch.equal(got, cal.head_nll(h[rows], weight, low, targets[rows], cap))
    assert buffers["logits"].shape == (200, 4096)  # made for the first call's rows, reused while they suffice


def test_the_search_keeps_the_head_s_buffers_while_it_runs_and_drops_them_after(models, monkeypatch):
    """Every chunk of rows of a search (the shared pass and each candidate) reuses one set of buffers; after the
    search none is held (a 262k vocabulary's are ~0.8 GB)."""
    from infinigen.policies.infinigen_calibration import candidate, search_setup

    monkeypatch.setattr(cal, "BF16_HEAD_VOCAB", 1)
    model = models[0]
    seen = []
    head_nll = cal.head_nll
    monkeypatch.setattr(cal, "head_nll", lambda *a, buffers=None, **k: seen.append(buffers) or head_nll(
        *a, buffers=buffers, **k))
    pol = InfiniGen(calibrate=True, skew=False, budget_ref=REF, min_fetch=0, remainder=False)
    setup = search_setup(pol, model)
    tokens = torch.randint(0, 256, (1, REF), generator=torch.Generator().manual_seed(2))
    cal.search(model, tokens, REF // 8, lambda k: candidate(pol, model, k, setup["growth"]), setup["structures"],
               setup["alphas"], setup["budget_free"], 0.01, 0.8, setup["growth"], REF, "key", "text", max_evals=3)
    assert len(seen) > 3 and seen[0] is not None and all(b is seen[0] for b in seen)
    assert "low" in seen[0]
    assert getattr(cal._HEAD_BUFFERS, "held", None) is None
