"""A decoding selection read as rows packed per batch row (`KVStore.select_rows`, one masked
fused call) against the reference path (each KV head's slots padded to the largest head's count, gathered,
`attend_step`): the same selections, the same outputs, the same greedy tokens, and the rows read bounded by
the cap where the reference pads every KV head to the largest head's count."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from infinigen import runtime
from infinigen.cache import KVStore
from infinigen.placement import Placement
from infinigen.policies import make_policy
from infinigen.policies.base import Policy
from support.packed_rows import P, T, decode_rows, packed_policy, padded_prompts
from support.padded_reference import slots



def _count(monkeypatch, obj, name):
    calls = [0]
    inner = getattr(obj, name)

    def counted(*a, **kw):
        calls[0] += 1
        return inner(*a, **kw)
    monkeypatch.setattr(obj, name, counted)
    return calls


CASES = [("infinigen", {}), ("infinigen", dict(budget="union", alpha=1.0)),
         ("infinigen", dict(preset="paper", alpha=1.0)), ("infinigen", dict(budget="layer", max_fetch_ratio=0.1)),
         ("oracle", dict(ratio=0.3)), ("oracle", dict(alpha=1.0)), ("h2o", dict(heavy=3, recent=2))]


@pytest.mark.parametrize("name,knobs", CASES, ids=[f"{n}-{'-'.join(map(str, k.values()))}" for n, k in CASES])
def test_packed_rows_equal_the_reference(make_tiny, monkeypatch, name, knobs):
    """GQA (8 query heads over 2 KV heads), 3 rows of different prompt lengths (left padding): the packed
    path selects what the reference selects at every layer and step, and its logits agree."""
    _, model = make_tiny("llama", num_hidden_layers=3)
    tokens, mask = padded_prompts(model, (9, 4, 6))
    ref, seen_ref, _ = decode_rows(model, packed_policy(name, model, **knobs), tokens, mask, read_rows=False)
    packed = _count(monkeypatch, KVStore, "select_rows")
    out, seen, sess = decode_rows(model, packed_policy(name, model, **knobs), tokens, mask, read_rows=True)
    assert packed[0] > 0  # every policy reads packed rows; H2O observes the weights per packed row
    assert seen.keys() == seen_ref.keys()
    for key in seen:
        assert (seen[key] == "all" and seen_ref[key] == "all") or torch.equal(seen[key], seen_ref[key]), key
    assert (out - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("name,knobs", CASES[:2] + CASES[4:5], ids=["infinigen", "infinigen-union", "oracle"])
def test_greedy_tokens_equal_the_reference(make_tiny, name, knobs):
    _, model = make_tiny("llama", num_hidden_layers=3)
    tokens, mask = padded_prompts(model, (9, 7), seed=5)
    ref, _, _ = decode_rows(model, packed_policy(name, model, **knobs), tokens, mask, read_rows=False, greedy=True)
    out, _, _ = decode_rows(model, packed_policy(name, model, **knobs), tokens, mask, read_rows=True, greedy=True)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_unlimited_budget_reads_every_row_as_dense(make_tiny, monkeypatch):
    """Every entry selected (alpha 1e9, cap 1): the packed path reads every row and gives the full cache."""
    _, model = make_tiny("llama", num_hidden_layers=3)
    tokens, mask = padded_prompts(model, (9, 5))
    dense, _, _ = decode_rows(model, make_policy("full"), tokens, mask, read_rows=True)
    packed = _count(monkeypatch, KVStore, "select_rows")
    pol = packed_policy("infinigen", model, alpha=1e9, max_fetch_ratio=1.0, skew=False)
    out, _, sess = decode_rows(model, pol, tokens, mask, read_rows=True)
    # every layer: layer 0 reads ALL (nothing precedes it), of a padded batch read as its visible rows packed
    assert packed[0] == model.cfg.num_layers * (T - P)
    assert (out - dense).abs().max() <= 1e-5
    assert sess.stats.overall() == pytest.approx(1.0)


def test_many_sessions_equal_each_alone(make_tiny):
    """The server's decode: sessions of different lengths and policies in one call per layer, each reading its
    packed rows (a full-cache session's rows too; an H2O session observing its weights per packed row), equal
    each session decoded alone on the reference path."""
    _, model = make_tiny("llama", num_hidden_layers=3)
    for names in (("infinigen", "oracle", "full"), ("infinigen", "h2o")):
        knobs = {"oracle": dict(ratio=0.3), "h2o": dict(heavy=3, recent=2)}
        alone, sessions, toks = [], [], []
        for i, name in enumerate(names):
            tokens, mask = padded_prompts(model, (9 - 2 * i, 9 - i), seed=i)
            policy = packed_policy(name, model, **knobs.get(name, {}))
            ref, _, _ = decode_rows(model, policy, tokens, mask, read_rows=False)
            alone.append(ref)
            sess = Placement().new_session(model, 2, T, packed_policy(name, model, **knobs.get(name, {})))
            runtime.prefill(model, tokens[:, :P], sess, pad_mask=mask)
            sessions.append(sess)
            toks.append(tokens)
        for t in range(P, T):
            got = runtime.decode(model, torch.cat([x[:, t] for x in toks]), sessions)
            for i, ref in enumerate(alone):
                assert (got[2 * i:2 * i + 2] - ref[:, t - P + 1]).abs().max() <= 1e-5, (names, i, t)


# ---- rows read: bounded by the cap ---------------------------------------------------------------------------
def test_select_rows_packs_each_batch_row_within_the_cap():
    """An uneven case: two KV heads select 50 and 0 of 100 entries under a 25% cap pooled over the layer
    (50 entries): 50 rows are packed, where the reference pads both heads to 50 and gathers 100."""
    store = KVStore(1, 2, 2, 128, 4, torch.float32)
    k = torch.randn(2, 2, 100, 4)
    store.write_prompt(0, k, k + 1, torch.ones(2, 100, dtype=torch.bool), torch.arange(100).expand(2, 100))
    keep = torch.zeros(2, 2, 100, dtype=torch.bool)
    keep[0, 0, ::2] = True  # batch row 0: head 0 takes 50, head 1 none
    keep[1, 1, 10:30] = True  # batch row 1: head 1 takes 20
    valid = store.valid[0][:, :, :100]
    sel = store.select_rows(0, keep, valid)
    assert sel.rows.shape == (2, 50)  # the largest batch row's total, not 2 heads x 50
    assert sel.counts.tolist() == [[50, 0], [0, 20]]
    _, idx, _, _ = slots(store, 0, keep, valid)
    assert idx.numel() == 2 * 2 * 50  # the reference: every KV head padded to the largest count
    keys, values = store.gather_rows(0, sel.rows, torch.empty(100, 4), torch.empty(100, 4))
    assert torch.equal(keys[0, 0], k[0, 0, ::2])
    assert torch.equal(values[1, 0, :20], k[1, 1, 10:30] + 1)
    assert sel.head[0].tolist() == [0] * 50 and sel.head[1].tolist() == [1] * 20 + [-1] * 30


@dataclass(frozen=True)
class _HalfOfOneHead(Policy):
    """KV head 0 selects the first half of its valid entries, every other head none: 25% of a layer of two
    KV heads, all of it in one head."""
    name = "half_of_one_head"

    def keep(self, layer, rows, session):
        valid = rows.valid.expand(session.batch, session.model.cfg.num_kv_heads, rows.count, -1)
        first = valid.cumsum(-1) <= valid.sum(-1, keepdim=True) // 2
        out = valid & first
        out[:, 1:] = False
        return out


def test_rows_read_are_bounded_by_the_cap(make_tiny):
    """Decoding with that uneven selection: the packed path reads the selected entries (and nothing more, at
    batch 1); the reference reads every KV head padded to head 0's count, twice as many."""
    _, model = make_tiny("llama", num_hidden_layers=2)
    tokens, mask = padded_prompts(model, (9,))
    rows = {}
    for read_rows in (False, True):
        _, _, sess = decode_rows(model, _HalfOfOneHead(), tokens, mask, read_rows=read_rows)
        rows[read_rows] = sess.stats.per_step()
    entries = sum((P + i) // 2 for i in range(T - P)) * model.cfg.num_layers / (T - P)  # head 0's half per step
    assert rows[True]["entries_attended"] == pytest.approx(entries)
    assert rows[True]["rows_read"] == pytest.approx(entries)
    assert rows[False]["entries_attended"] == pytest.approx(entries)
    assert rows[False]["rows_read"] == pytest.approx(2 * entries)  # two KV heads of head 0's count


def test_rows_of_a_dense_step_are_every_used_slot(make_tiny):
    _, model = make_tiny("llama", num_hidden_layers=2)
    tokens, mask = padded_prompts(model, (9, 9))
    _, _, sess = decode_rows(model, make_policy("full"), tokens, mask, read_rows=True)
    per = sess.stats.per_step()
    used = sum(P + i for i in range(T - P)) / (T - P) * 2 * model.cfg.num_kv_heads * model.cfg.num_layers
    assert per["rows_read"] == pytest.approx(used) and per["entries_attended"] == pytest.approx(used)


# ---- the cut: one pass when the ties at the threshold fit --------------------------------------------------------
@pytest.mark.parametrize("levels,short", [(3, False), (50, False), (10**6, False), (10**6, True)],
                         ids=["many-ties", "some-ties", "no-ties", "short-row"])
def test_cut_takes_exactly_n_lower_slots_first(levels, short):
    """`top_n_per_row` with a host n: exactly the n highest scores of each row, ties broken lower slot first,
    whether the ties at the threshold all fit (the one-pass `_at_least`) or not (the cumulative sum)."""
    from infinigen.policies.cuts import top_n_per_row
    g = torch.Generator().manual_seed(levels % 97)
    score = (torch.rand(6, 40, generator=g) * levels).floor()
    if short:
        score[0, 5:] = float("-inf")  # fewer finite entries than n: the -inf ones are never taken
    keep = torch.ones_like(score, dtype=torch.bool)
    n = 7
    got = top_n_per_row(keep, score, n, as_is=torch.zeros(6, dtype=torch.bool))
    for r in range(6):
        order = sorted((i for i in range(40) if score[r, i] > float("-inf")), key=lambda i: (-score[r, i], i))
        assert got[r].nonzero().flatten().tolist() == sorted(order[:n]), r


def test_infinigen_rows_read_within_its_layer_cap(make_tiny):
    """InfiniGen's default budget pools a cap over the layer's KV heads: every batch row's packed rows, and so
    the rows read per step, stay within B x that cap (every token qualifies at alpha 1e9: the cap binds)."""
    _, model = make_tiny("llama", num_hidden_layers=3)
    tokens, mask = padded_prompts(model, (9, 9))
    ratio, hkv = 0.3, model.cfg.num_kv_heads
    pol = packed_policy("infinigen", model, alpha=1e9, max_fetch_ratio=ratio, min_fetch=0)
    _, _, sess = decode_rows(model, pol, tokens, mask, read_rows=True)
    cap = sum(2 * int(ratio * (P + i) * hkv) for i in range(T - P))  # B x the layer's cap, summed over steps
    for layer in range(1, model.cfg.num_layers):
        assert 0 < sess.stats.rows[layer] <= cap, layer


@pytest.mark.parametrize("b, h, n, capacity", [(2, 3, 5, 9), (1, 2, 0, 4), (3, 1, 7, 7)])
def test_every_row_packs_as_select_rows_over_every_slot(b, h, n, capacity):
    """Reading every used slot of an unpadded store packs it from the used length alone (no count that a GPU
    would have to hand back to the host), exactly as `select_rows` over every valid slot packs it."""
    from infinigen.cache import KVStore
    store = KVStore(1, b, h, capacity, 4, torch.float32)
    if n:
        k = torch.randn(b, h, n, 4)
        store.write_prompt(0, k, k, torch.ones(b, n, dtype=torch.bool), torch.arange(n).expand(b, n))
    valid = store.valid[0][:, :, :n]
    want, got = store.select_rows(0, valid, valid), store.every_row(0)
    for a, e in zip(want[:4], got[:4]):
        assert torch.equal(a, e)
    assert want.read is got.read is None  # both counted on the host
