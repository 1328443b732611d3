"""InfiniGen's packed speculation keys: the scorer equals the fake-quantization reference, the selections of
teacher-forced, replayed and real decoding are identical in both PackedKeys layouts, and the speculation
state stays within the paper's budget of the KV bytes it covers."""
from __future__ import annotations

import pytest
import torch

import infinigen.policies.infinigen as ig
from infinigen import runtime
from infinigen.kernels.int4 import fake_quantize, tinygemm_ok
from infinigen.placement import Placement
from infinigen.policies import make_policy
from infinigen.policies.infinigen_select import select_row
from infinigen.pool import KVPool
from support.speculation import prefill_then_decode, random_skew, random_tokens, record_selections  # P = 12 too

T, P = 40, 12
LAYOUTS = ["rows", pytest.param("tinygemm", marks=pytest.mark.skipif(
    not tinygemm_ok(32), reason="torch's CPU int4 kernel does not take this layout on this build"))]


def _model(make_tiny, dtype=torch.float32, **kw):
    # head_dim 32: one group of 32 per token (the tinygemm kernel's smallest)
    cfg = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    cfg.update(kw)
    return make_tiny("llama", **cfg)[1].to(dtype)


@pytest.fixture
def layout(request, monkeypatch):
    monkeypatch.setattr(ig, "int4_layout", lambda d, capacity, device: request.param)
    return request.param


@pytest.mark.parametrize("layout", LAYOUTS, indirect=True)
def test_packed_scores_equal_fake_quantization(make_tiny, layout):
    model = _model(make_tiny)
    pol = make_policy("infinigen", dense_layers=(0,)).with_skew(random_skew(model))
    _, sess = prefill_then_decode(model, pol, random_tokens(model, t=T))
    st, store = sess.state, sess.store
    assert st.layout == layout and isinstance(st.spec_keys[2], ig.PackedKeys) and st.spec_keys[2].layout == layout
    layer = model.cfg.num_layers - 1
    n = store.length[layer]
    got = pol.speculation.scores(st, layer, 0, st.spec_keys[layer], n)
    qs = pol.speculation.queries(st, layer, slice(0, 1))[:, :, :, 0]
    keys = fake_quantize(pol.speculation.rotate(st, store.k[layer][:, :, :n], layer), layout=layout)
    want = qs @ keys.transpose(-1, -2)
    tol = 1e-5 if layout == "rows" else 1e-2  # tinygemm: bfloat16 queries and scores
    assert (got - want).abs().max() <= tol * want.abs().max()
    # no float copy of the context: the cache holds codes and scales, 40 B per token and KV head at d 32
    assert st.spec_keys[layer].nbytes <= store.capacity * model.cfg.num_kv_heads * 2 * (16 + 2 * 4) * 1.7


# A float64 model: the vectorized and the row-by-row attention of the dense layer 0 differ in summation
# order (1e-7 in float32, more in bfloat16), and 4-bit codes turn such a difference into a whole code step
# now and then (seen at head_dim 32); in float64 the speculation's float32 inputs are the same bits on every
# path, so any difference left would be the speculation's own.
@pytest.mark.parametrize("key_mode", ["int4", "partial", "int4-centred"])
@pytest.mark.parametrize("layout", LAYOUTS, indirect=True)
def test_selections_identical_teacher_replay_decode(make_tiny, layout, key_mode):
    if key_mode == "partial" and layout == "tinygemm":
        pytest.skip("the layout only concerns int4 keys")
    dtype = torch.float64
    model = _model(make_tiny, dtype)
    tokens = random_tokens(model, t=T)
    centre = key_mode == "int4-centred"
    key_mode = "int4" if centre else key_mode
    # the selections themselves, bit for bit: without the remainder, whose mixing rounds differently per path
    knobs = dict(alpha=1.0, max_fetch_ratio=0.3, min_fetch=0, dense_layers=(0,), key_mode=key_mode, remainder=False,
                 key_centre=centre)
    vec = record_selections(make_policy("infinigen", **knobs).with_skew(random_skew(model)))
    runtime.teacher_forced(model, tokens, P, Placement().new_session(model, 2, T, vec))
    rep = record_selections(make_policy("infinigen", **knobs).with_skew(random_skew(model)))
    runtime.teacher_forced(model, tokens, P, Placement().new_session(model, 2, T, rep, allocator=KVPool()))
    dec = record_selections(make_policy("infinigen", **knobs).with_skew(random_skew(model)))
    _, s_dec = prefill_then_decode(model, dec, tokens)
    if key_mode == "partial":
        assert s_dec.state.spec_keys[1].dtype == dtype and s_dec.state.proj[1].dtype == dtype  # the model's dtype
    assert set(vec.seen) == set(rep.seen) == set(dec.seen) == {1, 2}
    chosen = 0
    for layer in vec.seen:
        for r in range(T - P - 1):  # real decoding stops before the last token
            assert torch.equal(vec.seen[layer][r], rep.seen[layer][r]), (layer, r)
            assert torch.equal(vec.seen[layer][r], dec.seen[layer][r][:, :, :P + r]), (layer, r)
            chosen += int(vec.seen[layer][r].sum())
    assert 0 < chosen < sum(2 * model.cfg.num_kv_heads * (P + r) for r in range(T - P - 1)) * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("preset", ["default", "paper"])
