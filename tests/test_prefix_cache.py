"""Prefix cache: a prompt that continues a cached prefix is prefilled from there (its first tokens' keys and
values restored, not recomputed) and gets the tokens a prefill of the whole prompt gives; the server's
engine reuses shared prefixes by blocks, counts hits, and evicts by LRU under its byte limit."""
from __future__ import annotations

import pytest
import torch

from infinigen import runtime
from infinigen.placement import Placement
from infinigen.policies import make_policy
from infinigen.serve.engine import Engine, Request


def _mats(model, seed=3):
    c = model.cfg
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(c.num_layers, c.num_kv_heads, c.head_dim, c.head_dim, generator=g,
                                       dtype=torch.float64))[0]


def _policy(name, model):
    if name == "infinigen":  # the default preset (4-bit speculation keys), a real subset on short prompts
        return make_policy("infinigen", dense_layers=(0,), alpha=1.0).with_skew(_mats(model))
    if name == "streaming":
        return make_policy("streaming", sinks=2, window=6)
    if name == "oracle":
        return make_policy("oracle", ratio=0.3)
    return make_policy(name)


def _tokens(model, n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.cfg.vocab_size, (1, n), generator=g)


def _greedy(model, session, logits, n):
    out = [int(logits.argmax(-1))]
    for _ in range(n - 1):
        out.append(int(runtime.decode(model, torch.tensor([out[-1]]), session).argmax(-1)))
    return out


def _whole(model, pol, ids, n):
    sess = Placement().new_session(model, 1, ids.shape[1] + n, pol)
    return _greedy(model, sess, runtime.prefill(model, ids, sess), n), sess


def _continued(model, pol, ids, cached, n, layers_per_slice=0):
    # the prefix's keys and values as an earlier request's session left them
    donor = Placement().new_session(model, 1, cached, make_policy("full"))
    runtime.prefill(model, ids[:, :cached], donor)
    keys = [donor.store.past(i)[0].clone() for i in range(model.cfg.num_layers)]
    values = [donor.store.past(i)[1].clone() for i in range(model.cfg.num_layers)]
    sess = Placement().new_session(model, 1, ids.shape[1] + n, pol)
    sess.restore_prefix(keys, values)
    slices = runtime.prefill_in_slices(model, ids[:, cached:], sess, layers_per_slice=layers_per_slice,
                                       cached=cached)
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return _greedy(model, sess, done.value, n), sess


@pytest.mark.parametrize("policy", ["full", "infinigen", "streaming", "oracle", "int4"])
def test_a_prompt_continued_from_a_cached_prefix_gets_the_tokens_of_the_whole_prefill(make_tiny, policy):
    _, model = make_tiny("llama", num_hidden_layers=3)
    ids = _tokens(model, 40)
    pol = _policy(policy, model)
    if policy == "infinigen":
        assert pol.continues_prefill()
    whole, ws = _whole(model, pol, ids, 12)
    for cached in (1, 16, 39):
        cont, cs = _continued(model, pol, ids, cached, 12, layers_per_slice=cached % 2)
        assert cont == whole, (policy, cached)
        if policy == "infinigen":  # the speculation keys cover the whole prompt, as a whole prefill builds them
            assert cs.stats.overall() == pytest.approx(ws.stats.overall()) and ws.stats.overall() < 0.9


def test_policies_that_read_the_prompt_queries_do_not_continue(make_tiny):
    """H2O's prompt scores and the paper's partial columns need every prompt row's query: a cached prefix
    cannot give them, so such a policy says so and a continued prefill refuses it."""
    _, model = make_tiny("llama", num_hidden_layers=2)
    assert not make_policy("h2o").continues_prefill()
    assert not make_policy("infinigen", preset="paper").continues_prefill()
    assert make_policy("full").continues_prefill()
    sess = Placement().new_session(model, 1, 20, make_policy("h2o"))
    with pytest.raises(ValueError, match="continues_prefill"):
        next(runtime.prefill_in_slices(model, _tokens(model, 4), sess, cached=3))
