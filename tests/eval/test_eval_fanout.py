"""One shared dense prefill for many policies equals a prefill per policy."""
from __future__ import annotations

import pytest
import torch

from infinigen import runtime
from infinigen.runtime import attention
from infinigen.eval.fanout import prefill_shared
from infinigen.policies import REGISTRY, make_policy, policy_class
from infinigen.placement import Placement

SMALL = {"streaming": dict(sinks=1, window=3), "h2o": dict(heavy=3, recent=2), "oracle": dict(tokens=4),
         "infinigen": dict(alpha=1.0, skew=False, dense_layers=())}


def _available():
    out = []
    for name in REGISTRY:
        try:
            policy_class(name)
            out.append(name)
        except ImportError:
            pass
    return out


@pytest.mark.parametrize("kind", ["llama", "opt"])
def test_shared_prefill_equals_separate(make_tiny, kind):
    _, model = make_tiny(kind)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 250, (2, 24), generator=g)
    pad = torch.ones_like(tokens, dtype=torch.bool)
    pad[0, :5] = False  # a left-padded row
    steps = torch.randint(3, 250, (6, 2), generator=g)
    names = _available()
    policies = [make_policy(n, **SMALL.get(n, {})) for n in names]
    logits, sessions = prefill_shared(model, tokens, policies, 40, pad_mask=pad)
    for name, pol, shared in zip(names, policies, sessions):
        sess = Placement().new_session(model, 2, 40, make_policy(name, **SMALL.get(name, {})))
        ref = runtime.prefill(model, tokens, sess, pad_mask=pad)
        torch.testing.assert_close(logits, ref)
        for t in steps:
            torch.testing.assert_close(runtime.decode(model, t, shared), runtime.decode(model, t, sess), msg=name)
        assert shared.stats.overall() == pytest.approx(sess.stats.overall())
        assert shared.policy is pol  # shared: the per-request state lives on the session


def test_repeat_rows_equal_separate_prompts(make_tiny):
    """repeat=n: n batch rows per prompt row, each decoding its own continuation."""
    _, model = make_tiny("llama")
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 250, (1, 16), generator=g)
    steps = torch.randint(3, 250, (5, 3), generator=g)
    pol = make_policy("h2o", heavy=3, recent=2)
    _, (sess,) = prefill_shared(model, prompt, [pol], 30, repeat=3)
    got = [runtime.decode(model, t, sess) for t in steps]
    for i in range(3):
        ref_sess = Placement().new_session(model, 1, 30, make_policy("h2o", heavy=3, recent=2))
        runtime.prefill(model, prompt, ref_sess)
        for t, out in zip(steps, got):
            torch.testing.assert_close(out[i:i + 1], runtime.decode(model, t[i:i + 1], ref_sess))


def test_fanout_sessions_decode_together(make_tiny):
    """The sessions of a shared prefill (every policy, two rows each, one left-padded) decoded by one
    `runtime.decode` call over all of them: each session's logits and relative KV size are those it gets
    decoded alone, and each layer runs one attention call for all of them."""
    _, model = make_tiny("llama")
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(3, 250, (2, 20), generator=g)
    pad = torch.ones_like(tokens, dtype=torch.bool)
    pad[1, :6] = False
    steps = torch.randint(3, 250, (5, 2), generator=g)
    names = _available()
    make = [lambda n=n: make_policy(n, **SMALL.get(n, {})) for n in names]
    _, together = prefill_shared(model, tokens, [m() for m in make], 30, pad_mask=pad)
    _, alone = prefill_shared(model, tokens, [m() for m in make], 30, pad_mask=pad)
    calls = []
    step = attention.attend_packed  # the one attention over packed rows
    attention.attend_packed = lambda q, *a, **kw: calls.append(q.shape[0]) or step(q, *a, **kw)
    try:
        for t in steps:
            got = runtime.decode(model, t.repeat(len(together)), together)
            for i, s in enumerate(alone):
                torch.testing.assert_close(got[2 * i:2 * i + 2], runtime.decode(model, t, s), msg=names[i])
    finally:
        attention.attend_packed = step
    assert calls.count(2 * len(names)) == len(steps) * model.cfg.num_layers  # one call per layer over every row
    for s, ref in zip(together, alone):
        assert s.stats.per_layer() == pytest.approx(ref.stats.per_layer())
