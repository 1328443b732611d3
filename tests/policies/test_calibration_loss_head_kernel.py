"""Calibration's loss head in C++ (`kernels.loss_head.row_nll`, which `calibrate.head_nll` calls without a softcap):
per bfloat16 logits row, its largest k ranked, those and the target's logit recomputed in float32, the target's NLL
as the float64 log-softmax of the same logits gives it; rows holding an infinite or NaN logit go torch's way; without
a build, the torch path serves."""
from __future__ import annotations


import pytest
import torch

from infinigen.kernels import loss_head
from infinigen.policies import calibrate as cal
from support.native import assert_failed_build_warns_once

needs_kernel = pytest.mark.skipif(not loss_head.available(), reason="no C++ compiler: the loss head kernel not built")

# (rows, vocab): odd row counts; vocabularies that are not a multiple of the vector width nor of the kernel's
# 512-logit blocks, one shorter than a block, one of whole blocks
SHAPES = [(1, 1037), (3, 517), (7, 2 * 512 + 13), (5, 300), (4, 1024)]


def problem(rows: int, vocab: int, d: int = 24, seed: int = 0, levels: int | None = None, scale: float = 1.0):
    """(logits bfloat16 [rows, vocab], h [rows, d], weight [vocab, d], targets): `levels` small integers as the logits
    (many equal ones: ties straddle the k-th), else h @ weight.T in bfloat16 (`scale`: of h); each row's max and a
    heavy logit placed in its last (partial) block and vector, where a kernel that skips them is seen."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, d, generator=g) * scale
    weight = torch.randn(vocab, d, generator=g) * 2.5 / d ** 0.5
    if levels is None:
        logits = h @ weight.T
    else:
        logits = torch.randint(0, levels, (rows, vocab), generator=g).float()
    logits[:, -1] = logits.amax(1) + 3  # the max in the last vector of the last block
    logits[:, -3] = logits[:, -1] - 0.5
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[0] = vocab - 1  # a target among the largest
    return logits.bfloat16(), h, weight, targets


def ranked(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest per row, larger first, equal ones the lower index first (a stable sort)."""
    return torch.sort(logits.float(), dim=1, descending=True, stable=True).indices[:, :k]


def float64_nll(logits, h, weight, targets, k: int) -> torch.Tensor:
    """What `row_nll` computes, in float64: the bfloat16 logits but the k largest and the target's, those h . w."""
    values = logits.double().clone()
    idx = torch.cat([ranked(logits, k), targets[:, None]], 1)
    values.scatter_(1, idx, torch.einsum("nd,nkd->nk", h.double(), weight.double()[idx]))
    return torch.logsumexp(values, 1) - values.gather(1, targets[:, None])[:, 0]


@needs_kernel
@pytest.mark.parametrize("rows,vocab", SHAPES)
@pytest.mark.parametrize("levels", [None, 7])
def test_the_kernel_ranks_as_a_stable_sort_and_scores_as_float64(rows, vocab, levels):
    logits, h, weight, targets = problem(rows, vocab, seed=rows + vocab, levels=levels)
    for k in (0, 1, 64, vocab):
        nll, top, finite = loss_head.row_nll(logits, h, weight, targets, k)
        assert finite.all()
        assert torch.equal(top, ranked(logits, k)), (k, levels)
        want = float64_nll(logits, h, weight, targets, k)
        assert torch.allclose(nll.double(), want, rtol=0, atol=2e-6), (k, (nll.double() - want).abs().max())


@needs_kernel
def test_large_logits_and_a_row_of_equal_ones():
    logits, h, weight, targets = problem(4, 777, seed=3, scale=1000.0)  # logits of thousands: most exp() are 0
    logits[2] = 5.0  # every logit equal: the k largest are the first k
    logits[3, :512] = -10000.0  # the max in a later block, thousands above the first block's
    nll, top, finite = loss_head.row_nll(logits, h, weight, targets, 64)
    assert finite.all() and torch.equal(top[2], torch.arange(64))
    assert torch.allclose(nll.double(), float64_nll(logits, h, weight, targets, 64), rtol=1e-6, atol=2e-6)


