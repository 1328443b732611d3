"""The row cache of an offloaded KV pool: a step fetches from the slow tier only the
selected rows the fast-memory cache does not hold. It changes no token and no logit, on either tier and
under any selecting policy; it reads fewer bytes from the slow tier when consecutive steps select
overlapping rows (counted at the tier itself); it stays within its byte bound, which counts in the store's
fast bytes; a slot reused under a pool limit is never served from the cache; 0 bytes turns it off."""
from __future__ import annotations

import json
import os

import pytest
import torch

from infinigen import runtime
from infinigen.errors import UserError
from infinigen.placement import Placement
from infinigen.placement.rowcache import RowCache
from infinigen.policies import make_policy
from support.offload import FifoVictims, SlowReads, offload_policy, run_placed, selective_policy

B, PROMPT, GEN = 2, 24, 8
BIG = 1 << 22  # holds every row of these tiny pools


def _tokens(seed=3):
    return torch.randint(3, 256, (B, PROMPT), generator=torch.Generator().manual_seed(seed))


def _decode(model, placement, policy, gen=GEN, capacity=None, allocator=None, close=True):
    """(tokens [B, gen], logits [B, gen, V], session) of greedy decoding from one unpadded batch of prompts."""
    return run_placed(model, placement, policy, capacity=capacity, allocator=allocator, gen=gen, keep=not close,
                      prompts=(_tokens(), None))


def _make(name, model):
    if name == "streaming":
        return make_policy("streaming", sinks=2, window=6)
    if name == "h2o":
        return make_policy("h2o", heavy=4, recent=3)
    return selective_policy(name, model)  # InfiniGen over random skew matrices, without its 32-token floor


@pytest.fixture(scope="module")
def model():
    from support.models import build_tiny
    return build_tiny("llama")[1]


@pytest.mark.parametrize("policy", ["infinigen", "h2o", "streaming", "planned-random"])
@pytest.mark.parametrize("kind", ["disk", "cpu"])
def test_row_cache_changes_no_token(model, policy, kind, tmp_path):
    """On and off give the same tokens and bit-identical logits; the cache served part of the rows."""
    mk = (lambda: offload_policy(policy, model)) if policy == "planned-random" else (lambda: _make(policy, model))
    off_t, off_l, off = _decode(model, Placement(kind, pool_dir=str(tmp_path), row_cache_bytes=0), mk())
    on_t, on_l, on = _decode(model, Placement(kind, pool_dir=str(tmp_path), row_cache_bytes=BIG), mk())
    assert torch.equal(on_t, off_t) and torch.equal(on_l, off_l)
    assert off.store.row_cache is None and on.store.row_cache is not None
    st = on.store.stats
    assert st.row_hits > 0 and st.rows_moved < off.store.stats.rows_moved
    assert len(st.row_steps) == GEN and sum(s[0] for s in st.row_steps) == st.row_hits
    assert os.listdir(tmp_path) == []


def test_fetches_only_the_rows_it_lacks(model):
    """Attention sinks and a recent window: each step selects the rows of the last step but one new token
    (the one appended last step) per sequence and KV head. With the cache, the first step fetches all 8
    rows of each (sequence, KV head), every later step exactly the one new row; the bytes read at the tier
    (every aten read of the pool's storage) are those rows and match the store's count. Without the cache
    every step reads all 8. A cache of exactly one step's rows does as well: the rows a step selects again
    are the last it evicts."""
    layers, bh = model.cfg.num_layers, B * model.cfg.num_kv_heads
    slow_rows = (PROMPT + GEN) * bh
    exact = layers * (slow_rows * 4 + 8 * bh * RowCache.bytes_per_row(model.cfg.head_dim, model.dtype))
    read = {}
    for size in (0, BIG, exact):  # exact: one step's selection, so the LRU must keep the rows selected again
        pl = Placement("cpu", row_cache_bytes=size, threaded=False)  # inline: SlowReads sees the fetches
        sess = pl.new_session(model, B, PROMPT + GEN, make_policy("streaming", sinks=2, window=6))
        store = sess.store
        row = 2 * store.layout.row_bytes
        logits = runtime.prefill(model, _tokens(), sess)
        store.stats.reset()
        per_step = []
        for _ in range(GEN):
            with SlowReads(store) as reads:
                logits = runtime.decode(model, logits.argmax(-1), sess)
            per_step.append(reads.bytes)
        read[size] = per_step
        st = store.stats
        assert sum(per_step) == st.bytes_moved
        if size:
            assert [s[2] for s in st.row_steps] == [8 * bh * layers] + [bh * layers] * (GEN - 1)
            assert [s[3] for s in st.row_steps] == per_step
            assert st.row_steps[1][:2] == [7 * bh * layers, 8 * bh * layers]  # 7 of 8 distinct rows were held
            assert st.hit_rate() == pytest.approx(7 * (GEN - 1) / (8 * GEN))
        pl.close(sess)
    assert read[0] == [8 * bh * layers * row] * GEN
    assert read[BIG] == read[exact] == [8 * bh * layers * row] + [bh * layers * row] * (GEN - 1)


