"""The 4-bit keys' scores and InfiniGen's layer cut of them in one native call (`fused_select.score_select`: the
scores scaled and each query head's max taken in the scorer's tasks, no scores tensor) against the two calls it
replaces (`score_int4`, then `select_packed`): the same kept slots, packed rows, heads, counts and unread
log-sum-exp, to the bit, on many random cases (G 1, 3 and 7; lengths inside, on and past a 64-slot block; several
scoring parts; the cap binding or not; rotated or not)."""
from __future__ import annotations

import pytest
import torch

from infinigen.kernels import fused_select
from infinigen.kernels.int4 import PackedKeys, tinygemm_ok

needs_kernel = pytest.mark.skipif(not fused_select.available(), reason="the fused kernel cannot be built here")
needs_tinygemm = pytest.mark.skipif(not tinygemm_ok(64), reason="torch's CPU int4 kernel does not take this layout")

D = 64


def _case(seed: int):
    """A random shape, keys, query, cut and scoring parts."""
    gen = torch.Generator().manual_seed(seed)
    pick = lambda *xs: xs[int(torch.randint(len(xs), (1,), generator=gen))]  # noqa: E731
    b, hkv, g = pick(1, 2, 3), pick(1, 2, 3), pick(1, 3, 7)
    capacity = pick(64, 128, 320, 1088)
    n = int(torch.randint(1, capacity + 1, (1,), generator=gen))
    pk = PackedKeys(b, hkv, capacity, D, group=32, layout="tinygemm")
    peaks = torch.rand(1, hkv, 1, 1, generator=gen) * 3 + 0.2  # KV heads peaked unequally
    pk.write(0, torch.randn(b, hkv, capacity, D, generator=gen) * peaks)
    q = torch.randn(b, hkv, g, D, generator=gen) * pick(0.5, 2.0, 6.0)
    rotation = pick(None, "skew")
    if rotation is not None:
        rotation = torch.linalg.qr(torch.randn(hkv, D, D, generator=gen, dtype=torch.float64)).Q
    share = pick(0.02, 0.1, 0.3, 2.0)  # 2.0: the cap never binds
    cut = {"scale": D ** -0.5, "alpha": pick(2.0, 5.0, 7.0, 9.0), "total": max(1, int(share * n * hkv)),
           "capacity": capacity + pick(0, 5), "with_lse": pick(True, False)}
    return pk, q, n, rotation, cut, pick(64, 192, None)


def _both(pk, q, n, rotation, cut, part_slots):
    fused = fused_select.score_select(q, pk._codes_by_slot, pk.sz, pk.group, n, rotation=rotation,
                                      part_slots=part_slots, **cut)
    scores = fused_select.score_int4(q, pk._codes_by_slot, pk.sz, pk.group, n, part_slots, rotation)
    return fused, fused_select.select_packed(scores, **cut)


@needs_kernel
@needs_tinygemm
@pytest.mark.parametrize("seeds", [range(0, 60), range(60, 120)], ids=["seeds 0-59", "seeds 60-119"])
def test_one_call_scores_and_cuts_as_the_two_calls(seeds):
    binding = 0
    for seed in seeds:
        pk, q, n, rotation, cut, part_slots = _case(seed)
        fused, two = _both(pk, q, n, rotation, cut, part_slots)
        names = ("keep", "rows", "head", "counts", "lse")
        for name, x, y in zip(names, fused, two):
            assert torch.equal(x, y), f"seed {seed}: {name} differs (n={n}, {tuple(q.shape)}, {cut})"
        binding += int(two[3].sum(1).max()) == cut["total"]
    assert binding >= 10  # the cap decided a good share of the cases, not only the threshold


@needs_kernel
@pytest.mark.parametrize("total", [1, 12, 40, 200])
def test_the_cut_is_exact_where_the_sampled_floor_misjudges(total):
    """The cap's partial selection runs over the pairs a sample of every 8th pair says reach the cut; scores whose
    sampled slots hold the 32 largest masses make that floor too high for a cap over 32 (then every kept pair is
    searched): the cut keeps exactly the `total` slots of most mass either way (distinct scores, far apart)."""
    n = 256
    slots = torch.arange(n)
    high = slots % 8 == 0  # the slots the sample sees
    scores = torch.where(high, 100 - 0.5 * (slots // 8), 80 - 0.05 * slots).float().view(1, 1, 1, n)
    keep, rows, _, counts, _ = fused_select.select_packed(scores.clone(), 1.0, 1000.0, total, n, False)
    want = torch.zeros(n, dtype=torch.bool)
    want[scores.view(n).topk(total).indices] = True
    assert torch.equal(keep.view(n), want) and int(counts.sum()) == total
    assert torch.equal(rows.view(-1), want.nonzero().view(-1))
