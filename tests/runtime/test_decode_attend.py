"""The native decoding attention (kernels/int4_gemv.cpp, `infinigen::decode_attend`) against the float64 softmax
over the same bfloat16 keys and values: every output within one bfloat16 rounding, at head counts, slot counts
(one slot, partial and whole 16-slot groups, one and several 64-slot chunks) and strides (views of a larger
pool) that are not the model's; a row's bits independent of the rows beside it and of the threads; the compiled
whole step calls it in bfloat16, its logits within four bfloat16 roundings (of the largest) of the eager step's."""
from __future__ import annotations

import pytest
import torch

from infinigen import compiled, compiled_parts
from infinigen.bench.dispatch import DispatchedCalls
from infinigen.kernels import int4_gemv
from support.models import build_tiny, decoded_logits

BF16_ULP = 2.0 ** -8


def _needs():
    if not int4_gemv.available(torch.bfloat16):
        pytest.skip("no native bfloat16 kernels here (AVX512-BF16 and a C++ compiler)")


def _pool(b, h, hkv, slots, d, seed, spread=3.0):
    """q [b, h, 1, d] and keys and values [b, hkv, slots, d] as views of a pool with more slots (and q as a view
    of a wider tensor), so no stride is the contiguous one; keys scaled so the softmax has distinct maxima per
    chunk of slots."""
    g = torch.Generator().manual_seed(seed)
    cap = slots + 5
    q = torch.randn(b, h, 2, d, generator=g).bfloat16()[:, :, 1:]
    keys = (torch.randn(b, hkv, cap, d, generator=g) * spread).bfloat16().narrow(2, 0, slots)
    values = torch.randn(b, hkv, cap, d, generator=g).bfloat16().narrow(2, 0, slots)
    return q, keys, values


def _reference(q, keys, values, scale):
    b, h, _, d = q.shape
    hkv = keys.shape[1]
    qg = q.reshape(b, hkv, h // hkv, 1, d).double()
    probs = torch.softmax((qg * keys[:, :, None].double()).sum(-1) * scale, dim=-1)
    return (probs[..., None] * values[:, :, None].double()).sum(-2).reshape(b, h, 1, d)


CASES = [(1, 9, 3, 513, 64), (4, 9, 3, 513, 64), (2, 8, 2, 1, 64), (3, 4, 4, 17, 128), (1, 16, 2, 200, 64),
         (2, 6, 3, 64, 64), (2, 6, 3, 65, 128), (1, 5, 1, 16, 64), (2, 7, 7, 15, 64), (1, 8, 1, 130, 128)]


@pytest.mark.parametrize("b,h,hkv,slots,d", CASES)
def test_within_one_rounding_of_the_float64_softmax(b, h, hkv, slots, d, monkeypatch):
    _needs()
    q, keys, values = _pool(b, h, hkv, slots, d, seed=b + h + slots + d)
    scale = d ** -0.5
    assert int4_gemv.takes_attend(q, keys)
    out = int4_gemv.decode_attend(q, keys, values, scale)
    ref = _reference(q, keys, values, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (b, h, 1, d) and out.is_contiguous()
    bound = BF16_ULP * ref.abs() + 1e-5 * ref.abs().max()
    assert ((out.double() - ref).abs() <= bound).all()
    monkeypatch.setattr(int4_gemv, "enabled", False)  # the pointwise float32 form traced where it cannot run
    loops = compiled_parts.attend_pool(q, keys, values, scale)
    assert ((out.double() - loops.double()).abs() <= 2 * bound).all()


def test_a_row_is_the_same_bits_alone_beside_others_and_on_any_threads():
    _needs()
    q, keys, values = _pool(3, 9, 3, 300, 64, seed=7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int4_gemv.decode_attend(q, keys, values, 0.125)
        torch.set_num_threads(2)
        two = int4_gemv.decode_attend(q, keys, values, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for r in range(3):
        alone = int4_gemv.decode_attend(q[r:r + 1], keys[r:r + 1], values[r:r + 1], 0.125)
        assert torch.equal(alone, one[r:r + 1])


def test_refuses_what_it_cannot_take():
    _needs()
    q, keys, values = _pool(1, 4, 2, 10, 64, seed=1)
    assert not int4_gemv.takes_attend(q.float(), keys.float())
    assert not int4_gemv.takes_attend(torch.zeros(1, 18, 1, 64, dtype=torch.bfloat16), keys)  # 9 per KV head
    assert not int4_gemv.takes_attend(torch.zeros(1, 4, 1, 80, dtype=torch.bfloat16),
                                      torch.zeros(1, 2, 10, 80, dtype=torch.bfloat16))
    assert not int4_gemv.takes_attend(torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16), keys)  # two tokens
    with pytest.raises(RuntimeError, match="head size"):
        int4_gemv.decode_attend(torch.zeros(1, 4, 1, 80, dtype=torch.bfloat16),
                                torch.zeros(1, 2, 10, 80, dtype=torch.bfloat16),
                                torch.zeros(1, 2, 10, 80, dtype=torch.bfloat16), 0.1)
    with pytest.raises(RuntimeError, match="no slot"):
        int4_gemv.decode_attend(q, keys[:, :, :0], values[:, :, :0], 0.1)


def test_the_compiled_whole_step_calls_it_within_rounding_of_the_eager_step(private_inductor_cache):
    """A bfloat16 tiny llama (head size 64, two query heads per KV head): the compiled whole step's attending
    parts call the native attention (once per layer and step) and its logits are within four bfloat16
    roundings of the largest of the eager step's."""
    _needs()
    model = build_tiny("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128)[1].to(torch.bfloat16)
    tokens = torch.randint(3, model.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = decoded_logits(model, tokens)
    parts = compiled.enable(model, "on")
    try:
        with torch.inference_mode():
            got = decoded_logits(model, tokens)
            with DispatchedCalls() as seen:
                again = decoded_logits(model, tokens)
    finally:
        compiled.disable(model)
    assert parts.failed is None and parts.compiled > 0
    assert seen.by_op["infinigen.decode_attend.default"] == model.cfg.num_layers * (tokens.shape[1] - 6)
    assert torch.equal(again, got)
    assert (got.float() - want.float()).abs().max().item() <= 4 * BF16_ULP * want.float().abs().max().item()
