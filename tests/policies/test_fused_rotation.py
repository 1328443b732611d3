"""InfiniGen's skew rotation of a decoding row's query and key inside the native scorer and append, and of a
prompt's keys inside the native packing (`fused_select.score_int4`, `scatter_int4` and `write_int4` with a
rotation): the same float32 numbers as the torch path's float64 matmul (`SpeculationKeys.rotate`), so the same
scores and bytes to the bit; in a decoding session with the int4 kernel's layout (head_dim 64), the same
selections at every layer and step and logits within float32 rounding of the torch path; the comparisons fail
for a rotation by the wrong KV head's matrix or a transposed one."""
from __future__ import annotations

import pytest
import torch

from infinigen import runtime
from infinigen.kernels import fused_select
from infinigen.kernels.int4 import PackedKeys, tinygemm_ok
from infinigen.placement import Placement
from infinigen.policies import make_policy
from infinigen.policies.speculation import SpeculationKeys
from support.models import build_tiny
from support.packed_rows import Selections
from support.speculation import random_skew

needs_kernel = pytest.mark.skipif(not fused_select.available(), reason="the fused kernel cannot be built here")
needs_tinygemm = pytest.mark.skipif(not tinygemm_ok(64), reason="torch's CPU int4 kernel does not take this layout")


class _State:  # what `SpeculationKeys.rotate` reads of a request's state
    def __init__(self, a):
        self.A = a


def _rotated(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The torch path: x [B, Hkv, ..., d] times its KV head's matrix a [Hkv, d, d], float64 rounded to float32."""
    return SpeculationKeys.rotate(_State(a[None]), x, 0)


def _case(b, hkv, g, capacity, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.linalg.qr(torch.randn(hkv, 64, 64, generator=gen, dtype=torch.float64))[0]
    keys = PackedKeys(b, hkv, capacity, 64, group=32, layout="tinygemm")
    keys.write(0, _rotated(torch.randn(b, hkv, capacity, 64, generator=gen), a))
    q = (torch.randn(b, hkv, g, 64, generator=gen) * 3).to(dtype)
    return a, keys, q


@needs_kernel
@needs_tinygemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 3, 3, 256), (2, 2, 7, 300), (8, 3, 3, 1100)])
def test_scores_of_a_query_rotated_inside_equal_the_torch_rotation(shape, dtype):
    a, keys, q = _case(*shape, dtype, seed=shape[3])
    for n in (shape[3], 64, 1):
        native = keys.scores_rotated(q, a, n)
        reference = keys.scores(_rotated(q, a), n)
        assert torch.equal(native, reference), f"n={n}: largest difference {(native - reference).abs().max()}"


@needs_kernel
@needs_tinygemm
@pytest.mark.parametrize("breakage", ["another KV head's matrix", "transposed"])
def test_the_score_comparison_catches_a_wrong_rotation(breakage):
    a, keys, q = _case(2, 3, 3, 256, torch.bfloat16, seed=7)
    wrong = a.roll(1, 0) if breakage == "another KV head's matrix" else a.transpose(1, 2).contiguous()
    assert not torch.equal(keys.scores_rotated(q, wrong, 256), keys.scores(_rotated(q, a), 256))


@needs_kernel
@needs_tinygemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_key_rotated_inside_the_append_writes_the_bytes_of_the_torch_path(dtype):
    b, hkv, capacity = 3, 3, 200
    a, native, _ = _case(b, hkv, 1, capacity, dtype, seed=11)
    reference = PackedKeys(b, hkv, capacity, 64, group=32, layout="tinygemm")
    reference.codes.copy_(native.codes)
    reference.sz.copy_(native.sz)
    gen = torch.Generator().manual_seed(12)
    rows = (torch.randn(b, hkv, 1, 64, generator=gen) * 2).to(dtype)
    slots = torch.tensor([[5, 40, 199], [0, 63, 64], [100, 31, 32]])  # low and high nibbles, the last slot
    native.scatter_rotated(slots, rows, a)
    reference.scatter(slots, _rotated(rows, a))
    assert torch.equal(native.codes, reference.codes)
    assert torch.equal(native.sz.view(torch.int16), reference.sz.view(torch.int16))
    wrong = PackedKeys(b, hkv, capacity, 64, group=32, layout="tinygemm")
    wrong.scatter_rotated(slots, rows, a.roll(1, 0))  # another KV head's matrix: other bytes
    assert not torch.equal(wrong.sz.view(torch.int16), reference.sz.view(torch.int16))


