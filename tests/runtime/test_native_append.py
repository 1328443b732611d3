"""A decoding token stored in one native call (`fused_select.append_token`, `KVStore.append` in fast memory) leaves
the store as the torch path's copies leave it: keys, values, valid marks and positions, bit for bit, for a token
computed as a strided view (the joined projections' output); nothing else of the store touched."""
from __future__ import annotations

import pytest
import torch

from infinigen.cache import KVStore
from infinigen.kernels import fused_select

needs_kernel = pytest.mark.skipif(not fused_select.available(), reason="the fused kernel cannot be built here")


def _appended(dtype, native: bool, monkeypatch):
    b, hkv, cap, d = 3, 2, 10, 8
    gen = torch.Generator().manual_seed(0)
    store = KVStore(2, b, hkv, cap, d, dtype)
    for t in (store.k[1], store.v[1]):
        t.fill_(7)  # a sentinel in every slot no append writes
    slots = []
    with monkeypatch.context() as m:
        m.setattr(fused_select, "enabled", native)
        for step in range(4):
            joined = torch.randn(b, 1, 3 * hkv, d, generator=gen).to(dtype).transpose(1, 2)  # [B, 3Hkv, 1, d] view
            k, v = joined[:, :hkv], joined[:, hkv:2 * hkv]
            slots.append(store.append(1, k, v, torch.tensor([5, 9, 2]) + step))
    return store, slots


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_append_stores_what_the_copies_store(dtype, monkeypatch):
    native, slots = _appended(dtype, True, monkeypatch)
    reference, slots_ref = _appended(dtype, False, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(slots, slots_ref))
    for name in ("k", "v", "valid", "pos"):
        assert torch.equal(getattr(native, name)[1], getattr(reference, name)[1]), name
    assert native.length == reference.length == [0, 4]
    assert bool((native.k[1][:, :, 4:] == 7).all())  # the slots after the tokens keep the sentinel


def test_an_append_never_waits_for_the_kernels_build(monkeypatch):
    """A first run's decode appends with the torch copies while the kernel is not loaded (its build takes tens of
    seconds; the copies store the same bytes), and asks for no build."""
    from infinigen.kernels import native_build

    def no_build():
        raise AssertionError("an append asked for the kernel's build")
    monkeypatch.setattr(native_build, "_loaded", {})
    monkeypatch.setattr(fused_select, "_module", no_build)
    store = KVStore(1, 1, 2, 4, 8, torch.float32)
    k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    store.append(0, k, v, torch.tensor([3]))
    assert torch.equal(store.k[0][:, :, :1], k) and torch.equal(store.v[0][:, :, :1], v)
