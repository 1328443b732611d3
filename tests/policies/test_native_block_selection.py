"""InfiniGen's layer-capped block selection as one C++ call (`block_select.select_blocks`: from the speculated
scores to the chosen blocks, their packed rows and the remainder's log-sum-exp) against the torch path it replaces
(`InfiniGen._choose` with budget "layer" and `block` > 1, i.e. `choose_blocks`, then `KVStore.select_rows` and
`remainder_lse`): the same blocks on many random float32 cases (G 1, 3 and 7; lengths on and off a block boundary,
shorter than a block; the cap binding or not; the min_fetch floor; ties between equal blocks), the same packed
rows, and a check that fails when a block boundary is off by one, the cap is ignored, ties go the other way, or a
row is dropped.

The block masses are float32 sums that the kernel orders differently from torch: the choices must be equal except
for blocks whose masses lie within a relative 1e-6 of the cut's (counted; none in these cases)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infinigen.cache import KVStore
from infinigen.kernels import block_select
from infinigen.policies import make_policy
from infinigen.policies.cuts import remainder_lse
from support.packed_rows import first_row_dropped

needs_kernel = pytest.mark.skipif(not block_select.available(), reason="the block kernel cannot be built here")
NEAR_TIE = 1e-6  # relative difference of two block masses at the cut that float32 summation order may flip
SCALE = 0.125


def _policy(block, min_fetch=32):
    return make_policy("infinigen", preset="flat", budget="layer", block=block, min_fetch=min_fetch,
                       calibrate=False)


def _block_mass(scores, block):
    """Each (batch row, KV head, block)'s speculated mass [B, Hkv, blocks] (float64: the exact order)."""
    s = scores.double() * SCALE
    p = (s - s.amax(-1, keepdim=True)).exp()
    mass = (p / p.sum(-1, keepdim=True)).sum(2)  # [B, Hkv, n]
    n = mass.shape[-1]
    k = min(block, n)
    nb = -(-n // k)
    return F.pad(mass, (0, nb * k - n)).view(*mass.shape[:2], nb, k).sum(-1)


def _reference(pol, scores, alpha, ratio, capacity):
    """The torch path: keep [B, Hkv, n], `SelectedRows` and the unread log-sum-exp [B, Hkv, G]."""
    b, hkv, g, n = scores.shape
    s = scores[:, :, :, None] * SCALE
    valid = torch.ones(b, hkv, 1, n, dtype=torch.bool)
    keep = pol._choose(s.clone(), valid, alpha, n, ratio)
    lse = remainder_lse(s, valid & ~keep)[..., 0]
    keep = keep[:, :, 0]
    store = KVStore(1, b, hkv, capacity, 4, torch.float32)
    store.length[0] = n
    store.valid[0][:, :, :n] = True
    return keep, store.select_rows(0, keep, store.valid[0][:, :, :n]), lse


def _compare(out, ref, scores, block):
    """(blocks chosen differently at a near tie, other differences, packing errors, the largest lse error)."""
    keep, rows, head, counts, lse = out
    keep_ref, sel, lse_ref = ref
    n = scores.shape[-1]
    k = min(block, n)
    nb = -(-n // k)
    chosen = lambda x: F.pad(x, (0, nb * k - n)).view(*x.shape[:2], nb, k).any(-1)  # noqa: E731
    mass = _block_mass(scores, block)
    near = other = 0
    for bi in range(keep.shape[0]):
        diff = (chosen(keep)[bi] != chosen(keep_ref)[bi]).nonzero(as_tuple=True)
        if not diff[0].numel():
            continue
        cut = mass[bi][chosen(keep_ref)[bi]].min()  # the least mass the reference chose
        close = (mass[bi][diff] - cut).abs() <= NEAR_TIE * cut
        near += int(close.sum())
        other += int((~close).sum())
    other += int((keep != keep_ref).sum()) if near == 0 and other == 0 else 0  # a block kept in part
    packing = 0
    if near == 0 and other == 0:
        packing = sum(not torch.equal(x, y) for x, y in ((rows, sel.rows), (head, sel.head), (counts, sel.counts)))
    top = (scores * SCALE).amax(-1)  # each query head's max: a log-mass this far below is immaterial
    tiny = torch.isfinite(lse_ref) & (lse_ref < top - 80)
    err = 0.0 if torch.equal(torch.isneginf(lse_ref), torch.isneginf(lse) & ~tiny) else float("inf")
    both = ~tiny & torch.isfinite(lse_ref)
    if both.any():
        err = max(err, float((lse[both] - lse_ref[both]).abs().max()))
    return near, other, packing, err


# (batch, KV heads, group, slots, block, alpha, cap share, min_fetch, grid: equal blocks for ties)
CASES = [
    (8, 3, 3, 1024, 32, 7.0, 0.14, 32, False),  # the default model's group, blocks of 32, cap binding
    (3, 3, 3, 1000, 32, 7.0, 0.14, 32, False),  # the last block partial
    (2, 3, 3, 500, 16, 7.0, 0.90, 32, False),   # cap not binding: every qualifying block
    (1, 2, 1, 77, 4, 3.0, 0.10, 32, False),     # G 1, the min_fetch floor is the cap
    (3, 2, 7, 301, 8, 5.0, 0.20, 0, False),     # G 7, odd length, no floor
    (4, 3, 3, 1000, 32, 2.0, 0.10, 32, False),  # a low alpha: the threshold decides some rows, the cap others
    (2, 3, 3, 20, 32, 7.0, 1.00, 0, False),     # fewer slots than a block: one block of all of them
    (2, 3, 3, 70, 32, 7.0, 0.40, 0, False),     # the cap below one block's slots on some rows: one block
    (1, 3, 3, 1, 16, 7.0, 0.14, 32, False),     # one slot
    (2, 3, 3, 512, 16, 9.0, 0.10, 0, True),     # ties: many equal blocks at the cut
    (2, 1, 7, 96, 8, 9.0, 0.30, 0, True),       # ties, one KV head
]


def _scores(case, seed):
    b, hkv, g, n, block, *_, grid = case
    gen = torch.Generator().manual_seed(seed)
    heads = torch.linspace(3.0, 1.0, hkv).view(1, hkv, 1, 1)  # KV heads peaked unequally, as a real layer's
    scores = torch.randn(b, hkv, g, n, generator=gen) * heads * 8
    if grid:  # a few distinct blocks repeated: the same scores in each copy, so equal masses in both paths
        kinds = torch.randn(4, block, generator=gen) * 8
        pick = torch.randint(0, 4, (b, 1, 1, -(-n // block)), generator=gen)
        scores = kinds[pick].reshape(b, 1, 1, -1)[..., :n].expand(b, hkv, g, n).contiguous()
    return scores


def _case_id(c):
    return "x".join(map(str, c[:4])) + f"-block{c[4]}-a{c[5]}-r{c[6]}-f{c[7]}" + ("-ties" if c[8] else "")


@needs_kernel
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
@pytest.mark.parametrize("seed", range(4))
def test_native_blocks_equal_the_torch_selection(case, seed):
    """keep, packed rows, heads and counts equal to `choose_blocks` + `select_rows`; the unread log-sum-exp within
    2e-6 of `remainder_lse`; with `pack` off the same keep and counts, no rows."""
    b, hkv, g, n, block, alpha, ratio, min_fetch, grid = case
    pol = _policy(block, min_fetch)
    scores = _scores(case, seed=seed * 1000 + n + g)
    total = pol._layer_total(ratio, n, hkv, n)
    ref = _reference(pol, scores, alpha, ratio, n + 5)
    out = block_select.select_blocks(scores.clone(), SCALE, alpha, total, block, n + 5, True)
    near, other, packing, err = _compare(out, ref, scores, block)
    assert other == 0 and packing == 0
    assert near == 0, f"{near} blocks at the cut within {NEAR_TIE} (float32 order): none expected in these cases"
    assert err <= 2e-6
    bare = block_select.select_blocks(scores.clone(), SCALE, alpha, total, block, n + 5, False, pack=False)
    assert torch.equal(bare[0], out[0]) and torch.equal(bare[3], out[3])
    assert bare[1].shape == (b, 0) and bare[4].shape == (b, hkv, 0)
    if grid:  # ties were at the cut: some row cut among equal blocks
        per_block = _block_mass(scores, block)
        assert any(len(set(per_block[bi].flatten().tolist())) < per_block[bi].numel() for bi in range(b))


def test_the_cases_bind_and_tie_where_meant():
    """The cases above exercise what they name: the cap binds where its share is low, blocks tie at the cut."""
    for case in CASES:
        b, hkv, g, n, block, alpha, ratio, min_fetch, grid = case
        pol = _policy(block, min_fetch)
        scores = _scores(case, seed=n + g)
        total = pol._layer_total(ratio, n, hkv, n)
        keep = _reference(pol, scores, alpha, ratio, n + 5)[0]
        kept = keep.sum((1, 2))
        if ratio <= 0.2 and n > block:
            assert bool((kept <= max(total, min(block, n))).all()), _case_id(case)  # the cap held
            assert bool((kept < n * hkv).any()), _case_id(case)  # something was cut
        if ratio >= 0.9:
            assert bool((kept <= n * hkv).all())


BREAKAGES = ["block boundary off by one", "cap ignored", "tie order", "drop a row", "stale lse"]


@needs_kernel
@pytest.mark.parametrize("breakage", BREAKAGES)
def test_the_comparison_catches_a_broken_block_selection(breakage):
    """The check above has teeth: blocks one slot longer, the cap lifted, ties taken from the higher block, a row
    dropped from the packing, or the log-sum-exp of other scores each fail it."""
    case = CASES[9] if breakage == "tie order" else CASES[0]
    b, hkv, g, n, block, alpha, ratio, min_fetch, _ = case
    pol = _policy(block, min_fetch)
    scores = _scores(case, seed=n + g)
    total = pol._layer_total(ratio, n, hkv, n)
    ref = _reference(pol, scores, alpha, ratio, n + 5)
    call = dict(block=block, total=total)
    if breakage == "block boundary off by one":
        call["block"] = block + 1
    if breakage == "cap ignored":
        call["total"] = n * hkv
    if breakage == "tie order":  # the same cut on reversed slots: ties then go to the higher block
        out = block_select.select_blocks(scores.flip(-1).clone(), SCALE, alpha, total, block, n + 5, True)
        out = (out[0].flip(-1), *out[1:])
    else:
        out = block_select.select_blocks(scores.clone(), SCALE, alpha, call["total"], call["block"], n + 5, True)
    if breakage == "drop a row":
        out = first_row_dropped(out)
    if breakage == "stale lse":
        other_scores = _scores(case, seed=99)
        out = (*out[:4], block_select.select_blocks(other_scores, SCALE, alpha, total, block, n + 5, True)[4])
    near, other, packing, err = _compare(out, ref, scores, block)
    assert near + other + packing > 0 or err > 1e-3