@needs_kernel
def test_a_row_with_an_infinite_or_nan_logit_is_left_to_torch():
    logits, h, weight, targets = problem(5, 600, seed=4)
    logits[1, 17], logits[2, 599], logits[3, 300] = float("-inf"), float("inf"), float("nan")
    _, _, finite = loss_head.row_nll(logits, h, weight, targets, 64)
    assert finite.tolist() == [True, False, False, False, True]


def head(rows: int, vocab: int, d: int = 48, seed: int = 0):
    """(h, weight, targets) of a trained model's range (logits up to 20-30; targets mostly likely ones)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, d, generator=g)
    weight = torch.randn(vocab, d, generator=g) * 6 / d ** 0.5
    likely = torch.multinomial(torch.softmax(h @ weight.T, -1), 1, generator=g)[:, 0]
    return h, weight, torch.where(torch.rand(rows, generator=g) < 0.8, likely, torch.randint(0, vocab, (rows,)))


@needs_kernel
def test_head_nll_moves_by_far_less_than_a_decision_s_margin_from_the_torch_path(monkeypatch):
    """`head_nll` with the kernel against its torch path: the same loss but for float32 summation order, the exp's
    2 ulp and which of equal bfloat16 logits straddling the 64th is recomputed (a logit's bfloat16 error, up to 0.06
    at 16-32, left on another of the row's tail): under 5e-4 a row, as close to the float64 loss on the mean, and
    under 3e-6 apart on the mean (Gemma 3's closest decision was 9e-4 of mean NLL from its target)."""
    h, weight, targets = head(301, 8192 + 5)
    low = weight.bfloat16()
    got = cal.head_nll(h, weight, low, targets)
    monkeypatch.setattr(loss_head, "enabled", False)
    want = cal.head_nll(h, weight, low, targets)
    diff = got.double() - want.double()
    assert diff.abs().max() < 5e-4 and abs(float(diff.mean())) < 3e-6
    exact = torch.nn.functional.cross_entropy(h.double() @ weight.double().T, targets, reduction="none")
    assert abs(float((got.double() - exact).mean())) < 2 * abs(float((want.double() - exact).mean())) + 1e-6


@needs_kernel
def test_head_nll_scores_a_non_finite_row_as_the_torch_path(monkeypatch):
    h, weight, targets = head(6, 1000, seed=1)
    h[2] = 1e30  # its bfloat16 logits overflow to +-inf
    h[4, 0] = float("nan")
    low = weight.bfloat16()
    got = cal.head_nll(h, weight, low, targets)
    monkeypatch.setattr(loss_head, "enabled", False)
    want = cal.head_nll(h, weight, low, targets)
    assert torch.equal(got[[2, 4]].isnan(), want[[2, 4]].isnan())
    assert torch.equal(got[[2, 4]].nan_to_num(), want[[2, 4]].nan_to_num())
    assert torch.allclose(got[[0, 1, 3, 5]], want[[0, 1, 3, 5]], rtol=0, atol=1e-4)


def test_without_a_build_the_torch_path_serves(monkeypatch):
    h, weight, targets = head(9, 700, seed=2)
    low = weight.bfloat16()
    monkeypatch.setattr(loss_head, "_module", lambda: None)
    assert not loss_head.available() and not loss_head.usable(low, None)
    monkeypatch.setattr(loss_head, "row_nll", lambda *a: pytest.fail("the kernel was called"))
    got = cal.head_nll(h, weight, low, targets)
    assert torch.isfinite(got).all()


def test_a_failed_build_warns_in_one_line(tmp_path):
    """No compiler: one warning line on stderr, `available()` False, nothing raised."""
    assert_failed_build_warns_once("loss_head", tmp_path)
