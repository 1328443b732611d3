"""The KV the crossing is measured over reads like real text: the policy's calibration text's keys and values
(`crossing.TextKV`), laid out to each length, make the policy read the share of the KV that a real prompt of that
text makes it read (random keys give another share: flat scores). Counts of entries read, no timing."""
from __future__ import annotations

import random

import pytest
import torch

from infinigen import runtime
from infinigen.placement import Placement
from infinigen.policies import crossing, make_policy
from support.models import CORPUS, build_tiny, make_tokenizer
from support.speculation import random_skew

LENGTH, STEPS = 1024, 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model, tokenizer, text path, its token ids): a tiny Llama of 2048 positions whose attention is peaked
    (queries scaled 3x), and a text of the tokenizer's corpus sentences (fixed seed), longer than LENGTH."""
    tok = make_tokenizer()
    _, model = build_tiny("llama", vocab_size=len(tok), num_hidden_layers=3, max_position_embeddings=2048)
    with torch.no_grad():
        for blk in model.layers:
            blk.attn.q_proj.weight.mul_(3.0)
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("text") / "sentences.txt"
    path.write_text(" ".join(rng.choice(CORPUS) for _ in range(400)), encoding="utf-8")
    ids = torch.tensor(tok(path.read_text(encoding="utf-8"))["input_ids"])[None]
    assert ids.shape[1] > LENGTH + 1
    return model, tok, path, ids


def _policy(model, path, **knobs):
    base = dict(alpha=2.0, max_fetch_ratio=0.5, min_fetch=0, dense_layers=(0,), calibrate=False, dense_below=0,
                calibrate_text=str(path))
    return make_policy("infinigen", **(base | knobs)).with_skew(random_skew(model))


def _entries(model, sess, token: int) -> float:
    """Entries the selecting layers attend per decoding step and batch row, over STEPS steps of `token`."""
    sess.stats.reset()
    with torch.inference_mode():
        for _ in range(STEPS):
            runtime.decode(model, torch.full((sess.batch,), token), sess)
    return sess.stats.per_step()["entries_attended"] / sess.batch


def test_the_measured_kv_reads_the_share_real_text_reads(setup):
    """At LENGTH cached tokens, the measurement's sessions (the text's first tokens laid out to LENGTH, two rows)
    attend as many entries per row as a real prompt of LENGTH tokens of the same text, within 5% (3698 and 3751
    here); random keys attend a third fewer (2461): the model tells the two apart."""
    model, tok, path, ids = setup
    pol = _policy(model, path)
    real = Placement().new_session(model, 1, LENGTH + STEPS + 1, pol)
    with torch.inference_mode():
        runtime.prefill(model, ids[:, :LENGTH], real)
    token = int(ids[0, LENGTH])
    want = _entries(model, real, token)
    kv = crossing.sample_kv(model, pol, tok, crossing.lengths_for(model)[0])
    assert isinstance(kv, crossing.TextKV) and kv.count == crossing.lengths_for(model)[0] < LENGTH
    measured = crossing.sessions(model, [pol], LENGTH, kv, 2, STEPS + 1)[0]
    got = _entries(model, measured, token)
    assert abs(got / want - 1) < 0.05, (got, want)
    flat = crossing.sessions(model, [pol], LENGTH, crossing.RandomKV(torch.Generator().manual_seed(0)), 1,
                             STEPS + 1)[0]
    assert abs(_entries(model, flat, token) / want - 1) > 0.2


def test_the_text_is_laid_out_at_its_new_positions(setup):
    """Layer 0's keys and values depend on a token and its position only: those `TextKV.at` lays out at LENGTH
    equal a prefill's of the token sequence it repeats (the first token once, then the others in order), each
    key rotated to its new position; up to the text's own length they are the prefill's own."""
    model, tok, path, ids = setup
    kv = crossing.sample_kv(model, _policy(model, path), tok, crossing.lengths_for(model)[0])
    count = kv.count
    t = torch.arange(LENGTH)
    tiled = kv.ids[0, torch.where(t < count, t, 1 + (t - 1) % (count - 1))][None]
    seen = {}

    class Keep(runtime.Listener):
        def on_prefill(self, layer, q, k, v, session):
            seen[layer] = (q.clone(), k.clone(), v.clone())

    sess = Placement().new_session(model, 1, LENGTH, make_policy("full"), listeners=[Keep()])
    with torch.inference_mode():
        runtime.prefill(model, tiled, sess)
    q, k, v = kv.at(model, 0, LENGTH, 2)
    assert k.shape == (2, model.cfg.num_kv_heads, LENGTH, model.cfg.head_dim) and torch.equal(k[0], k[1])
    for got, want in zip((q, k, v), seen[0]):
        torch.testing.assert_close(got[:1], want, rtol=1e-4, atol=1e-4)
    short = kv.at(model, 1, count, 1)
    for got, want in zip(short, kv.layers[1]):
        assert torch.equal(got, want)


def test_prepare_measures_over_the_text_and_keys_by_it(setup, tmp_path, monkeypatch):
    """`prepare` with a tokenizer measures over the calibration text's KV, and the stored crossing's key says
    which (text, token count and ids); without a tokenizer, random KV under another key."""
    model, tok, path, _ = setup
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    seen = []

    def fake(model, policy, **kw):
        seen.append(kw.get("kv"))
        return {"lengths": [64, 256], "ratio": [1.5, 0.75], "dense_below": 100, "seconds": 0.0}
    monkeypatch.setattr(crossing, "measure", fake)
    pol = _policy(model, path, dense_below=None)
    assert pol.prepare(model, tok).dense_below == 100
    assert isinstance(seen[-1], crossing.TextKV) and seen[-1].text == str(path)
    with_text = crossing.crossing_key(model, pol, kv=seen[-1])
    assert with_text["kv"]["tokens"] == crossing.lengths_for(model)[0] and with_text["format"] == crossing.FORMAT
    assert crossing.load(with_text)["dense_below"] == 100
    pol.prepare(model)
    assert isinstance(seen[-1], crossing.RandomKV) and len(seen) == 2
    assert crossing.crossing_key(model, pol)["kv"] == "random" != with_text["kv"]
