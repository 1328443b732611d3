"""InfiniGen's layer-capped selection as one C++ call (`fused_select.select_packed`: from the speculated scores
to the packed rows and the remainder's log-sum-exp) against the torch path it replaces (`InfiniGen._choose`
with budget "layer", `KVStore.select_rows`, `infinigen_select.remainder_lse`): the same cut on random float32 scores
(G 1, 3 and 7; the cap binding or not; ties), and in decoding sessions the same selections and logits; the
checks fail when a row is dropped, the cap is wrong or the remainder is stale.

The cut's masses are float32 sums that the kernel orders differently from torch: the selections must be equal
except for pairs whose masses lie within a relative 1e-6 of the cut's mass (counted; none in these cases)."""
from __future__ import annotations

import pytest
import torch

from infinigen import runtime
from infinigen.cache import KVStore
from infinigen.kernels import fused_select
from infinigen.placement import Placement
from infinigen.policies import make_policy
from infinigen.policies.cuts import remainder_lse
from support.packed_rows import P, T, first_row_dropped
from support.packed_rows import Selections as _Seen
from support.speculation import random_skew as _mats

needs_kernel = pytest.mark.skipif(not fused_select.available(), reason="the fused kernel cannot be built here")
NEAR_TIE = 1e-6  # relative difference of two masses at the cut that float32 summation order may flip


def _reference(pol, scores, scale, alpha, ratio, capacity, rest=True):
    """The torch path: keep [B, Hkv, n], `SelectedRows`, the unread log-sum-exp [B, Hkv, G] and the cut's
    masses [B, Hkv, n] (the speculated attention summed over the group)."""
    b, hkv, g, n = scores.shape
    s = scores[:, :, :, None] * scale
    valid = torch.ones(b, hkv, 1, n, dtype=torch.bool)
    keep = pol._choose(s.clone(), valid, alpha, n, ratio)
    lse = remainder_lse(s, valid & ~keep)[..., 0] if rest else None
    keep = keep[:, :, 0]
    store = KVStore(1, b, hkv, capacity, 4, torch.float32)
    store.length[0] = n
    store.valid[0][:, :, :n] = True
    sel = store.select_rows(0, keep, store.valid[0][:, :, :n])
    relative = s[:, :, :, 0] - s[:, :, :, 0].amax(-1, keepdim=True)
    p = relative.exp()
    return keep, sel, lse, (p / p.sum(-1, keepdim=True)).sum(2)


def _differences(keep, keep_ref, mass, total):
    """Selected pairs that differ from the reference: (near ties at the cut, the others)."""
    near = other = 0
    for bi in range(keep.shape[0]):
        diff = (keep[bi] != keep_ref[bi]).nonzero(as_tuple=True)
        if not diff[0].numel():
            continue
        cut = mass[bi][keep_ref[bi]].min()  # the least mass the reference kept
        close = (mass[bi][diff] - cut).abs() <= NEAR_TIE * cut
        near += int(close.sum())
        other += int((~close).sum())
    return near, other


def _compare(out, ref, scores, total):
    """The kernel's (keep, rows, head, counts, lse) against the reference: (near ties, other differences in the
    selection, packing errors, the largest log-sum-exp error)."""
    keep, rows, head, counts, lse = out
    keep_ref, sel, lse_ref, mass = ref
    near, other = _differences(keep, keep_ref, mass, total)
    packing = 0
    if near == 0 and other == 0:
        packing = sum(not torch.equal(x, y) for x, y in
                      ((rows, sel.rows), (head, sel.head), (counts, sel.counts)))
    err = 0.0
    if lse_ref is not None:
        top = (scores * SCALE).amax(-1)  # each query head's max: a log-mass this far below is immaterial
        tiny = torch.isfinite(lse_ref) & (lse_ref < top - 80)
        assert torch.equal(torch.isneginf(lse_ref), torch.isneginf(lse) & ~tiny), "-inf where nothing is unread"
        both = ~tiny & torch.isfinite(lse_ref)
        err = float((lse[both] - lse_ref[both]).abs().max()) if both.any() else 0.0
        err = max(err, float((lse[tiny] >= top[tiny] - 80).sum()))  # underflowed both, or neither
    return near, other, packing, err