def test_speculation_state_within_budget(make_tiny, preset, dtype):
    """The whole per-request speculation state (codes, scales, partial keys, indices, partial weights)
    against the KV bytes of the layers it covers, in the model's dtype: the int4 default within 16% in
    16 bits and 8% in float32; the paper's partial columns (30% of K in the model's dtype) within 16% in
    either (8% in float32 would need them in 16 bits, which makes float32 speculation inexact)."""
    model = _model(make_tiny, dtype, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                   max_position_embeddings=4096)  # head_dim 64, the paper's models'
    cap, b = 4096, 1
    pol = make_policy("infinigen", preset=preset).with_skew(random_skew(model))
    sess = Placement().new_session(model, b, cap, pol)
    runtime.prefill(model, random_tokens(model, b, 3000), sess)
    runtime.decode(model, random_tokens(model, b, 1)[:, 0], sess)
    c = model.cfg
    kv = c.num_layers * 2 * b * c.num_kv_heads * cap * c.head_dim * model.dtype.itemsize
    rep = pol.memory_report(model, sess.state, kv)
    assert rep["speculation_bytes"] == pol.fast_tier_bytes(sess.state)["speculation"] > 0
    if preset == "paper":  # partial keys and weights in the model's dtype
        assert sess.state.spec_keys[2].dtype == sess.state.proj[2].dtype == dtype
    else:
        assert isinstance(sess.state.spec_keys[2], ig.PackedKeys)
    covered = kv * len(sess.state.spec_layers) / c.num_layers
    assert rep["speculation_vs_kv"] == pytest.approx(rep["speculation_bytes"] / covered)
    bound = 0.16 if dtype == torch.bfloat16 or preset == "paper" else 0.08
    assert rep["speculation_vs_kv"] <= bound
    if preset == "paper" and dtype == torch.float32:
        assert rep["speculation_vs_kv"] > 0.08  # what the paper's layout costs in float32 (see the docstring)


@pytest.mark.parametrize("budget", ["union", "layer", "mean", "per_head"])
def test_host_caps_select_the_same(budget):
    """With every row's token count known on the host (`same`), the selection is the one computed from the
    valid mask (the synchronization-free path for union and layer)."""
    g = torch.Generator().manual_seed(0)
    for n, ratio in ((50, 0.14), (300, 0.05), (40, 1.0)):
        s = (torch.randn(2, 3, 4, 1, n, generator=g) * 3).round()  # ties
        valid = torch.ones(1, 1, 1, n, dtype=torch.bool)
        pol = ig.InfiniGen(budget=budget, max_fetch_ratio=ratio, min_fetch=4)
        want = pol._choose(s.clone(), valid, 7.0)
        got = pol._choose(s.clone(), valid, 7.0, n)
        assert torch.equal(got, want), (budget, n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_selection_needs_no_host_sync_on_cuda(make_tiny):
    """The default's speculation and selection for a decoding step (scoring the packed keys, the cap, the
    cut) run without a host synchronization on CUDA."""
    model = _model(make_tiny).cuda()
    pol = make_policy("infinigen", dense_layers=(0,), min_fetch=0, max_fetch_ratio=0.2).with_skew(random_skew(model))
    _, sess = prefill_then_decode(model, pol, random_tokens(model, t=T).cuda())
    layer = model.cfg.num_layers - 1
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        keep = select_row(pol, layer, 0, sess)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert keep.is_cuda and keep.shape[-1] == sess.store.length[layer]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy,correct", [("infinigen", False), ("infinigen", True), ("infinigen", "host"),
                                           ("infinigen", "in place"), ("full", False)],
                         ids=["infinigen", "infinigen-corrected", "infinigen-corrected-on-host",
                              "infinigen-read-in-place", "full"])
