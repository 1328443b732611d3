"""Where selection pays is searched, not swept: a few lengths, each timed only until its side is clear.

The search (`crossing.find_crossing`) and a length's stopping rule (`crossing.probe`) are run here on synthetic
step costs (the timer injected: no clock, no machine), so what they find is known in advance."""
from __future__ import annotations

import math
import random

import pytest

from infinigen.policies import crossing

LO, HI, CONTEXT = 512, 8176, 8192


def synthetic(full, policy, noise: float = 0.0, seed: int = 0):
    """`pairs_at` of step costs full(n), policy(n) ms, each step off by up to `noise` (relative, seeded), and the
    list of (length, pairs taken) it was asked for."""
    rng = random.Random(seed)
    asked: list = []

    def pairs_at(n):
        record = [n, 0]
        asked.append(record)
        for _ in range(crossing.STEPS):
            record[1] += 1
            yield (full(n) * (1 + noise * rng.uniform(-1, 1)), policy(n) * (1 + noise * rng.uniform(-1, 1)))
    return pairs_at, asked


def true_crossing(full, policy) -> float:
    """Where policy(n) = full(n) on [LO, HI] (bisection on the exact functions)."""
    a, b = LO, HI
    for _ in range(60):
        m = (a + b) / 2
        a, b = (m, b) if policy(m) > full(m) else (a, m)
    return a


def linear(n):
    return 5 + 0.01 * n


CASES = {
    # the dense step grows 5x faster with the length than the selecting one: they meet at 1250 tokens
    "linear": (linear, lambda n: 15 + 0.002 * n),
    # a dense step that grows faster than linearly (memory traffic): false position alone would creep
    "curved": (lambda n: 5 + 0.002 * n + 1e-6 * n * n, lambda n: 7.64 + 0.001 * n),
    # selection pays only past the middle of the range (5000 tokens)
    "late": (lambda n: 5 + 0.001 * n, lambda n: 7.5 + 0.0005 * n),
}


def narrowed(found) -> bool:
    """The search ended where it should: the crossing found lies between two measured lengths within NARROW of
    each other, or next to a measured length that is at the crossing (its ratio within CLOSE of 1)."""
    n, lengths, ratio = found["dense_below"], found["lengths"], found["ratio"]
    near = any(abs(math.log(r)) < crossing.CLOSE and max(m, n) / max(min(m, n), 1) <= crossing.NARROW
               for m, r in zip(lengths, ratio))
    between = any(a <= n <= b and b / a <= crossing.NARROW for a, b in zip(lengths, lengths[1:]))
    return near or between


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("noise", [0.0, 0.03])
def test_the_search_finds_where_the_costs_meet(name, noise):
    """The crossing found is where the two steps cost the same (the true ratio within 10% of 1 there, the search
    narrowed down to it; the linear case without noise within 0.5% of the length, from 3 lengths: false
    position lands on it), from at most MAX_PROBES lengths, and the longest length (the costliest steps) is
    timed only where the crossing lies beyond the middle, the shortest (which cannot bracket it then) only where
    it lies below the middle."""
    full, policy = CASES[name]
    pairs_at, asked = synthetic(full, policy, noise)
    found = crossing.find_crossing(pairs_at, LO, HI, CONTEXT)
    n = found["dense_below"]
    assert abs(math.log(policy(n) / full(n))) < 0.1, (found, true_crossing(full, policy))
    assert narrowed(found), found
    if name == "linear" and not noise:
        assert abs(n - true_crossing(full, policy)) <= 0.005 * true_crossing(full, policy)
        assert len(asked) == 3
    assert len(asked) == len(found["lengths"]) <= crossing.MAX_PROBES
    assert (HI in found["lengths"]) == (true_crossing(full, policy) > math.sqrt(LO * HI))
    assert (LO in found["lengths"]) == (true_crossing(full, policy) < math.sqrt(LO * HI))
    assert found["lengths"] == sorted(found["lengths"]) and len(found["ratio"]) == len(found["lengths"])


def test_never_paying_is_the_whole_context():
    pairs_at, asked = synthetic(linear, lambda n: 2 * linear(n))
    found = crossing.find_crossing(pairs_at, LO, HI, CONTEXT)
    assert found["dense_below"] == CONTEXT and found["lengths"] == [round(math.sqrt(LO * HI)), HI]


def test_paying_everywhere_reads_densely_below_the_shortest_length_at_most():
    pairs_at, asked = synthetic(linear, lambda n: 0.5 * linear(n))
    found = crossing.find_crossing(pairs_at, LO, HI, CONTEXT)
    assert found["dense_below"] <= LO and len(asked) == 2


def test_one_length_is_measured_alone():
    """A range of one length (a batch run that reaches only the shortest): that length, once."""
    pairs_at, asked = synthetic(linear, lambda n: 0.5 * linear(n))
    assert crossing.find_crossing(pairs_at, LO, LO, CONTEXT)["lengths"] == [LO] and len(asked) == 1


@pytest.mark.parametrize("ratio,pairs", [
    (2.0, crossing.MIN_PAIRS),  # decisively slower: the fewest pairs
    (0.5, crossing.MIN_PAIRS),  # decisively faster
    (1.1, crossing.STEPS),  # near the crossing: every pair it may take (a few pairs under load mislead)
    (1.0, crossing.STEPS),
])
def test_a_length_is_timed_until_its_side_is_clear(ratio, pairs):
    pairs_at, asked = synthetic(lambda n: 10.0, lambda n: 10.0 * ratio)
    got = crossing.probe(pairs_at(LO))
    assert got["pairs"] == pairs == asked[0][1] and got["ratio"] == pytest.approx(ratio)


def test_a_lone_outlier_does_not_decide_a_side():
    """The median of the pairs decides: one step slowed by the machine's load (a 5x slower full-cache step at a
    length where selecting is 1.5x slower) does not make it look faster."""
    steps = iter([(50.0, 15.0), (10.0, 15.0), (10.0, 15.0), (10.0, 15.0)])
    got = crossing.probe(steps)
    assert got["ratio"] == pytest.approx(1.5) and got["pairs"] == crossing.MIN_PAIRS


@pytest.mark.parametrize("cliff", [600, 1000, 1500, 2300, 3000, 4000, 6000])
@pytest.mark.parametrize("below,above", [(1.3, 0.35), (1.2, 0.2), (1.1, 0.8)])
def test_a_cliff_is_narrowed_down(cliff, below, above):
    """Where the selecting step's cost jumps (`below` times the full cache's under `cliff` tokens, `above` from
    there), false position would creep towards it from one side; the search still brackets the cliff within
    NARROW, from at most MAX_PROBES lengths."""
    pairs_at, asked = synthetic(linear, lambda n: linear(n) * (below if n < cliff else above))
    found = crossing.find_crossing(pairs_at, LO, HI, CONTEXT)
    assert narrowed(found) and cliff / crossing.NARROW <= found["dense_below"] <= cliff * crossing.NARROW, found
    assert len(asked) <= crossing.MAX_PROBES
