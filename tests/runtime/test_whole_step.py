"""The whole compiled decoding step (`StepParts.runs_whole`): each layer's attention over the store's pool runs
inside the compiled region, over the used slots as a symbolic length: one compiled kernel serves every cached
length and every pool. Its logits equal the eager step's in float32 at every length, at batch 1 and 4, for
the full cache and for InfiniGen below its crossing; the session's hooks hear the same tensors; whatever the
unused slots hold is never read."""
from __future__ import annotations

import pytest
import torch

from infinigen import compiled, runtime
from infinigen.placement import Placement
from infinigen.policies import make_policy
from support.models import build_tiny
from support.speculation import random_skew

P, T = 10, 30  # decoding caches 11..29 tokens, the last step filling the pool


pytestmark = pytest.mark.usefixtures("private_inductor_cache")


@pytest.fixture(scope="module")
def model():
    return build_tiny("llama", attention_bias=True)[1]


def _policy(name, model):
    if name == "infinigen":  # selecting on every layer but the first, below its crossing: every layer reads all
        return make_policy("infinigen", alpha=1.0, dense_layers=(0,), min_fetch=2, max_fetch_ratio=0.3,
                           dense_below=1000).with_skew(random_skew(model))
    return make_policy(name)


class _Heard(runtime.Listener):
    """What a listener hears of decoding steps: selections and appended tokens."""

    def __init__(self):
        self.selected, self.appended = [], []

    def on_select(self, layer, rows, keep, session):
        self.selected.append((layer, keep))

    def on_append(self, layer, slots, k, v, session):
        self.appended.append((layer, slots.clone(), k.clone(), v.clone()))


def _decode(model, policy, tokens, parts=None, stale=False, listeners=(), sessions=None, capacity=T):
    """Teacher-fed decoding: the logits of every step. `stale`: the pool's unused slots hold keys that would
    win every softmax and NaN values (what a reused pool may hold). The session is appended to `sessions`."""
    model.step_parts = parts
    try:
        sess = Placement().new_session(model, tokens.shape[0], capacity, policy, listeners=listeners)
        if sessions is not None:
            sessions.append(sess)
        out = [runtime.prefill(model, tokens[:, :P], sess)]
        if stale:
            for k, v in zip(sess.store.k, sess.store.v):
                k[:, :, P:] = 100.0
                v[:, :, P:] = float("nan")
        for t in range(P, T - 1):
            out.append(runtime.decode(model, tokens[:, t], sess))
        return torch.stack(out, 1)
    finally:
        model.step_parts = None


def _tokens(model, b, seed):
    return torch.randint(3, model.cfg.vocab_size, (b, T), generator=torch.Generator().manual_seed(seed))


def _attending(parts) -> list:
    """The names of the compiled attending parts."""
    return sorted(key[0] for key in parts._parts if key[0] in ("attend_between", "attend_leave"))


@pytest.mark.parametrize("policy", ["full", "infinigen"])
@pytest.mark.parametrize("batch", [1, 4])
def test_whole_step_equals_eager_at_every_length(model, policy, batch):
    tokens = _tokens(model, batch, seed=batch)
    sessions = []
    eager = _decode(model, _policy(policy, model), tokens, sessions=sessions)
    parts = compiled.StepParts()
    whole = _decode(model, _policy(policy, model), tokens, parts, stale=True, sessions=sessions)
    assert parts.failed is None
    assert _attending(parts) == ["attend_between", "attend_leave"]  # one kernel each for 19 lengths
    assert not any(key[0] in ("between", "leave") for key in parts._parts)
    torch.testing.assert_close(whole, eager, atol=1e-5, rtol=1e-5)
    counted = [(s.stats.rows, s.stats.entries, s.stats.per_layer()) for s in sessions]
    assert counted[0] == counted[1]  # what each layer read, counted as the eager step counts it