@needs_kernel
@needs_tinygemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start, t", [(0, 256), (5, 100), (40, 24), (63, 2), (64, 130)])
def test_a_prompt_rotated_inside_the_write_writes_the_bytes_of_the_torch_path(dtype, start, t):
    """`write_rotated` (a prompt's keys packed in one native call) against `write` of the torch rotation: the same
    codes, scales and zeros, the slots around the written ones untouched (pre-filled with other keys)."""
    b, hkv, capacity = 2, 3, 320
    a, native, _ = _case(b, hkv, 1, capacity, dtype, seed=start + t)
    reference = PackedKeys(b, hkv, capacity, 64, group=32, layout="tinygemm")
    reference.codes.copy_(native.codes)
    reference.sz.copy_(native.sz)
    keys = (torch.randn(b, hkv, t, 64, generator=torch.Generator().manual_seed(t)) * 2).to(dtype)
    native.write_rotated(start, keys, a)
    reference.write(start, _rotated(keys, a))
    assert torch.equal(native.codes, reference.codes)
    assert torch.equal(native.sz.view(torch.int16), reference.sz.view(torch.int16))
    wrong = PackedKeys(b, hkv, capacity, 64, group=32, layout="tinygemm")
    wrong.write_rotated(start, keys, a.transpose(1, 2).contiguous())  # the transposed matrices: other bytes
    assert not torch.equal(wrong.sz.view(torch.int16), reference.sz.view(torch.int16))
    with pytest.raises(IndexError):
        native.write_rotated(capacity - t + 1, keys, a)


# ---- in a decoding session ------------------------------------------------------------------------------------
T, P = 128, 80  # a capacity of whole 64-slot blocks: the int4 kernel's layout


@pytest.fixture(scope="module")
def model64():
    """A tiny random Llama with head_dim 64 (the int4 kernel's layout), 4 query heads over 2 KV heads."""
    return build_tiny("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      num_hidden_layers=3)[1]


def _decode(model, fused, monkeypatch, rotation=None):
    """Prompts of P tokens, then T - P - 1 steps teacher-fed, float32, InfiniGen selecting at every layer with
    random skew matrices, the remainder on: logits and every selection."""
    monkeypatch.setattr(fused_select, "enabled", fused)
    policy = make_policy("infinigen", calibrate=False, dense_below=0, kv_budget=0.3, budget_growth=1.0, min_fetch=4)
    policy = policy.with_skew(random_skew(model))
    seen = Selections()
    tokens = torch.randint(3, model.cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(3))
    sess = Placement().new_session(model, 2, T, policy, listeners=[seen])
    if rotation is not None:
        rotation(sess)
    out = [runtime.prefill(model, tokens[:, :P], sess)]
    for t in range(P, T - 1):
        out.append(runtime.decode(model, tokens[:, t], sess))
    return torch.stack(out, 1), seen.seen, sess


@needs_kernel
@needs_tinygemm
def test_session_rotating_inside_the_kernels_equals_the_torch_path(model64, monkeypatch):
    ref, seen_ref, _ = _decode(model64, False, monkeypatch)
    calls = [0]

    def counted(inner):
        def call(self, *a, **kw):
            calls[0] += 1
            return inner(self, *a, **kw)
        return call
    for name in ("scores_rotated", "select_rotated", "write_rotated"):  # scored alone, or scored and cut in one
        monkeypatch.setattr(PackedKeys, name, counted(getattr(PackedKeys, name)))  # call; the prompt packed
    out, seen, sess = _decode(model64, True, monkeypatch)
    # the prompt's keys packed once per layer, then every layer selects, every step, rotated inside
    assert calls[0] == model64.cfg.num_layers * (1 + T - P - 1)
    assert seen.keys() == seen_ref.keys()
    assert all(torch.equal(seen[k], seen_ref[k]) for k in seen)
    assert any(bool((~seen[k]).any()) for k in seen)  # entries left unread: the selections mean something
    # the fused attention sums in float32 in another order than the torch path: logits of this head_dim-64 model
    # (|logit| up to ~5) differ by 8e-5 after three layers, as they did before the rotation moved inside
    assert (out - ref).abs().max() <= 2e-4


@needs_kernel
@needs_tinygemm
def test_the_session_check_catches_a_wrong_rotation(model64, monkeypatch):
    """The same comparison with the query rotated by the next layer's matrices: other selections."""
    _, seen_ref, _ = _decode(model64, False, monkeypatch)

    def next_layers(sess):
        a = sess.state.A
        sess.state.rotations = a.roll(1, 0).unbind(0)
    _, seen, _ = _decode(model64, True, monkeypatch, rotation=next_layers)
    assert not all(torch.equal(seen[k], seen_ref[k]) for k in seen)
