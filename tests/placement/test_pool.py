"""KV pool manager (infinigen.pool): capacity, victim policies, and InfiniGen's partial key cache
staying consistent when slots are overwritten."""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infinigen import runtime
from infinigen.cache import KVStore
from infinigen.errors import UserError
from infinigen.pool import KVPool, make_pool
from infinigen.placement import Placement

B, H, D = 2, 2, 4


def _store(pool: KVPool, capacity: int, prompt: int) -> KVStore:
    store = KVStore(1, B, H, capacity, D, torch.float32, allocator=pool)
    pool.begin(1, B, H, capacity, "cpu")
    k = torch.randn(B, H, prompt, D)
    store.write_prompt(0, k, k, torch.ones(B, prompt, dtype=torch.bool), torch.arange(prompt).expand(B, prompt))
    return store


def _append(store: KVStore, pos: int) -> torch.Tensor:
    k = torch.full((B, H, 1, D), float(pos))
    return store.append(0, k, k, torch.full((B,), pos))


@settings(max_examples=40, deadline=None)
@given(victim=st.sampled_from(["counter", "lru", "fifo"]), capacity=st.integers(2, 12), prompt=st.integers(1, 12),
       steps=st.integers(1, 40), seed=st.integers(0, 2**16), protect=st.integers(0, 3), sinks=st.integers(0, 2))
def test_capacity_never_exceeded(victim, capacity, prompt, steps, seed, protect, sinks):
    prompt = min(prompt, capacity)
    protect = min(protect, capacity - 1)
    sinks = min(sinks, capacity - 1 - protect, prompt)
    pool = make_pool(victim, protect_recent=protect, protect_sinks=sinks)
    store = _store(pool, capacity, prompt)
    g = torch.Generator().manual_seed(seed)
    for t in range(prompt, prompt + steps):
        n = store.length[0]
        slots = _append(store, t)
        pool.on_read(0, torch.rand(B, H, n, generator=g) < 0.5)
        assert store.length[0] <= capacity
        assert ((slots >= 0) & (slots < capacity)).all()
        pos = store.pos[0][:, :, :store.length[0]]
        assert (pos.gather(2, slots[:, :, None]) == t).all()  # the new token is where the store says
        # every token is held at most once, and the newest `protect` tokens are all still there
        for b in range(B):
            for h in range(H):
                held = pos[b, h].tolist()
                assert len(set(held)) == len(held)
                assert set(range(max(0, t - protect + 1), t + 1)) <= set(held)
                assert set(range(sinks)) <= set(held)


def test_fifo_evicts_in_arrival_order():
    pool = make_pool("fifo")
    store = _store(pool, 5, 5)  # full after the prompt: tokens 0..4
    evicted = []
    for t in range(5, 17):
        before = store.pos[0].clone()
        slots = _append(store, t)
        pool.on_read(0, torch.ones(B, H, 5, dtype=torch.bool))
        evicted.append(before.gather(2, slots[:, :, None])[..., 0])
    evicted = torch.stack(evicted, -1)  # [B, H, steps]
    assert (evicted == torch.arange(12).expand(B, H, 12)).all()


def test_lru_evicts_least_recently_read():
    pool = make_pool("lru")
    store = _store(pool, 4, 4)
    read = torch.zeros(B, H, 4, dtype=torch.bool)
    read[:, :, 0] = True
    pool.on_read(0, read)  # token 0 read after every prompt token arrived: token 1 is the least recent
    _append(store, 4)
    assert (store.pos[0][:, :, 1] == 4).all()
    pool.on_read(0, read)  # token 0 again
    _append(store, 5)
    assert (store.pos[0][:, :, 2] == 5).all()  # then token 2
    pool.on_read(0, read)
    _append(store, 6)
    assert (store.pos[0][:, :, 3] == 6).all()  # then token 3; token 0 stays, read at every step


