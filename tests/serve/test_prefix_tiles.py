"""A prefix-cache hit computes what a miss computes, to the bit, in bfloat16 with int4 weights (the server's
defaults): a prefill in tiles (`prefill_in_slices(tile=)`) gives every row the same operands wherever the prompt
was cut, so a prompt continued from a prefix cached at a multiple of the tile gets the logits of its whole
prefill, and the server's answer to a request does not depend on what its prefix cache held."""
from __future__ import annotations

import pytest
import torch

from infinigen import runtime
from infinigen.loading import from_transformers, quantize_model
from infinigen.placement import Placement
from infinigen.policies import make_policy
from infinigen.serve.engine import Engine, Request
from support.models import build_gemma, build_tiny
from support.speculation import random_skew

TILE = 16


def _model(kind):
    hf, _ = build_tiny("llama", num_hidden_layers=3, max_position_embeddings=512) if kind == "llama" \
        else build_gemma()  # Gemma 3: sliding-window layers beside global ones
    return quantize_model(from_transformers(hf, dtype=torch.bfloat16), "int4", torch.bfloat16, "cpu")


def _policy(name, model):
    if name == "infinigen":
        return make_policy("infinigen", calibrate=False, dense_below=0).with_skew(random_skew(model))
    return make_policy(name)


def _run(slices):
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value


def _restored(model, pol, donor, blocks, n, tile=TILE):
    sess = Placement().new_session(model, 1, n, pol)
    layers = range(model.cfg.num_layers)
    for i in range(blocks):
        span = slice(i * tile, (i + 1) * tile)
        sess.restore_prefix([donor.store.past(j)[0][:, :, span].clone() for j in layers],
                            [donor.store.past(j)[1][:, :, span].clone() for j in layers], at=i * tile)
    return sess


def _greedy(model, sess, logits, steps=4):
    out = [int(logits.argmax(-1))]
    for _ in range(steps):
        out.append(int(runtime.decode(model, torch.tensor([out[-1]]), sess, batch_invariant=True).argmax(-1)))
    return out


@pytest.mark.parametrize("kind, n, tile", [("llama", 75, 16), ("gemma", 75, 16), ("llama", 300, 128)])
@pytest.mark.parametrize("policy", ["full", "infinigen"])
def test_a_prompt_continued_from_any_cached_tile_gets_the_bits_of_its_whole_tiled_prefill(kind, n, tile, policy):
    """Rests of 59 .. 11 rows: the int4 kernel's (<= 64 rows), where a whole prompt's rows are a matmul's; tiles
    of 128 rows: the dense weights dequantized once for every tile."""
    model = _model(kind)
    pol = _policy(policy, model)
    ids = torch.randint(3, model.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(3))
    whole = Placement().new_session(model, 1, n + 8, pol)
    want = runtime.prefill(model, ids, whole, tile=tile)
    untiled = runtime.prefill(model, ids, Placement().new_session(model, 1, n + 8, pol))
    assert (want - untiled).abs().max() < 0.05 * untiled.abs().max()  # the same function, rounded otherwise
    want_tokens = _greedy(model, whole, want)
    for blocks in range(1, (n - 1) // tile + 1):
        sess = _restored(model, pol, whole, blocks, n + 8, tile)
        got = _run(runtime.prefill_in_slices(model, ids[:, blocks * tile:], sess, layers_per_slice=blocks % 2,
                                             cached=blocks * tile, tile=tile))
        assert torch.equal(got, want), (kind, policy, blocks)
        assert _greedy(model, sess, got) == want_tokens


def test_without_tiles_a_continued_prompt_rounds_differently():
    """What the tiles are for: the same continuation untiled does not get the whole prefill's bits (if this ever
    holds exactly, the test above no longer shows anything and needs another shape)."""
    model = _model("gemma")
    pol = make_policy("full")
    ids = torch.randint(3, model.cfg.vocab_size, (1, 75), generator=torch.Generator().manual_seed(3))
    whole = Placement().new_session(model, 1, 80, pol)
    want = runtime.prefill(model, ids, whole)
    sess = _restored(model, pol, whole, 2, 80)
    got = runtime.prefill(model, ids[:, 2 * TILE:], sess, cached=2 * TILE)
    assert not torch.equal(got, want)


def test_a_tiled_prefill_refuses_a_prefix_of_a_part_tile():
    model = _model("llama")
    sess = Placement().new_session(model, 1, 40, make_policy("full"))
    with pytest.raises(ValueError, match="whole tiles"):
        next(runtime.prefill_in_slices(model, torch.ones(1, 8, dtype=torch.long), sess, cached=5, tile=TILE))


@pytest.mark.parametrize("policy", ["full", "infinigen"])
def test_the_servers_answer_is_the_same_from_its_prefix_cache_as_computed(policy):
    """A request after one that shares its document (a hit: the document's blocks restored) gets the tokens and
    log-probabilities, to the bit, of the same request on a server that never saw the document (a miss)."""
    model = _model("gemma")
    pol = _policy(policy, model)
    g = torch.Generator().manual_seed(7)
    doc = torch.randint(3, model.cfg.vocab_size, (70,), generator=g).tolist()
    first, second = doc + [5, 9, 11], doc + [17, 4]

    def answer(eng, prompt):
        req = eng.submit(Request(prompt=prompt, max_tokens=5, logprobs=0))
        while not eng.idle():
            eng.step()
        assert req.finish == "length"
        return req.tokens, [lp for lp, _ in req.token_logprobs]

    warm = Engine(model, pol, Placement(), max_batch=2, prefix_block=TILE)
    answer(warm, first)
    hit = answer(warm, second)
    assert warm.snapshot()["prefix_cache_hit_tokens"] == 64
    miss = answer(Engine(model, pol, Placement(), max_batch=2, prefix_block=TILE), second)
    assert hit == miss
