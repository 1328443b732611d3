"""What a batch-1 selecting step does outside its native calls, counted (never timed): the operators InfiniGen's
fused path dispatches per selecting layer beyond the full cache's step (the query's and key's rotation inside the
native scorer and append, the remainder mixed inside the attention kernel, the layer cap computed on the host); and
that host cap equals the float32 tensor arithmetic `choose` uses where the lengths are data."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from infinigen import runtime
from infinigen.bench.dispatch import DispatchedCalls
from infinigen.kernels import fused_select
from infinigen.kernels.int4 import tinygemm_ok
from infinigen.placement import Placement
from infinigen.policies import make_policy
from infinigen.policies.cuts import layer_total, layer_totals
from support.models import build_tiny
from support.speculation import random_skew

needs_kernel = pytest.mark.skipif(not fused_select.available(), reason="the fused kernel cannot be built here")
needs_tinygemm = pytest.mark.skipif(not tinygemm_ok(64), reason="torch's CPU int4 kernel does not take this layout")

T, P = 128, 80  # a capacity of whole 64-slot blocks: the int4 kernel's layout
# operators a selecting layer dispatches beyond the full cache's layer at batch 1 (eager step, the fused path):
# measured -0.75: fewer than the full cache's, whose dense attention dispatches its own (7.25 with the native calls'
# eight outputs made by dispatched `empty` calls; 11.25 with the store's used slots sliced for the policy's `Rows`,
# which the fused path never reads; 16 with the row's cur, positions and past made per layer, the token's flat rows per
# layer and the kept counts viewed for the counters; 17 with the scores a tensor between two native calls, 78 with the
# rotation, the remainder's mix and the cap in torch calls), a bound under one more per layer (a native output made by
# a dispatched `empty` again adds one per layer)
EXTRA_PER_LAYER = -0.5
# operators the full cache's eager step of this 4-layer model dispatches: measured 249 (253 with the listeners' rows
# sliced where no listener reads them, 256 with the appended slot made per layer too), a bound under one more per layer
FULL_STEP = 250


def _calls_per_step(model, policy) -> tuple[int, object]:
    """Operators dispatched by the third decoding step after a P-token prompt (batch 1), and their names."""
    sess = Placement().new_session(model, 1, T, policy)
    tokens = torch.randint(3, model.cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(2))
    runtime.prefill(model, tokens[:, :P], sess)
    for t in range(P, P + 2):
        runtime.decode(model, tokens[:, t], sess)
    with DispatchedCalls() as counter:
        runtime.decode(model, tokens[:, P + 2], sess)
    return counter.calls, counter.by_op


@needs_kernel
@needs_tinygemm
def test_a_selecting_layer_dispatches_few_operators_beyond_the_full_cache():
    _, model = build_tiny("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          num_hidden_layers=4)
    policy = make_policy("infinigen", calibrate=False, dense_below=0, kv_budget=0.3, budget_growth=1.0, min_fetch=4,
                         remainder_from=0)
    policy = policy.with_skew(random_skew(model))
    full, full_ops = _calls_per_step(model, make_policy("full"))
    assert full <= FULL_STEP, f"{full} operators in the full cache's step: {dict(full_ops)}"
    selecting, ops = _calls_per_step(model, policy)
    layers = len(policy.selecting_layers(model.cfg))
    assert layers == model.cfg.num_layers
    extra = (selecting - full) / layers
    assert extra <= EXTRA_PER_LAYER, f"{extra:.1f} operators per selecting layer: {dict(ops - full_ops)}"


@needs_kernel
@needs_tinygemm
def test_a_listener_of_the_fused_path_sees_the_stores_used_slots():
    """The rows a selecting layer hands the policy and listeners slice the store only when read: a listener reading
    them gets the used slots' keys, valid marks [B, Hkv, 1, S] and positions as the store holds them then."""
    _, model = build_tiny("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          num_hidden_layers=2)
    policy = make_policy("infinigen", calibrate=False, dense_below=0, kv_budget=0.3, budget_growth=1.0, min_fetch=4,
                         remainder_from=0).with_skew(random_skew(model))
    seen = []

    class Reads(runtime.Listener):
        def on_select(self, layer, rows, keep, session):
            keys, _, valid, pos = session.store.past(layer)
            assert rows.in_store and rows.keys.shape == keys.shape and torch.equal(rows.keys, keys)
            assert torch.equal(rows.valid, valid[:, :, None]) and torch.equal(rows.entry_pos, pos)
            assert torch.equal(rows.positions, session.positions[:, rows.first:rows.first + 1])
            seen.append((layer, keys.shape[2]))

    sess = Placement().new_session(model, 1, T, policy, listeners=[Reads()])
    tokens = torch.randint(3, model.cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(3))
    runtime.prefill(model, tokens[:, :P], sess)
    for t in range(P, P + 3):
        runtime.decode(model, tokens[:, t], sess)
    assert seen == [(layer, n) for n in range(P, P + 3) for layer in range(2)]


def test_the_cap_on_the_host_equals_the_float32_tensor_arithmetic():
    """`layer_total` in plain numbers against `choose`'s float32 product on a tensor, for caps of every size and
    lengths up to 2^20 (where float32 no longer holds every integer times the heads)."""
    gen = np.random.default_rng(0)
    ratios = np.concatenate([gen.random(300), [0.1, 0.13, 0.2, 0.3, 1 / 3, 0.7, 1.0, 1e-6]])
    for ratio in ratios:
        for length in [*gen.integers(1, 1 << 20, 20), 1, 7, 2048, 8176, 8192, 32768]:
            for hkv in (1, 3, 8):
                tensor = torch.tensor(int(length)).view(1, 1, 1)
                want = int((float(ratio) * (tensor * hkv)).floor().clamp(min=hkv))
                assert layer_total(float(ratio), int(length), hkv, int(length), 1) == want, (ratio, length, hkv)


def test_every_layers_cap_at_once_equals_each_layers_own():
    """`layer_totals` (every selecting layer's cap of a step in one numpy call, as decoding's fused cut makes them)
    against `layer_total` per layer, bit for bit: caps of every size, lengths up to 2^20, floors of `min_fetch`."""
    gen = np.random.default_rng(1)
    ratios = [float(r) for r in np.concatenate([gen.random(200), [0.1, 0.13, 1 / 3, 0.7, 1.0, 1e-6, 0.0]])]
    for length in [*gen.integers(1, 1 << 20, 30), 1, 2, 7, 2048, 8176, 8192, 32768]:
        for hkv in (1, 3, 8):
            for min_fetch in (0, 1, 4, 64):
                want = [layer_total(r, int(length), hkv, int(length), min_fetch) for r in ratios]
                assert layer_totals(ratios, int(length), hkv, int(length), min_fetch) == want, (length, hkv)


@needs_tinygemm
@pytest.mark.parametrize("capacity", [2048 + 8, 1024 + 1, 8176 + 16, 4096 + 9, 512 + 9, 512 + 64 + 1])
def test_a_capacity_just_above_a_whole_block_keeps_the_int4_kernels_layout(capacity):
    """The speculation keys of a pool a few slots past a multiple of 64 are padded to whole blocks and scored by
    the int4 kernel (the rows layout's torch scorer took 2.6x the full cache's step at 2048 + 8, and a chat's step
    of 512 + 8 slots dispatched 6,767 aten operators)."""
    from infinigen.policies.speculation import int4_layout
    assert int4_layout(64, capacity, "cpu") == "tinygemm"


@needs_tinygemm
@pytest.mark.parametrize("capacity", [9, 100, 300, 450])
def test_a_small_pool_far_from_a_whole_block_keeps_the_rows_layout(capacity):
    """Below 512 slots a pool whose padding to 64-slot blocks would add more than 2.4% keeps the compact rows layout
    (its padding would be a larger share of the KV than speculation's own keys are meant to add)."""
    from infinigen.policies.speculation import int4_layout
    assert int4_layout(64, capacity, "cpu") == "rows"


@needs_kernel
@needs_tinygemm
@pytest.mark.parametrize("budget_growth,kv_budget", [(1.0, 0.3), (0.5, 0.04)])
def test_the_own_row_lane_equals_the_general_fused_path(monkeypatch, budget_growth, kv_budget):
    """Decoding's common selecting row taken straight to its packed rows (`InfiniGen._own_row_packed`) against the
    same step through `_decoding_row` and `select_row`'s fused cut: every layer's selection (what a listener hears),
    its remainder, the keys appended after it and the logits, bit for bit, step after step (the caps change with the
    length under budget_growth 0.5)."""
    from infinigen.policies.infinigen import InfiniGen
    _, model = build_tiny("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          num_hidden_layers=3)
    # alpha large: every slot passes the threshold, the cap decides (a cap of another length selects other rows)
    policy = make_policy("infinigen", calibrate=False, dense_below=0, kv_budget=kv_budget, budget_growth=budget_growth,
                         min_fetch=4, remainder_from=1, alpha=30.0).with_skew(random_skew(model))
    tokens = torch.randint(3, model.cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(5))
    lane = InfiniGen._own_row_packed
    taken = [0]

    def run(through_lane: bool):
        def own_row(self, layer, rows, session):
            got = lane(self, layer, rows, session) if through_lane else None
            taken[0] += got is not None
            return got
        monkeypatch.setattr(InfiniGen, "_own_row_packed", own_row)
        seen = []

        class Heard(runtime.Listener):
            def on_select(self, layer, rows, keep, session):
                seen.append(keep.clone())
        sess = Placement().new_session(model, 1, T, policy, listeners=[Heard()])
        runtime.prefill(model, tokens[:, :P], sess)
        logits = [runtime.decode(model, tokens[:, t], sess) for t in range(P, P + 6)]
        return torch.stack(logits), seen, sess.state.spec_keys
    want, seen_want, keys_want = run(False)
    assert taken[0] == 0
    got, seen_got, keys_got = run(True)
    assert taken[0] == 6 * model.cfg.num_layers  # every selecting layer of every step took the lane
    assert len(seen_got) == len(seen_want) and all(torch.equal(a, b) for a, b in zip(seen_got, seen_want))
    assert any(bool((~k).any()) for k in seen_got)  # entries left unread: the selections mean something
    assert all(torch.equal(keys_got[i].codes, keys_want[i].codes) and torch.equal(keys_got[i].sz, keys_want[i].sz)
               for i in keys_want)
    assert torch.equal(got, want)
