"""InfiniGen's `key_centre`: the packed 4-bit keys hold each key less the layer's mean key, and the scores add
q . mean back. The scores are the fake-quantization reference's, the scale stays the attention's, the knob
is only for int4 keys and leaves the calibration key of the default untouched; on keys that share a large
offset (a key bias) the selection ranks closer to the true top entries than the uncentred one."""
from __future__ import annotations

import pytest
import torch

from infinigen.errors import UserError
from infinigen.eval import analyze as an
from infinigen.kernels.int4 import fake_quantize
from infinigen.placement import Placement
from infinigen.policies import make_policy
from infinigen.policies.infinigen_calibration import search_setup
from support.speculation import prefill_then_decode as _decode
from support.speculation import random_tokens as _tokens

T, P = 40, 12


def _biased(make_tiny, scale: float = 3.0):
    """A tiny Qwen2-style model, 4 query heads per KV head, whose key bias moves every key far off centre."""
    _, model = make_tiny("qwen2", hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                         num_hidden_layers=3)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for block in model.layers:
            b = block.attn.k_proj.bias
            b.copy_(torch.randn(b.shape, generator=g) * scale)
    return model


def test_scores_are_the_centred_reference_on_the_keys_scale(make_tiny):
    model = _biased(make_tiny)
    pol = make_policy("infinigen", key_centre=True, skew=False, calibrate=False, dense_below=0,
                      max_fetch_ratio=0.3, kv_budget=None, budget_growth=1.0, min_fetch=0)
    _, sess = _decode(model, pol, _tokens(model, t=T))
    st, store = sess.state, sess.store
    layer = model.cfg.num_layers - 1
    n = store.length[layer]
    keys = pol.speculation.rotate(st, store.k[layer][:, :, :n], layer)
    mean = st.key_mean[layer]
    # the mean of the prompt's keys, fixed from then on
    prompt = pol.speculation.rotate(st, store.k[layer][:, :, :P], layer).mean(2, keepdim=True)
    torch.testing.assert_close(mean, prompt)
    got = pol.speculation.scores(st, layer, 0, st.spec_keys[layer], n)
    qs = pol.speculation.queries(st, layer, slice(0, 1))[:, :, :, 0]
    want = qs @ (fake_quantize(keys - mean, layout=st.layout) + mean).transpose(-1, -2)
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()
    exact = qs @ keys.transpose(-1, -2)
    plain = make_policy("infinigen", skew=False, calibrate=False, dense_below=0, max_fetch_ratio=0.3, kv_budget=None,
                        budget_growth=1.0, min_fetch=0)
    _, s2 = _decode(model, plain, _tokens(model, t=T))
    uncentred = plain.speculation.scores(s2.state, layer, 0, s2.state.spec_keys[layer], n)
    # on the attention's scale, and closer to the exact scores than the uncentred 4-bit keys' scores
    assert (got - exact).abs().mean() < 0.5 * (uncentred - exact).abs().mean()


def test_centred_keys_rank_closer_to_the_true_top(make_tiny):
    model = _biased(make_tiny)
    ids = torch.randint(3, 250, (1, 160), generator=torch.Generator().manual_seed(2))
    knobs = dict(calibrate=False, dense_below=0, skew=False, kv_budget=0.2, budget_growth=1.0, min_fetch=0,
                 exact_first=True, dense_layers=())
    got = {}
    for centre in (False, True):
        pol = make_policy("infinigen", key_centre=centre, **knobs)
        pol = pol.prepare(model, None)
        got[centre] = an.selection_recall(model, ids, pol, 32, forms={"in_ram": Placement()})["in_ram"]["mean"]
    assert got[True]["recall"] > got[False]["recall"] + 0.02  # 0.915 -> 0.941 here
    assert got[True]["mass_read"] > got[False]["mass_read"]


def test_knob_checks_and_the_default_calibration_key(make_tiny):
    with pytest.raises(UserError, match="key_centre needs key_mode=int4"):
        make_policy("infinigen", preset="paper", key_centre=True)
    with pytest.raises(UserError, match="key_centre must be true or false"):
        make_policy("infinigen", key_centre=1)
    _, model = make_tiny("llama")
    # off (the default): not part of what the stored calibration choices are keyed by; on: part of it
    assert "key_centre" not in search_setup(make_policy("infinigen"), model)["fixed"]
    assert search_setup(make_policy("infinigen", key_centre=True), model)["fixed"]["key_centre"] is True
