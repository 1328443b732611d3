"""InfiniGen's knob `rerank`: the 4-bit keys choose `rerank` times the cap as candidates, the exact keys and the
layer's own query the cap's best of them. Checked here: decoding equals teacher-forced scoring; the same number
of entries is read as without it; with an unlimited budget it is the dense result; it ranks closer to the true
top entries than the 4-bit cut alone; knobs it cannot work with are refused."""
from __future__ import annotations

import pytest
import torch

from infinigen.errors import UserError
from infinigen.placement import Placement
from infinigen.policies import make_policy

from policies.test_own_query import LIMITED, P, _decode, _teacher, _tokens

RERANKED = dict(LIMITED, query="own", rerank=1.5)


@pytest.mark.parametrize("remainder", [False, True])
@pytest.mark.parametrize("offloaded", [False, True])
def test_decoding_with_a_rerank_equals_teacher_forced_scoring(tiny, remainder, offloaded):
    """Offloaded (query "auto": corrected), layer 0's selection is made at the embedding with its exact query and
    each later layer's plan a layer ahead with the speculated one: the re-rank takes the exact query there, and
    at each later layer the own one only (the attention's correction), so decoding is the in-RAM selection."""
    tokens = _tokens(tiny)
    knobs = dict(RERANKED, remainder=remainder and not offloaded, remainder_from=0,
                 query="auto" if offloaded else "own")
    scored = _teacher(tiny, make_policy("infinigen", **knobs), tokens)
    placement = Placement("cpu", read_in_place=False) if offloaded else None
    decoded, _ = _decode(tiny, make_policy("infinigen", **knobs), tokens, placement)
    torch.testing.assert_close(decoded[:, 1:], scored[:, P:], rtol=1e-4, atol=1e-4)


def test_a_rerank_reads_as_many_entries_and_changes_which(tiny):
    tokens = _tokens(tiny)
    _, plain = _decode(tiny, make_policy("infinigen", **LIMITED, query="own"), tokens)
    out, reranked = _decode(tiny, make_policy("infinigen", **RERANKED), tokens)
    assert reranked.stats.per_step()["entries_attended"] == plain.stats.per_step()["entries_attended"]
    # the candidates' keys are read too: half an entry each, about (rerank - 1) / 2 of the selection more (the
    # candidates' count rounded up: a little more on this short sequence); whole entries would be twice that
    more = reranked.stats.overall() / plain.stats.overall()
    assert 1.0 < more < 1 + (RERANKED["rerank"] - 1) / 2 + 0.05
    dense, _ = _decode(tiny, make_policy("full"), tokens)
    assert not torch.equal(out, dense)  # still a selection


def test_a_rerank_with_an_unlimited_budget_is_the_dense_result(tiny):
    tokens = _tokens(tiny)
    out, _ = _decode(tiny, make_policy("infinigen", **dict(RERANKED, max_fetch_ratio=1.0)), tokens)
    dense, _ = _decode(tiny, make_policy("full"), tokens)
    torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-4)


def test_a_rerank_ranks_closer_to_the_true_top_entries(make_tiny):
    from infinigen.eval.analyze import selection_recall
    _, model = make_tiny("llama", num_hidden_layers=2)
    with torch.no_grad():
        for blk in model.layers:
            blk.attn.q_proj.weight.mul_(4.0)
    ids = torch.randint(3, 250, (1, 160), generator=torch.Generator().manual_seed(2))
    knobs = dict(LIMITED, query="own", max_fetch_ratio=0.2)
    forms = {"in_ram": Placement()}
    plain = selection_recall(model, ids, make_policy("infinigen", **knobs), 32, forms=forms)["in_ram"]
    plain, plain_kv = plain["mean"], plain["kv"]
    reranked = selection_recall(model, ids, make_policy("infinigen", **knobs, rerank=2.0), 32, forms=forms)
    assert reranked["in_ram"]["mean"]["recall"] > plain["recall"] + 0.02
    assert reranked["in_ram"]["mean"]["read_share"] == pytest.approx(plain["read_share"])
    assert reranked["in_ram"]["kv"] > plain_kv  # the candidates' keys counted


@pytest.mark.parametrize("knobs", [dict(rerank=0.5), dict(rerank=1.5, budget="union"),
                                   dict(rerank=1.5, block=16)])
def test_knobs_a_rerank_cannot_work_with_are_refused(knobs):
    with pytest.raises(UserError):
        make_policy("infinigen", **knobs).validate()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, hkv, g", [(1, 3, 3), (3, 2, 7), (3, 1, 4)])
def test_the_native_rerank_equals_its_torch_reference(monkeypatch, b, hkv, g, dtype):
    """`kernels.rerank.rerank_rows` (C++) against `rerank_cut`'s torch calls: the same kept pairs, packed rows,
    counts and dropped candidates, the unread log-mass within float32 rounding; a batch row with fewer candidates
    than its size keeps them all, one with none keeps none."""
    from infinigen.kernels import rerank
    from infinigen.policies.infinigen_rerank import rerank_cut
    if not rerank.usable(torch.zeros(1, dtype=dtype), torch.zeros(1, dtype=dtype)):
        pytest.skip("the native re-rank is not built here")
    n, d, capacity = 300, 64, 320
    gen = torch.Generator().manual_seed(b * 100 + g)
    cand = torch.rand(b, hkv, n, generator=gen) < 0.3
    q = torch.randn(b, hkv, g, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, capacity, d, generator=gen).to(dtype)
    unread = torch.randn(b, hkv, g, generator=gen) * 4 + 6  # heads whose unread mass differs widely
    unread[0, 0, 0] = float("-inf")
    size = (cand.sum((1, 2)) * 0.8).long()  # row 0 cut to 80% of its candidates
    if b > 1:
        cand[1, :, : n // 2] = False
        size[1] = cand[1].sum() + 5  # more than its candidates
    if b > 2:
        cand[2] = False  # a batch row with no candidate
    native = rerank_cut(cand, q, k, 0.125, size, unread, capacity)
    monkeypatch.setattr(rerank, "enabled", False)
    reference = rerank_cut(cand, q, k, 0.125, size, unread, capacity)
    for name, got, want in zip(("keep", "rows", "head", "counts", "lse", "beside"), native, reference):
        if name == "lse":
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, want), name
    assert bool((native[0].sum((1, 2)) == torch.minimum(size, cand.sum((1, 2)))).all())


def test_decoding_with_the_torch_rerank_equals_teacher_forced_scoring(tiny, monkeypatch):
    from infinigen.kernels import rerank
    monkeypatch.setattr(rerank, "enabled", False)
    tokens = _tokens(tiny)
    knobs = dict(RERANKED, remainder=True, remainder_from=0)
    scored = _teacher(tiny, make_policy("infinigen", **knobs), tokens)
    decoded, _ = _decode(tiny, make_policy("infinigen", **knobs), tokens)
    torch.testing.assert_close(decoded[:, 1:], scored[:, P:], rtol=1e-4, atol=1e-4)
