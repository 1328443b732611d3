"""Every KV-cache policy: unlimited budgets reduce to the dense result, teacher-forced evaluation
reproduces real token-by-token decoding (logits and selections, with and without a pool limit), and
each method's budget means what it says. On the `device` fixture's device (INFINIGEN_TEST_DEVICE)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from infinigen import runtime
from infinigen.errors import UserError
from infinigen.policies import make_policy
from infinigen.selection import ALL
from infinigen.policies.quant import dequantize, fake_quantize, quantize
from infinigen.placement import Placement

T, P, B = 28, 9, 2  # sequence length, prefill length, batch

HAVE_INFINIGEN = importlib.util.find_spec("infinigen.policies.infinigen") is not None

# (name, knobs) with a budget that reads everything: must equal the dense cache
UNLIMITED = [
    ("full", {}),
    ("h2o", dict(heavy=10**6, recent=10**6)),
    ("h2o", dict(heavy_ratio=1.0, recent_ratio=0.0)),
    ("int4", dict(bits=16)),
    ("streaming", dict(sinks=0, window=10**6)),
    ("streaming", dict(ratio=1.0)),
    ("oracle", {}),
    ("oracle", dict(ratio=1.0)),
    ("oracle", dict(alpha=1e9)),
]
# budgets that really drop entries: teacher-forced must still equal decoding
LIMITED = [
    ("full", {}),
    ("h2o", dict(heavy=3, recent=2)),
    ("h2o", dict(heavy_ratio=0.2, recent_ratio=0.15)),
    ("int4", {}),
    ("int4", dict(bits=2, group=4)),
    ("streaming", dict(sinks=2, window=3)),
    ("streaming", dict(ratio=0.4)),
    ("oracle", dict(ratio=0.3)),
    ("oracle", dict(tokens=4)),
    ("oracle", dict(alpha=1.0)),
    ("oracle", dict(ratio=0.2, dense_layers="0")),
]
if HAVE_INFINIGEN:  # helper policies get random orthogonal skew matrices ("random") or none
    UNLIMITED += [("infinigen", dict(alpha=1e9, max_fetch_ratio=1.0, dense_layers=(), skew=False)),
                  ("infinigen", dict(preset="paper", alpha=1e9, max_fetch_ratio=1.0, dense_layers=(),
                                     matrices="random"))]
    LIMITED += [("infinigen", dict(dense_layers=(), matrices="random")),
                ("infinigen", dict(preset="paper", alpha=1.0, dense_layers=(), matrices="random")),
                ("infinigen", dict(budget="per_head", alpha=0.5, dense_layers=(), skew=False))]


def _policy(name, knobs, model):
    """make_policy, with matrices="random" replaced by random orthogonal skew matrices for `model`."""
    knobs = dict(knobs)
    if knobs.pop("matrices", None) == "random":
        c = model.cfg
        g = torch.Generator().manual_seed(3)
        return make_policy(name, **knobs).with_skew(torch.linalg.qr(torch.randn(
            c.num_layers, c.num_kv_heads, c.head_dim, c.head_dim, generator=g, dtype=torch.float64))[0])
    return make_policy(name, **knobs)


def _ids(cases):
    return [f"{n}-" + ",".join(f"{k}={v}" for k, v in kw.items() if k != "matrices") for n, kw in cases]


def _tokens(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (B, T), generator=g).to(model.device)


class FifoPool:
    """A minimal pool allocator (oldest position out) so these tests do not depend on infinigen.pool."""

    def begin(self, num_layers, batch, kv_heads, capacity, device):
        pass

    def victims(self, layer, store):
        return store.pos[layer].argmin(-1)

    def on_write(self, layer, slots):
        pass

    def on_read(self, layer, mask):
        pass


def _pool(victim):
    try:
        from infinigen.pool import make_pool
    except ImportError:  # the pool module is optional for these tests
        return FifoPool()
    return make_pool(victim)


class Recorder(runtime.Listener):
    """Listens to a session to record, per (layer, position), which past positions were read:
    bool [B, Hkv, T] over token positions (slots are mapped through the rows' entry positions)."""

    def __init__(self, policy, t):
        self.policy, self.t, self.seen = policy, t, {}

    def on_select(self, layer, rows, keep, sess):
        keep = rows.valid if keep is ALL else keep & rows.valid
        keep = keep.expand(sess.batch, sess.model.cfg.num_kv_heads, rows.count, -1)
        pos = rows.entry_pos.expand(*keep.shape[:2], -1)
        for i in range(rows.count):
            out = torch.zeros(*keep.shape[:2], self.t + 1, dtype=torch.bool, device=keep.device)
            out.scatter_(2, torch.where(keep[:, :, i], pos, self.t), True)
            self.seen[(layer, int(rows.positions[0, i]))] = out[..., :self.t]


def _decode_all(model, policy, tokens, capacity=None, allocator=None, listeners=()):
    """Real decoding: prefill P tokens, then one token at a time. Logits [B, T-P+1, V] for rows P-1.."""
    sess = Placement(capacity=capacity).new_session(model, B, T, policy, allocator=allocator, listeners=listeners)
    out = [runtime.prefill(model, tokens[:, :P], sess)]
    for t in range(P, T):
        out.append(runtime.decode(model, tokens[:, t], sess))
    return torch.stack(out, 1), sess


def _teacher_forced(model, policy, tokens, capacity=None, allocator=None, listeners=()):
    sess = Placement(capacity=capacity).new_session(model, B, T, policy, allocator=allocator, listeners=listeners)
    return runtime.teacher_forced(model, tokens, P, sess), sess


@pytest.mark.parametrize("name,knobs", UNLIMITED, ids=_ids(UNLIMITED))
def test_unlimited_budget_equals_dense(tiny, name, knobs):
    tokens = _tokens(tiny)
    dense, _ = _teacher_forced(tiny, make_policy("full"), tokens)
    tf, sess = _teacher_forced(tiny, _policy(name, knobs, tiny), tokens)
    assert (tf - dense).abs().max() <= 1e-5
    dec, _ = _decode_all(tiny, _policy(name, knobs, tiny), tokens)
    assert (dec - dense[:, P - 1:]).abs().max() <= 1e-5
    layers = [i for i in range(tiny.cfg.num_layers)]
    assert sess.stats.overall(layers) == pytest.approx(1.0)


@pytest.mark.parametrize("pool", [None, "fifo", "counter"], ids=["nopool", "fifo", "counter"])
@pytest.mark.parametrize("name,knobs", LIMITED, ids=_ids(LIMITED))
def test_teacher_forced_equals_decoding(tiny, name, knobs, pool):
    tokens = _tokens(tiny)
    cap = T - 6 if pool else None  # the last 6 tokens overwrite slots: the runtime's replay path
    pol_tf, pol_dec = Recorder(_policy(name, knobs, tiny), T), Recorder(_policy(name, knobs, tiny), T)
    tf, s_tf = _teacher_forced(tiny, pol_tf.policy, tokens, cap, _pool(pool) if pool else None, [pol_tf])
    dec, s_dec = _decode_all(tiny, pol_dec.policy, tokens, cap, _pool(pool) if pool else None, [pol_dec])
    assert (tf[:, P - 1:] - dec).abs().max() <= 1e-4
    assert pol_tf.seen.keys() == pol_dec.seen.keys()
    for key in pol_dec.seen:
        assert torch.equal(pol_tf.seen[key], pol_dec.seen[key]), key
    assert s_tf.stats.per_layer() == pytest.approx(s_dec.stats.per_layer(), abs=1e-6)


# ---- budget semantics ----------------------------------------------------------------------------
def _decode_recorded(model, name, **knobs):
    rec = Recorder(make_policy(name, **knobs), T)
    _decode_all(model, rec.policy, _tokens(model), listeners=[rec])
    return rec.seen


def test_h2o_keeps_heavy_plus_recent_and_evicts_for_good(tiny):
    heavy, recent = 3, 2
    seen = _decode_recorded(tiny, "h2o", heavy=heavy, recent=recent)
    for layer in range(tiny.cfg.num_layers):
        prev = None
        for t in range(P, T):
            sel = seen[(layer, t)]
            assert (sel.sum(-1) == min(t, heavy + recent)).all()
            assert sel[..., t - recent:t].all()  # the recent window is always there
            if prev is not None:  # nothing evicted comes back: only the newest token may join
                grew = sel & ~prev
                assert not grew[..., :t - 1].any()
            prev = sel


def test_h2o_heavy_hitters_are_the_highest_accumulated_scores(tiny):
    """The first eviction after the prompt keeps the prompt tokens with the largest attention column sums."""
    pol = make_policy("h2o", heavy=2, recent=1)
    rec = Recorder(pol, T)
    sess = Placement().new_session(tiny, 1, T, pol, listeners=[rec])
    tokens = _tokens(tiny)[:1]
    runtime.prefill(tiny, tokens[:, :P], sess)
    layer = 0
    colsum = sess.state.score[layer][:, :, :P].clone()
    # independent column sums of the prompt's causal attention (layer 0: input = embeddings)
    with torch.inference_mode():
        pos = torch.arange(P, device=tiny.device)[None]
        x = tiny.layers[0].attn_norm(tiny.embed(tokens[:, :P], pos))
        q, k, _ = tiny.qkv(0, x, pos)
    g = q.shape[1] // k.shape[1]
    s = torch.matmul(q, k.repeat_interleave(g, 1).transpose(-1, -2)) * tiny.scale
    s = s.masked_fill(~torch.ones(P, P, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    ref = torch.softmax(s, -1).sum(2).view(1, k.shape[1], g, P).sum(2)
    assert torch.allclose(colsum, ref, atol=1e-5)
    runtime.decode(tiny, tokens[:, P], sess)
    sel = rec.seen[(layer, P)][..., :P]
    for h in range(k.shape[1]):
        older = ref[0, h, :P - 1]
        expect = set(older.topk(2).indices.tolist()) | {P - 1}
        assert set(sel[0, h].nonzero().flatten().tolist()) == expect


def test_h2o_ratio_budget(tiny):
    seen = _decode_recorded(tiny, "h2o", heavy_ratio=0.25, recent_ratio=0.25)
    for layer in range(tiny.cfg.num_layers):
        have = P  # entries alive before the first step; eviction is permanent, so a budget that
        for t in range(P, T):  # grows faster than one token per step is capped by what is left
            n = seen[(layer, t)].sum(-1)
            assert (n == min(int(0.25 * t) * 2, have)).all()
            have = min(int(0.25 * t) * 2, have) + 1


@pytest.mark.parametrize("sinks,window", [(2, 3), (0, 5), (4, 0)])
def test_streaming_keeps_sinks_and_window(tiny, sinks, window):
    seen = _decode_recorded(tiny, "streaming", sinks=sinks, window=window)
    for (layer, t), sel in seen.items():
        expect = torch.zeros(T, dtype=torch.bool, device=sel.device)
        expect[:min(sinks, t)] = True
        expect[max(0, t - window):t] = True
        assert torch.equal(sel, expect.expand_as(sel)), (layer, t)


def test_streaming_ratio_budget(tiny):
    seen = _decode_recorded(tiny, "streaming", sinks=2, ratio=0.5)
    for (layer, t), sel in seen.items():
        assert (sel.sum(-1) == int(0.5 * t)).all()
        assert sel[..., :2].all() and sel[..., t - 1].all()


def test_int4_error_bounded_by_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 17, 128, generator=g) * torch.linspace(0.1, 5, 128)
    for bits, group in [(4, 64), (4, 32), (3, 64), (8, 128), (4, 48)]:
        y = fake_quantize(x, bits, group)
        codes, scale, lo = quantize(x, bits, group)
        # the packed form decodes to exactly the fake-quantized values
        assert torch.equal(dequantize(codes, scale, lo, bits, x.shape[-1], group=group), y)
        if bits <= 4:
            assert codes.dtype == torch.uint8 and codes.shape[-1] == (min(group, 128) + 1) // 2
        # per element error <= scale / 2 of its group
        assert scale.shape[-2] == -(-128 // group)  # ragged tail: its own group
        step = scale.expand(*scale.shape[:-1], group).flatten(-2)[..., :128]
        assert ((y - x).abs() <= step / 2 + 1e-6).all()
        assert (y - x).abs().max() > 0
    assert torch.equal(fake_quantize(x, 16), x)
    const = torch.full((2, 64), 3.25)
    assert torch.equal(fake_quantize(const), const)  # a constant group is exact


def test_int4_store_holds_quantized_values(tiny):
    pol = make_policy("int4")
    sess = Placement().new_session(tiny, B, T, pol)
    tokens = _tokens(tiny)
    runtime.prefill(tiny, tokens[:, :P], sess)
    runtime.decode(tiny, tokens[:, P], sess)
    ref = Placement().new_session(tiny, B, T)
    runtime.prefill(tiny, tokens[:, :P], ref)
    runtime.decode(tiny, tokens[:, P], ref)
    for layer in range(tiny.cfg.num_layers):
        k, v, _, _ = sess.store.past(layer)
        k0, v0, _, _ = ref.store.past(layer)
        if layer == 0:  # layer 0 sees the same input either way
            assert torch.allclose(k, fake_quantize(k0), atol=1e-6)
        for x in (k, v):  # on a 4-bit grid: re-quantizing changes nothing, <= 16 levels per group
            assert torch.allclose(fake_quantize(x), x, atol=1e-6)
            assert max(len(row.unique()) for row in x.reshape(-1, x.shape[-1])) <= 16
        assert not torch.equal(k, k0)


class _QK:
    """Records what the oracle's selection of teacher-forced rows sees, to score it independently."""

    def __init__(self, policy):
        self.qk = {}
        inner = policy.keep

        def keep(layer, rows, sess):
            out = inner(layer, rows, sess)
            if not rows.in_store:
                self.qk[layer] = (rows.query.clone(), rows.keys.clone(), rows.first, out.clone())
            return out
        object.__setattr__(policy, "keep", keep)


@pytest.mark.parametrize("knobs", [dict(ratio=0.3), dict(tokens=5), dict(alpha=1.5)], ids=str)
def test_oracle_picks_the_true_top_tokens(tiny, knobs):
    pol = make_policy("oracle", **knobs)
    spy = _QK(pol)
    _teacher_forced(tiny, pol, _tokens(tiny))
    for layer, (q, k, p, keep) in spy.qk.items():
        g = q.shape[1] // k.shape[1]
        kk = k.repeat_interleave(g, 1)
        for r in range(q.shape[2]):
            row = p + r
            s = torch.einsum("bhd,bhtd->bht", q[:, :, r], kk[:, :, :row + 1]) * tiny.scale
            got = keep[:, :, r, :row]
            if "alpha" in knobs:
                past = s[..., :row]
                sel = past > past.amax(-1, keepdim=True) - knobs["alpha"]
                expect = sel.view(B, k.shape[1], g, row).any(2)
                assert torch.equal(got, expect)
            else:
                prob = torch.softmax(s, -1)[..., :row].view(B, k.shape[1], g, row).amax(2)
                n = int(knobs["ratio"] * row) if "ratio" in knobs else min(knobs["tokens"], row)
                assert (got.sum(-1) == n).all()
                # every chosen token outranks every token left out
                lo = prob.masked_fill(~got, float("inf")).amin(-1)
                hi = prob.masked_fill(got, float("-inf")).amax(-1)
                assert (lo >= hi).all()


@pytest.mark.parametrize("name,knobs", [
    ("h2o", dict(heavy=-1)), ("h2o", dict(recent_ratio=1.5)), ("int4", dict(bits=12)),
    ("streaming", dict(window=-2)), ("streaming", dict(ratio=2.0)), ("oracle", dict(ratio=0.1, alpha=3.0)),
    ("oracle", dict(ratio=-0.1)), ("oracle", dict(dense_layers="0,x")),
])
def test_bad_knobs_are_user_errors(name, knobs):
    with pytest.raises(UserError):
        make_policy(name, **knobs)


PLANNED = [("h2o", dict(heavy=3, recent=2)), ("streaming", dict(sinks=2, window=3)), ("int4", {}), ("full", {}),
           ("infinigen", dict(dense_layers=(0,), query="ahead", matrices="random")),  # speculates from attn_out
           ("infinigen", dict(preset="paper", alpha=1.0, dense_layers=(0,), matrices="random"))]  # from attn_in


@pytest.mark.parametrize("name,knobs", PLANNED, ids=_ids(PLANNED))
def test_planned_selection_matches_select(tiny, name, knobs):
    """Policies that know their selection before the step must say so one layer early: the session's plan
    for `layer` is ready right after layer-1's last hook (for layer 0, after the step's first hook), which
    is when placement asks for it to start the transfer, and it is exactly what the layer then reads."""
    pol = _policy(name, knobs, tiny)
    plans, checked = {}, []

    class Check(runtime.Listener):
        def snapshot(self, layer, sess):
            plan = sess.planned(layer)
            plans[layer] = plan.clone() if isinstance(plan, torch.Tensor) else plan

        def on_hidden(self, layer, point, x, sess):
            if sess.decoding and layer == -1:
                self.snapshot(0, sess)
            if sess.decoding and point == "attn_out" and layer + 1 < tiny.cfg.num_layers:
                self.snapshot(layer + 1, sess)

        def on_select(self, layer, rows, keep, sess):
            plan = plans.pop(layer)
            got = keep if keep is ALL else keep[:, :, 0]
            assert plan is not None, f"layer {layer}: no plan one layer ahead"
            assert (plan is ALL and got is ALL) or torch.equal(plan, got), layer
            checked.append(layer)

    _decode_all(tiny, pol, _tokens(tiny), listeners=[Check()])
    assert len(checked) == (T - P) * tiny.cfg.num_layers and not plans


def test_oracle_dense_layers_read_everything(tiny):
    _, sess = _teacher_forced(tiny, make_policy("oracle", ratio=0.2, dense_layers=(0,)), _tokens(tiny))
    per = sess.stats.per_layer()
    assert per[0] == pytest.approx(1.0) and per[1] < 0.25