def test_the_byte_bound_holds(model, tmp_path):
    """A cache of a few rows per layer: never more entries than its rows, its bytes within the bound and
    counted in the store's fast bytes and peak; the tokens are still the uncached ones."""
    cfg = model.cfg
    slow_rows = (PROMPT + GEN) * B * cfg.num_kv_heads
    per_row = RowCache.bytes_per_row(cfg.head_dim, model.dtype)
    bound = cfg.num_layers * (slow_rows * 4 + 5 * per_row) + 3  # 5 rows a layer, a few bytes to spare
    pol = lambda: _make("streaming", model)  # noqa: E731
    ref_t, ref_l, _ = _decode(model, Placement("disk", pool_dir=str(tmp_path), row_cache_bytes=0), pol())
    on_t, on_l, sess = _decode(model, Placement("disk", pool_dir=str(tmp_path), row_cache_bytes=bound), pol(),
                               close=False)
    store, cache = sess.store, sess.store.row_cache
    assert cache.rows == 5 and 0 < cache.nbytes() <= bound
    for part in cache._parts:
        if part is not None:
            held = part["map"] >= 0
            assert int(held.sum()) <= 5 and int((part["owner"] >= 0).sum()) == int(held.sum())
            assert torch.equal(part["owner"][part["map"][held].long()], held.nonzero().squeeze(1))  # map <-> owner
    off = Placement("disk", pool_dir=str(tmp_path), row_cache_bytes=0).new_store(model, B, PROMPT + GEN)
    assert store.fast_bytes() >= off.fast_bytes() + cache.nbytes()
    assert store.peak_fast_bytes() >= cache.nbytes() + off.fast_bytes()
    off.close()
    Placement.close(sess)
    assert torch.equal(on_t, ref_t) and torch.equal(on_l, ref_l)
    assert store.stats.row_hits > 0  # even 5 rows a layer catch the sinks


@pytest.mark.parametrize("allocator", ["fifo-local", "lru"])
def test_reused_slots_are_not_served_from_the_cache(model, allocator, tmp_path, monkeypatch):
    """A pool of PROMPT + 2 slots: later tokens overwrite victims (FIFO takes the sinks' slots first, which
    the cache holds; LRU the prompt's middle). The cached run gives the in-memory store's tokens and logits
    under the same victim policy. Under FIFO, with invalidation switched off the cache serves the evicted
    tokens' rows and the logits differ: this test sees the bug it guards against."""
    from infinigen import pool

    def alloc():
        return FifoVictims() if allocator == "fifo-local" else pool.make_pool(allocator)

    cap = PROMPT + 2
    pol = lambda: make_policy("streaming", sinks=2, window=6)  # noqa: E731
    ref_t, ref_l, _ = _decode(model, Placement("none"), pol(), capacity=cap, allocator=alloc())
    pl = Placement("disk", pool_dir=str(tmp_path), row_cache_bytes=BIG)
    on_t, on_l, sess = _decode(model, pl, pol(), capacity=cap, allocator=alloc())
    assert sess.store.capacity == cap and sess.store.stats.row_hits > 0
    assert torch.equal(on_t, ref_t) and torch.allclose(on_l, ref_l, atol=1e-5, rtol=0)
    if allocator == "lru":  # LRU takes prompt slots no step read (never cached) within these steps
        return
    monkeypatch.setattr(RowCache, "invalidate", lambda self, layer, rows: None)
    _, bad_l, _ = _decode(model, pl, pol(), capacity=cap, allocator=alloc())
    assert not torch.allclose(bad_l, ref_l, atol=1e-3, rtol=0)


