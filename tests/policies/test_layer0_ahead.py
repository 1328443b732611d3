"""Layer 0 ahead of time: with `exact_first` (the `budget` preset) layer 0 selects with its
exact query, which exists as soon as a decoding step's tokens are embedded. The selection is made then, so an
offloaded tier prefetches layer 0's rows like every other layer's: no fetch on demand, every layer's plan
reused, and the same tokens and logits as with the KV in fast memory."""
from __future__ import annotations

import pytest
import torch

from infinigen import runtime
from infinigen.placement import Placement
from infinigen.policies import make_policy
from support.offload import GEN, run_placed


def _budget_policy(model, **knobs):
    cfg = model.cfg
    g = torch.Generator().manual_seed(5)
    a = torch.linalg.qr(torch.randn(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim, generator=g))[0]
    return make_policy("infinigen", preset="budget", min_fetch=0, **knobs).with_skew(a)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("arch", ["llama", "opt-postnorm"])
def test_every_layer_is_prefetched(tiny_llama, make_tiny, arch, kind, tmp_path):
    """With the KV in fast memory layer 0 selects at its own attention (its own query); offloaded, from the
    query computed at the embedding: the same tokens, so the same query (a post-norm OPT's layer 0 reads the
    embedding itself, a pre-norm model's its input norm of it)."""
    model = tiny_llama[1] if arch == "llama" else make_tiny("opt", do_layer_norm_before=False)[1]
    knobs = dict(kv_budget=0.3, budget_growth=1.0)  # a real subset of these short prompts
    ref_tokens, ref_logits, _ = run_placed(model, Placement("none"), _budget_policy(model, **knobs))
    tokens, logits, sess = run_placed(model, Placement(kind, pool_dir=str(tmp_path)), _budget_policy(model, **knobs))
    assert 0 < sess.stats.per_layer()[0] < 0.6
    assert torch.equal(tokens, ref_tokens)
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=0)
    st, layers = sess.store.stats, model.cfg.num_layers
    assert sess.policy.selects(0)
    assert st.fetches == GEN * layers and st.on_demand == 0 and st.stale == 0
    assert st.reused == GEN * layers  # layer 0's plan too: it selected before its attention ran


def test_layer0_plan_is_known_after_the_embedding(tiny_llama):
    """Right after the embedding event, layer 0's plan exists and is a real subset; the layer then reads it,
    and decoding still picks what teacher-forced scoring picks (the same query)."""
    _, model = tiny_llama
    pol = _budget_policy(model, kv_budget=0.3, budget_growth=1.0)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(3, 256, (1, 120), generator=g)
    tf_sess = Placement().new_session(model, 1, 120, pol)
    tf = runtime.teacher_forced(model, tokens, 40, tf_sess)
    sess = Placement().new_session(model, 1, 120, pol)
    seen = []
    event = sess.event

    def spy(layer, point, x):
        event(layer, point, x)
        if point == "embed":
            plan = sess.planned(0)
            seen.append(isinstance(plan, torch.Tensor) and 0 < float(plan.float().mean()) < 1)
    sess.event = spy
    out = [runtime.prefill(model, tokens[:, :40], sess)]
    for t in range(40, 119):
        out.append(runtime.decode(model, tokens[:, t], sess))
    assert seen and all(seen)
    assert (torch.stack(out, 1) - tf[:, 39:119]).abs().max() <= 1e-4
    assert sess.stats.per_layer()[0] == pytest.approx(tf_sess.stats.per_layer()[0], abs=1e-4)


@pytest.mark.parametrize("post_norm", [False, True])
def test_transformers_generate_with_layer0_ahead(post_norm):
    """Inside transformers' generate (`infinigen.hf`), which fires the embedding event too, exact_first gives
    our runtime's tokens and layer 0's reads."""
    from infinigen.generate import generate_ids
    from infinigen.hf import enable, runtime_for
    from support.models import hf_llama, hf_opt
    m = hf_opt(pre_norm=False) if post_norm else hf_llama()
    rt = runtime_for(m)
    cfg = rt.cfg
    g = torch.Generator().manual_seed(5)
    a = torch.linalg.qr(torch.randn(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim, generator=g))[0]

    def policy():
        return make_policy("infinigen", preset="budget", min_fetch=0, kv_budget=0.3, budget_growth=1.0).with_skew(a)
    ids = torch.randint(2, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = generate_ids(rt, [ids[0].tolist()], 12, policy=policy())
    with enable(m, policy()) as ig:
        out = m.generate(ids, max_new_tokens=12, do_sample=False)
    assert out[0, 40:].tolist() == ref.tokens[0]
    per = ig.cache.stats.per_layer()
    assert 0 < per[0] < 0.9  # layer 0 selected
    assert per[0] == pytest.approx(ref.stats.per_layer()[0], abs=1e-6)