@settings(max_examples=20, deadline=None)
@given(saturate=st.integers(2, 20), reads=st.integers(1, 60), seed=st.integers(0, 2**16))
def test_counters_halve_on_saturation(saturate, reads, seed):
    pool = KVPool("counter", saturate=saturate)
    capacity = 4
    _store(pool, capacity, capacity)  # the pool begins with the store
    g = torch.Generator().manual_seed(seed)
    model = torch.zeros(B, H, capacity, dtype=torch.long)
    for _ in range(reads):
        mask = torch.rand(B, H, capacity, generator=g) < 0.7
        pool.on_read(0, mask)
        model += mask.long()
        sat = (model >= saturate).any(-1, keepdim=True)
        model = torch.where(sat, model // 2, model)
        assert torch.equal(pool.count[0].long(), model)
        assert (pool.count[0] < saturate).all()


def test_counter_victim_is_least_read_then_oldest():
    pool = make_pool("counter")
    store = _store(pool, 4, 4)
    read = torch.tensor([True, False, True, False]).expand(B, H, 4)
    pool.on_read(0, read)
    _append(store, 4)
    assert (store.pos[0][:, :, 1] == 4).all()  # slots 1 and 3 never read: the older (1) goes
    pool.on_read(0, torch.zeros(B, H, 4, dtype=torch.bool))
    _append(store, 5)
    assert (store.pos[0][:, :, 3] == 5).all()  # then slot 3 (count 0, older than token 4 in slot 1)
    # the new token's slot did not inherit the reads of the token it replaced
    assert (pool.count[0][:, :, 3] == 0).all()


def test_read_of_overwritten_slot_not_credited_to_new_token():
    pool = make_pool("counter")
    store = _store(pool, 3, 3)
    _append(store, 3)  # victim: slot 0 (all counts 0, oldest)
    pool.on_read(0, torch.ones(B, H, 3, dtype=torch.bool))  # this step read the old slot 0 too
    assert pool.count[0][:, :, 0].eq(0).all() and pool.count[0][:, :, 1:].eq(1).all()


def test_invalid_slots_go_first_and_bad_settings():
    pool = make_pool("counter")
    store = KVStore(1, 1, 1, 3, D, torch.float32, allocator=pool)
    pool.begin(1, 1, 1, 3, "cpu")
    k = torch.randn(1, 1, 3, D)
    store.write_prompt(0, k, k, torch.tensor([[False, True, True]]), torch.tensor([[0, 0, 1]]))  # left padding
    slots = store.append(0, k[:, :, :1], k[:, :, :1], torch.tensor([2]))
    assert slots.item() == 0
    with pytest.raises(UserError):
        make_pool("random")
    with pytest.raises(UserError):
        KVPool("counter", protect_recent=3).begin(1, 1, 1, 3, "cpu")


# ---- InfiniGen's partial key cache follows the pool --------------------------------------------------
@functools.lru_cache(maxsize=1)
def _tiny_llama():
    from support.models import build_tiny
    return build_tiny("llama")[1]


@settings(max_examples=8, deadline=None)
@given(victim=st.sampled_from(["counter", "lru", "fifo"]), capacity=st.integers(6, 14), steps=st.integers(4, 24),
       key_mode=st.sampled_from(["partial", "int4"]), seed=st.integers(0, 100))
def test_partial_keys_match_pool(victim, capacity, steps, key_mode, seed):
    from infinigen.policies import make_policy
    model = _tiny_llama()
    c = model.cfg
    g = torch.Generator().manual_seed(seed)
    mats = torch.linalg.qr(torch.randn(c.num_layers, c.num_kv_heads, c.head_dim, c.head_dim, generator=g,
                                       dtype=torch.float64))[0]
    pol = make_policy("infinigen", dense_layers=(0,), key_mode=key_mode, alpha=2.0).with_skew(mats)
    pool = make_pool(victim)
    prompt = capacity - 2
    sess = Placement(capacity=capacity).new_session(model, 1, capacity + steps, pol, allocator=pool)
    tokens = torch.randint(0, c.vocab_size, (1, prompt + steps), generator=g)
    runtime.prefill(model, tokens[:, :prompt], sess)
    for t in range(prompt, prompt + steps):
        runtime.decode(model, tokens[:, t], sess)
    assert sess.store.length[1] == capacity and sum(pool.evictions) > 0
    for layer in range(1, c.num_layers):
        kp = sess.store.k[layer]  # [1, Hkv, capacity, d]
        # rows written one at a time vs all at once: equal up to float rounding of the rotation
        st = sess.state
        if key_mode == "int4":  # the packed 4-bit copy of every slot's rotated key, dequantized
            from infinigen.kernels.int4 import fake_quantize
            got = st.spec_keys[layer].dequantize(capacity)
            want = fake_quantize(pol.speculation.rotate(st, kp, layer), layout=st.layout)
        else:
            got, want = st.spec_keys[layer], pol.speculation.project(st, kp, layer).to(st.key_dtype)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"layer {layer}")
