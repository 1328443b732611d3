"""Joined int4 projections (`quantized.join_projections`, `Int4Linear.joined`): a layer's q, k and v, and its
gate and up, computed by one weight call each. The joined weight's codes are the parts' own, laid end to end
(each part's codes become a view of them), its outputs are the parts' outputs concatenated, bit for bit, and
a model decodes the same logits joined or not; a part that carries a hook (a probe, weight streaming) is
called itself."""
from __future__ import annotations

import pytest
import torch

from infinigen.kernels.qlinear import Int4Linear, _cpu_layout_known, parameter_count
from infinigen.quantized import cast_parameters, join_projections, quantize_model
from support.models import build_tiny, decoded_logits

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") or not _cpu_layout_known(),
                                reason="no AVX512 int4 CPU kernel layout in this torch build")


def _part(n: int, k: int, seed: int) -> Int4Linear:
    g = torch.Generator().manual_seed(seed)
    return Int4Linear.quantize(torch.randn(n, k, generator=g), 32, torch.bfloat16, "cpu")


def test_joined_weight_is_the_parts_end_to_end():
    parts = (_part(128, 96, 0), _part(64, 96, 1), _part(64, 96, 2))
    codes = torch.cat([p.codes() for p in parts])
    separate = [p.dequantize() for p in parts]
    joined = Int4Linear.joined(parts)
    assert joined is not None and joined.joins == parts and joined.out_features == 256
    assert torch.equal(joined.codes(), codes)
    assert torch.equal(joined.dequantize(), torch.cat(separate))
    for p, want in zip(parts, separate):  # each part reads a view of the joined codes, and the same weight
        assert p.packed.untyped_storage().data_ptr() == joined.packed.untyped_storage().data_ptr()
        assert torch.equal(p.dequantize(), want)
    for rows in (1, 4, 80):  # 80: above DENSE_ROWS, the dequantized dense matmul
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert torch.equal(joined(x), torch.cat([p(x) for p in parts], -1)), rows


def test_parts_the_layout_cannot_join_stay_apart():
    assert Int4Linear.joined((_part(128, 96, 0), _part(48, 96, 1))) is None  # a last block of 48 rows
    assert Int4Linear.joined((_part(64, 96, 0), _part(64, 64, 1))) is None  # other inputs


@pytest.fixture(scope="module")
def int4_model():
    # head_dim 64, one KV head: q 128, k and v 64 outputs, gate and up 128: every part a whole block of 64 rows
    model = build_tiny("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=128)[1]
    quantize_model(model, "int4", torch.bfloat16, "cpu")
    cast_parameters(model, torch.bfloat16)
    return model


_logits = decoded_logits


def test_a_joined_model_decodes_the_same_logits(int4_model):
    model = int4_model
    tokens = torch.randint(3, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    count = parameter_count(model)
    with torch.inference_mode():
        apart = _logits(model, tokens)
        assert join_projections(model) == 2 * model.cfg.num_layers
        try:
            assert parameter_count(model) == count  # the joined weights are their parts, counted once
            calls = []
            hook = model.layers[0].attn.qkv_proj.register_forward_hook(lambda m, a, out: calls.append(out.shape))
            joined = _logits(model, tokens)
            hook.remove()
            assert calls  # the joined weight ran
            assert torch.equal(joined, apart)
            # a hooked part is called itself (and the hook hears it): the joined weight stands aside
            heard = []
            hook = model.layers[1].attn.k_proj.register_forward_pre_hook(lambda m, a: heard.append(1))
            hooked = _logits(model, tokens)
            hook.remove()
            assert len(heard) == tokens.shape[1] - 5 and torch.equal(hooked, apart)
        finally:
            for blk in model.layers:
                blk.attn.qkv_proj = blk.mlp.gate_up_proj = None