def test_the_session_hears_the_same_in_a_whole_step(model):
    tokens = _tokens(model, 2, seed=7)
    eager_heard, heard = _Heard(), _Heard()
    eager = _decode(model, _policy("full", model), tokens, listeners=[eager_heard])
    parts = compiled.StepParts()
    whole = _decode(model, _policy("full", model), tokens, parts, listeners=[heard])
    assert _attending(parts)
    torch.testing.assert_close(whole, eager, atol=1e-5, rtol=1e-5)
    assert [s[0] for s in heard.selected] == [s[0] for s in eager_heard.selected]
    assert all(keep is runtime.ALL for _, keep in heard.selected)
    assert len(heard.appended) == len(eager_heard.appended) == (T - 1 - P) * model.cfg.num_layers
    for got, want in zip(heard.appended, eager_heard.appended):
        assert got[0] == want[0] and torch.equal(got[1], want[1])
        torch.testing.assert_close(got[2:], want[2:], atol=1e-5, rtol=1e-5)


def test_steps_that_cannot_run_whole_use_the_parts(model):
    """A batch that is not a power of two, a policy that wants the weights, InfiniGen selecting: the dense
    parts between eager attentions, the same logits."""
    cases = [("full", 3, None), ("h2o", 2, make_policy("h2o", heavy_ratio=0.2, recent_ratio=0.2)),
             ("infinigen", 2, make_policy("infinigen", alpha=1.0, dense_layers=(0,), min_fetch=2,
                                          max_fetch_ratio=0.3).with_skew(random_skew(model)))]
    for name, batch, policy in cases:
        tokens = _tokens(model, batch, seed=11)
        parts = compiled.StepParts()
        fast = _decode(model, policy or _policy(name, model), tokens, parts)
        assert not _attending(parts) and parts.compiled == 3, name
        torch.testing.assert_close(fast, _decode(model, policy or _policy(name, model), tokens), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("batch", [1, 4])
def test_a_kernel_serves_every_pool(model, batch):
    """A server's sessions have pools of their own sizes: the compiled attention takes the pool's capacity (its
    views' strides) and the used length as symbols, so a larger pool compiles nothing new."""
    tokens = _tokens(model, batch, seed=9)
    parts = compiled.StepParts()
    first = _decode(model, _policy("full", model), tokens, parts)
    compiled_before = parts.compiled
    larger = _decode(model, _policy("full", model), tokens, parts, capacity=57)
    assert parts.compiled == compiled_before and _attending(parts) == ["attend_between", "attend_leave"]
    torch.testing.assert_close(larger, first, atol=1e-5, rtol=1e-5)


def test_the_whole_step_is_the_default(model):
    """A compiled step runs whole where it may (one kernel serves every cached length, so nothing compiles
    inside a run); `--compile parts` keeps each attention eager between the compiled dense parts."""
    if compiled.available() is not None:
        pytest.skip("no C++ compiler for Inductor")
    try:
        assert compiled.enable(model, "auto").whole is True
        assert compiled.enable(model, "on").whole is True
        assert compiled.enable(model, "whole").whole is True
        assert compiled.enable(model, "parts").whole is False
    finally:
        compiled.disable(model)


@pytest.mark.parametrize("batch", [1, 4])
def test_warming_compiles_all_a_run_needs(model, batch):
    """`warm` (a server before it listens, a benchmark before its timed steps) compiles every part a whole step
    of `batch` rows calls, for every cached length: decoding then compiles nothing."""
    parts = compiled.StepParts()
    parts.warm(model, batch)
    assert parts.failed is None and _attending(parts) == ["attend_between", "attend_leave"]
    warmed = parts.compiled
    fast = _decode(model, _policy("full", model), _tokens(model, batch, seed=5), parts)
    assert parts.compiled == warmed
    torch.testing.assert_close(fast, _decode(model, _policy("full", model), _tokens(model, batch, seed=5)),
                               atol=1e-5, rtol=1e-5)