SCALE = 0.125
# (batch, KV heads, group, slots, alpha, cap share, score spread, grid: scores rounded to it for ties)
CASES = [
    (2, 3, 3, 500, 7.0, 0.14, 3.0, 0.0),   # the default model's group, cap binding
    (3, 3, 3, 500, 7.0, 0.90, 3.0, 0.0),   # cap not binding
    (1, 2, 1, 77, 3.0, 0.10, 3.0, 0.0),    # G 1, the min_fetch floor is the cap
    (3, 2, 7, 301, 5.0, 0.20, 2.0, 0.0),   # G 7, odd length
    (2, 3, 3, 256, 9.0, 0.05, 2.0, 0.5),   # ties: scores on a grid, many equal masses at the cut
    (2, 1, 7, 64, 9.0, 0.30, 1.0, 1.0),    # ties, one KV head
    (4, 3, 3, 1000, 2.0, 0.10, 4.0, 0.0),  # a low alpha: the threshold decides some rows, the cap others
    (1, 3, 3, 1, 7.0, 0.14, 1.0, 0.0),     # one slot
]


def _scores(case, seed):
    b, hkv, g, n, alpha, ratio, spread, grid = case
    gen = torch.Generator().manual_seed(seed)
    heads = torch.linspace(spread, 1.0, hkv).view(1, hkv, 1, 1)  # KV heads peaked unequally, as a real layer's
    scores = torch.randn(b, hkv, g, n, generator=gen) * heads * 8
    if grid:  # every query head of a KV head the same few values: many slots of equal mass, at the cut too
        levels = torch.randint(0, 4, (b, hkv, 1, n), generator=gen).float()
        scores = (levels * grid * 8).expand(b, hkv, g, n).contiguous()
    return scores


def _policy(min_fetch=32):
    return make_policy("infinigen", preset="flat", budget="layer", min_fetch=min_fetch, calibrate=False)


@needs_kernel
@pytest.mark.parametrize("case", CASES, ids=["x".join(map(str, c[:4])) + f"-a{c[4]}-r{c[5]}" for c in CASES])
@pytest.mark.parametrize("rest", [True, False])
def test_select_packed_equals_the_torch_selection(case, rest):
    """keep, packed rows, heads and counts equal to `_choose` + `select_rows`; the unread log-sum-exp within
    2e-6 of `remainder_lse` (where the unread mass is representable next to the head's max)."""
    b, hkv, g, n, alpha, ratio, _, _ = case
    pol = _policy()
    scores = _scores(case, seed=n + g)
    total = pol._layer_total(ratio, n, hkv, n)
    ref = _reference(pol, scores, SCALE, alpha, ratio, n + 3, rest)
    out = fused_select.select_packed(scores.clone(), SCALE, alpha, total, n + 3, rest)
    assert out[4].shape == ((b, hkv, g) if rest else (b, hkv, 0))
    near, other, packing, err = _compare(out, ref, scores, total)
    assert other == 0 and packing == 0
    assert near == 0, f"{near} pairs at the cut within {NEAR_TIE} (float32 order): none expected in these cases"
    assert err <= 2e-6
    binding = int(ref[0].sum((1, 2)).max()) >= total and bool((ref[0].sum((1, 2)) == total).any())
    if ratio <= 0.2 and n > 1:
        assert binding  # the cases meant to bind do bind


@needs_kernel
@pytest.mark.parametrize("breakage", ["drop a row", "wrong cap", "stale lse", "tie order"])
def test_the_comparison_catches_a_broken_selection(breakage):
    """The check above has teeth: a row dropped from the packing, the cap off by one, the log-sum-exp of other
    scores, or ties taken from the higher slot each fail it."""
    case = CASES[4] if breakage == "tie order" else CASES[0]
    b, hkv, g, n, alpha, ratio, _, _ = case
    pol = _policy()
    scores = _scores(case, seed=n + g)
    total = pol._layer_total(ratio, n, hkv, n)
    ref = _reference(pol, scores, SCALE, alpha, ratio, n + 3)
    if breakage == "wrong cap":
        total -= 1
    if breakage == "tie order":  # the same cut on reversed slots: ties then go to the higher slot
        out = fused_select.select_packed(scores.flip(-1).clone(), SCALE, alpha, total, n + 3, True)
        out = (out[0].flip(-1), *out[1:])
    else:
        out = fused_select.select_packed(scores.clone(), SCALE, alpha, total, n + 3, True)
    if breakage == "drop a row":
        out = first_row_dropped(out)
    if breakage == "stale lse":
        stale = fused_select.select_packed(_scores(case, seed=99), SCALE, alpha, total, n + 3, True)[4]
        out = (*out[:4], stale)
    near, other, packing, err = _compare(out, ref, scores, total)
    assert near + other + packing > 0 or err > 1e-3


# ---- in decoding sessions ----------------------------------------------------------------------------
KNOBS = dict(preset="flat", dense_layers=(), budget="layer", max_fetch_ratio=0.2, min_fetch=0)
REST = dict(remainder=True, remainder_from=0)