@pytest.mark.parametrize("kind", ["disk", "cpu"])
def test_off_is_the_default_and_todays_store(model, kind, tmp_path):
    """The default is 0 bytes: no cache, no per-step counters, every selected row of every step fetched
    from the slow tier, as before the cache (the same fetches, rows and bytes as a store of that tier
    with no cache at all)."""
    assert Placement().row_cache_bytes == 0
    pl = Placement(kind, pool_dir=str(tmp_path), threaded=False, disk_bulk_share=1)  # disk: rows, never whole layers
    _, _, sess = _decode(model, pl, _make("streaming", model))
    st = sess.store.stats
    assert sess.store.row_cache is None and st.row_steps == [] and st.hit_rate() is None and st.row_lookups == 0
    # sinks 2 + window 6 per sequence and KV head, each step, every layer
    bh, layers = B * model.cfg.num_kv_heads, model.cfg.num_layers
    assert st.rows_moved == GEN * layers * 8 * bh and st.fetches == GEN * layers
    assert st.bytes_moved == st.rows_moved * 2 * sess.store.layout.row_bytes


def test_row_cache_values_are_checked(model):
    for bad in (-1, True, 1.5, "1M"):
        with pytest.raises(UserError, match="row_cache_bytes"):
            Placement("disk", row_cache_bytes=bad)
    with pytest.raises(UserError, match="offloaded"):
        Placement("none", row_cache_bytes=1 << 20)
    with pytest.raises(UserError, match="holds no row"):
        Placement("cpu", row_cache_bytes=100).new_store(model, B, 64)


def test_bench_reports_the_hit_rate_per_step(tiny_checkpoint, tmp_path, capsys):
    from infinigen.cli import main
    out = tmp_path / "b.json"
    base = ["bench", "-m", str(tiny_checkpoint), "--kv-offload", "disk", "--policy", "streaming", "--knob",
            "sinks=2", "--knob", "window=6", "--no-ideal", "--no-transformers", "--prompt-len", "24", "--gen-len", "5",
            "--batch-size", "2", "--dtype", "float32", "--pool-dir", str(tmp_path)]
    assert main(base + ["--row-cache-bytes", "4M", "--json", str(out)]) == 0
    assert "row cache 4.0 MB, hit rate" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    rates = row["row_cache_hit_rate_per_step"]
    assert len(rates) == 4 and rates[0] == 0 and all(r > 0.5 for r in rates[1:])
    assert row["slow_rows_fetched_per_step"][0] > row["slow_rows_fetched_per_step"][1] > 0
    assert main(base + ["--row-cache-bytes", "lots"]) == 2
    assert "--row-cache-bytes" in capsys.readouterr().err
    assert main(base + ["--row-cache-bytes", "0", "--json", str(out)]) == 0
    assert "row_cache_hit_rate" not in json.loads(out.read_text())["rows"][0]


@pytest.mark.parametrize("prefetch,threaded", [(False, True), (True, False)])
def test_on_demand_and_inline_fetches(model, prefetch, threaded, tmp_path):
    """Without prefetching (every fetch on demand, on the main thread) or with the worker inline, the cache
    gives the same tokens and logits and the same hits per step as the threaded prefetch."""
    def run(**kw):
        pl = Placement("disk", pool_dir=str(tmp_path), row_cache_bytes=BIG, **kw)
        t, lg, sess = _decode(model, pl, _make("infinigen", model))
        return t, lg, sess.store.stats
    ref_t, ref_l, ref = run()
    t, lg, st = run(prefetch=prefetch, threaded=threaded)
    assert torch.equal(t, ref_t) and torch.equal(lg, ref_l)
    assert st.row_steps == ref.row_steps and len(st.row_steps) == GEN and st.row_hits > 0
    assert (st.on_demand > 0) == (not prefetch)
