"""The whole compiled step writes each layer's token into the store inside its compiled call: the store ends as
the eager step's appends leave it (keys, values, valid, pos, the used length; nothing past the token's slot
touched), no operator outside the compiled calls touches the store, a batch-1 step stays within a few operator
calls per layer, and one compiled kernel serves every slot (nothing compiles as the cache grows)."""
from __future__ import annotations

import pytest
import torch
from infinigen.bench.dispatch import DispatchedCalls

from infinigen import compiled, runtime
from infinigen.placement import Placement
from infinigen.policies import make_policy
from support.models import build_tiny

P, T = 6, 40
# aten calls of a batch-1 whole step of the tiny float32 llama: a constant (embedding, rotary, head, cursor) and
# per layer the compiled call's own calls (its seven weight matmuls): measured 33 and 7, bounds with slack; the
# token's append outside the compiled call adds 9 per layer
STEP_CALLS, LAYER_CALLS = 36, 8


pytestmark = pytest.mark.usefixtures("private_inductor_cache")


@pytest.fixture(scope="module")
def models():
    return {layers: build_tiny("llama", num_hidden_layers=layers)[1] for layers in (2, 6)}


def _store_tensors(store) -> list:
    return [*store.k, *store.v, *store.valid, *store.pos]


def _decode(model, tokens, parts, sentinel=False, count=False):
    """Teacher-fed decoding after a P-token prompt: (logits of every step, the session, per-step calls and the
    calls on the store's tensors). `sentinel`: the unused slots hold values no append writes (7, and not valid),
    to see each write and nothing more."""
    model.step_parts = parts
    try:
        sess = Placement().new_session(model, tokens.shape[0], T, make_policy("full"))
        out = [runtime.prefill(model, tokens[:, :P], sess)]
        if sentinel:
            for t in _store_tensors(sess.store):
                t[:, :, P:] = 7 if t.dtype != torch.bool else False
        calls, on_store = [], []
        for t in range(P, T - 1):
            if count:
                with DispatchedCalls(_store_tensors(sess.store)) as counter:
                    out.append(runtime.decode(model, tokens[:, t], sess))
                calls.append(counter.calls)
                on_store.append(counter.on_watched)
            else:
                out.append(runtime.decode(model, tokens[:, t], sess))
        return torch.stack(out, 1), sess, calls, on_store
    finally:
        model.step_parts = None


def _tokens(model, batch, seed):
    return torch.randint(3, model.cfg.vocab_size, (batch, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("batch", [1, 4])
def test_the_whole_step_leaves_the_store_as_the_eager_appends_do(models, batch):
    model = models[2]
    tokens = _tokens(model, batch, seed=batch + 20)
    eager, eager_sess, _, _ = _decode(model, tokens, None)
    parts = compiled.StepParts()
    whole, sess, _, _ = _decode(model, tokens, parts, sentinel=True)
    assert parts.failed is None and any(key[0] == "attend_leave" for key in parts._parts)
    torch.testing.assert_close(whole, eager, atol=1e-5, rtol=1e-5)
    store, want = sess.store, eager_sess.store
    used = T - 1
    assert store.length == want.length == [used] * model.cfg.num_layers
    for layer in range(model.cfg.num_layers):
        torch.testing.assert_close(store.k[layer][:, :, :used], want.k[layer][:, :, :used], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(store.v[layer][:, :, :used], want.v[layer][:, :, :used], atol=1e-5, rtol=1e-5)
        assert torch.equal(store.valid[layer][:, :, :used], want.valid[layer][:, :, :used])
        assert torch.equal(store.pos[layer][:, :, :used], want.pos[layer][:, :, :used])
        for t in (store.k[layer], store.v[layer], store.pos[layer]):  # the slot past the last token: untouched
            assert bool((t[:, :, used:] == 7).all())
        assert not store.valid[layer][:, :, used:].any()


def test_a_batch_one_whole_step_is_a_few_calls_per_layer_and_none_on_the_store(models):
    counts = {}
    for layers, model in models.items():
        parts = compiled.StepParts()
        parts.warm(model, 1)
        compiled_before = parts.compiled
        _, _, calls, on_store = _decode(model, _tokens(model, 1, seed=3), parts, count=True)
        assert parts.failed is None and parts.compiled == compiled_before  # every slot: the warmed kernels
        assert not any(on_store), on_store[0]  # the token's append is inside the compiled calls
        assert len(set(calls[1:])) == 1, calls  # every later step the same calls, whatever its length
        counts[layers] = max(calls)
    per_layer = (counts[6] - counts[2]) / 4
    assert per_layer <= LAYER_CALLS, counts
    assert counts[2] <= STEP_CALLS + 2 * LAYER_CALLS, counts