def _decode(model, knobs, fused, monkeypatch, sessions=1):
    """Unpadded prompts (every row P tokens: the kernel's case), then T - P steps teacher-fed, float32: logits
    [B, T-P+1, V] and every selection as the listeners saw it. sessions 2: the batch split into two sessions
    decoded together (one attention call over both)."""
    monkeypatch.setattr(fused_select, "enabled", fused)
    policy = make_policy("infinigen", **KNOBS | knobs).with_skew(_mats(model))
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, model.cfg.vocab_size, (4, T), generator=gen)
    parts = [(0, 4)] if sessions == 1 else [(0, 1), (1, 4)]
    seen = [_Seen() for _ in parts]
    sess = [Placement().new_session(model, b - a, T, policy, listeners=[s]) for (a, b), s in zip(parts, seen)]
    first = [runtime.prefill(model, tokens[a:b, :P], s) for (a, b), s in zip(parts, sess)]
    out = [torch.cat(first)]
    for t in range(P, T):
        out.append(runtime.decode(model, tokens[:, t], sess if sessions > 1 else sess[0]))
    return torch.stack(out, 1), [s.seen for s in seen]


def _counted(monkeypatch, wrap=None):
    calls = [0]
    inner = fused_select.select_packed

    def counted(*a, **kw):
        calls[0] += 1
        return (wrap or inner)(*a, **kw)
    monkeypatch.setattr(fused_select, "select_packed", counted)
    return calls


def _same(ref, seen_ref, out, seen):
    equal = all(s.keys() == r.keys() and all(
        (s[k] == "all" and r[k] == "all") or torch.equal(s[k], r[k]) for k in s) for s, r in zip(seen, seen_ref))
    return equal, float((out - ref).abs().max())


@needs_kernel
@pytest.mark.parametrize("knobs,sessions", [({}, 1), (REST, 1), (dict(REST, max_fetch_ratio=0.05), 1), (REST, 2)],
                         ids=["layer", "remainder", "cap-0.05", "two-sessions"])
def test_session_with_fused_selection_equals_the_torch_path(make_tiny, monkeypatch, knobs, sessions):
    """float32, 8 query heads over 2 KV heads: the fused selection is taken at every selecting layer and step,
    selects what the torch path selects, and the logits are within 1e-5."""
    _, model = make_tiny("llama", num_hidden_layers=3)
    ref, seen_ref = _decode(model, knobs, False, monkeypatch, sessions)
    calls = _counted(monkeypatch)
    out, seen = _decode(model, knobs, True, monkeypatch, sessions)
    selecting = len(make_policy("infinigen", **KNOBS | knobs).selecting_layers(model.cfg))
    assert selecting >= 2 and calls[0] == selecting * (T - P) * sessions  # every selecting layer and step
    equal, err = _same(ref, seen_ref, out, seen)
    assert equal and err <= 1e-5


@needs_kernel
@pytest.mark.parametrize("breakage", ["drop a row", "wrong cap", "stale lse"])
def test_session_check_catches_a_broken_fused_selection(make_tiny, monkeypatch, breakage):
    """The session comparison fails when the fused selection drops a selected row, cuts at a cap one lower, or
    hands the remainder the previous call's log-sum-exp."""
    _, model = make_tiny("llama", num_hidden_layers=3)
    ref, seen_ref = _decode(model, REST, False, monkeypatch)
    inner, last = fused_select.select_packed, {}

    def broken(scores, scale, alpha, total, capacity, with_lse):
        if breakage == "wrong cap":
            return inner(scores, scale, alpha, max(0, total - 1), capacity, with_lse)
        keep, rows, head, counts, lse = inner(scores, scale, alpha, total, capacity, with_lse)
        if breakage == "drop a row":  # batch row 0's first row: neither selected nor read
            keep, rows, head, counts = keep.clone(), rows.clone(), head.clone(), counts.clone()
            kh = int((counts[0] > 0).nonzero()[0])
            keep[0].view(-1)[rows[0, 0] - kh * (capacity - keep.shape[-1])] = False
            rows[0, :-1], head[0, :-1] = rows[0, 1:].clone(), head[0, 1:].clone()
            rows[0, -1], head[0, -1] = 0, -1
            counts[0, kh] -= 1
        if breakage == "stale lse":
            stale = last.get(lse.shape, lse)
            last[lse.shape] = lse
            lse = stale
        return keep, rows, head, counts, lse
    calls = _counted(monkeypatch, broken)
    out, seen = _decode(model, REST, True, monkeypatch)
    assert calls[0] > 0
    equal, err = _same(ref, seen_ref, out, seen)
    assert not equal or err > 1e-4
