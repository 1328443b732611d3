"""Memory accounting (`infinigen.memory`): every KV store reports its own fast- and slow-tier bytes, and a
session's bytes count its policy's per-request tensors wherever the state keeps them."""
from __future__ import annotations

import torch

from infinigen import runtime
from infinigen.memory import kv_bytes, session_bytes, storages, weight_bytes
from infinigen.placement import Placement
from infinigen.policies import make_policy


def _mats(model, seed=3):
    c = model.cfg
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(c.num_layers, c.num_kv_heads, c.head_dim, c.head_dim, generator=g,
                                       dtype=torch.float64))[0]


def _run(model, sess, t=24):
    tokens = torch.randint(3, model.cfg.vocab_size, (sess.batch, t), generator=torch.Generator().manual_seed(1))
    logits = runtime.prefill(model, tokens, sess)
    runtime.decode(model, logits.argmax(-1), sess)


def test_stores_report_their_tiers(make_tiny, tmp_path):
    _, model = make_tiny("llama")
    cfg = model.cfg
    sess = Placement().new_session(model, 2, 40)
    _run(model, sess)
    store = sess.store
    every = store.k + store.v + store.valid + store.pos
    assert store.fast_bytes() == sum(t.numel() * t.element_size() for t in every) > 0
    assert store.slow_bytes() == store.pool_file_bytes() == 0 and not store.offloaded
    assert store.peak_fast_bytes() == kv_bytes(cfg, 2, 40, model.dtype)
    off = Placement("disk", pool_dir=str(tmp_path)).new_session(model, 2, 40)
    _run(model, off)
    pool = off.store
    assert pool.offloaded and pool.slow_bytes() == pool.tier.nbytes == kv_bytes(cfg, 2, 40, model.dtype)
    assert pool.pool_file_bytes() >= pool.slow_bytes()
    meta = sum(t.numel() * t.element_size() for t in pool.valid + pool.pos)
    assert pool.peak_fast_bytes() >= pool.fast_bytes() > meta  # metadata plus the rows fetched for decoding
    assert session_bytes(off) == (pool.fast_bytes(), pool.slow_bytes())  # the full cache keeps no state
    pool.close()


def test_session_bytes_count_the_policy_state(make_tiny):
    """InfiniGen's 4-bit speculation keys live in `PackedKeys` objects inside its state: they count, the skew
    matrices every request shares do not."""
    _, model = make_tiny("llama")
    mats = _mats(model)
    pol = make_policy("infinigen", key_mode="int4", dense_layers=(0,)).with_skew(mats)
    sess = Placement().new_session(model, 2, 40, pol)
    _run(model, sess)
    packed = sum(p.nbytes for p in sess.state.spec_keys.values())
    assert packed > 0
    shared = storages(pol, {})
    fast, slow = session_bytes(sess, shared)
    assert slow == 0
    assert fast - sess.store.fast_bytes() >= packed
    assert fast < session_bytes(sess)[0]  # the matrices the state shares with the policy object ...
    assert session_bytes(sess, storages(sess.state.A, {}))[0] == fast  # ... are what `shared` leaves out
    assert weight_bytes(model) == sum(p.numel() * p.element_size() for p in model.parameters())