def test_offloaded_decode_has_no_host_sync_on_the_main_thread(make_tiny, policy, correct):
    """Decoding with the KV pool in pinned host memory (InfiniGen's speculation, and full offload): the main
    thread (speculation, selection, attention over the fetched rows, the next token) never waits for the
    GPU. The fetch worker may: turning a planned selection into a host gather is its job, off the main
    thread. Synchronizing calls are reported by torch's sync debug mode ("warn": the worker's are
    expected) and attributed to the thread that made them. With the correction (`Placement.correct`, the
    default), a corrected layer's own selection stays on the GPU, which reads the rows the prefetch missed from
    the pinned pool itself: no wait either. Corrected on the host (`corrects_on_device=False`, where the pool is
    packed or a file), the host gathers the missed rows: one copy of the layer's mask per corrected layer and step
    (`_select_on_host`), the only wait there."""
    import collections
    import os
    import threading
    import traceback
    import warnings
    model = _model(make_tiny).cuda()
    knobs = dict(dense_layers=(0,), min_fetch=0, max_fetch_ratio=0.2)
    if policy == "infinigen":
        pol = make_policy("infinigen", **knobs).with_skew(random_skew(model))
    else:
        pol = make_policy(policy)
    tokens = random_tokens(model, t=T).cuda()
    pl = Placement("cpu", correct=bool(correct), read_in_place=correct == "in place")
    sess = pl.new_session(model, 2, T, pol)
    assert sess.store.tier.pinned
    sess.store.corrects_on_device = correct != "host"
    assert sess.store._on_device() == (correct != "host")
    assert sess.store._in_place() == (correct == "in place")
    runtime.prefill(model, tokens[:, :P], sess)
    runtime.decode(model, tokens[:, P], sess)  # the first step sizes the fetch buffers
    syncs = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):  # where in the package: the innermost frames under src/infinigen
            ours = [f for f in traceback.extract_stack() if f"{os.sep}infinigen{os.sep}" in f.filename]
            site = " <- ".join(f"{f.filename.split(os.sep + 'infinigen' + os.sep)[-1]}:{f.lineno} {f.line}"
                              for f in ours[::-1][:3])
            syncs.append((threading.current_thread() is threading.main_thread(), site))
    torch.cuda.synchronize()
    shown = warnings.showwarning
    missed0 = sess.store.stats.missed
    steps = range(P + 1, T - 1)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for t in steps:
                runtime.decode(model, tokens[:, t], sess)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    st = sess.store.stats
    pl.close(sess)
    main = collections.Counter(site for on_main, site in syncs if on_main)
    if correct in (True, "host"):
        assert st.missed > missed0  # the correction ran: it read rows the prefetch missed
    if correct == "host":  # the one copy of each corrected layer's mask; the layers that select: all but layer 0
        copies = sum(n for site, n in main.items() if "torch.stack([keep, valid]).cpu()" in site)
        assert copies <= len(steps) * (model.cfg.num_layers - 1), main
        main = collections.Counter({site: n for site, n in main.items()
                                    if "torch.stack([keep, valid]).cpu()" not in site})
    assert not main, f"{sum(main.values())} synchronizing calls on the main thread:\n" + "\n".join(
        f"{n} x {site}" for site, n in main.most_common())
    assert st.fetches > 0 and st.stale == 0
    if correct in (False, "in place"):
        assert st.on_demand == 0


def test_kth_largest_is_the_top_k_threshold():
    """The cut's threshold (numpy's partition on a CPU) is exactly torch's k-th largest value, with the
    ties at -1 of unselected entries and -inf of invalid slots that the cut sees."""
    from infinigen.policies.cuts import _kth_largest
    g = torch.Generator().manual_seed(0)
    score = torch.rand(4, 3, 500, generator=g)
    score[torch.rand(4, 3, 500, generator=g) < 0.4] = -1.0
    score[..., :7] = float("-inf")
    for k in (1, 17, 250, 493):
        want = score.topk(k, dim=-1).values[..., -1:]
        assert torch.equal(_kth_largest(score, k), want)
