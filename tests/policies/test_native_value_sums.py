"""InfiniGen's running value sums and counts (what the remainder's unread mean is made of) advanced by a decoding
token in one native call (`fused_select.add_values`, the policy's `on_append`) hold what torch's two in-place adds
hold, bit for bit: for float32, bfloat16 and float16 values, a token given as a strided view (the joined projections'
output), several batch rows and KV heads, over many appends."""
from __future__ import annotations

import pytest
import torch

from infinigen.kernels import fused_select
from infinigen.kernels import native_build

needs_kernel = pytest.mark.skipif(not fused_select.available(), reason="the fused kernel cannot be built here")


def _advanced(dtype, native: bool, monkeypatch, steps: int = 40):
    b, hkv, d = 2, 3, 64
    gen = torch.Generator().manual_seed(1)
    sums = torch.randn(b, hkv, d, generator=gen) * 50  # large sums: a small value's rounding shows in the last bits
    counts = torch.randint(100, 9000, (b, hkv), generator=gen)
    with monkeypatch.context() as m:
        m.setattr(fused_select, "enabled", native)
        for _ in range(steps):
            joined = (torch.randn(b, 1, 3 * hkv, d, generator=gen) * 3).to(dtype).transpose(1, 2)  # [B, 3Hkv, 1, d]
            fused_select.add_values(sums, counts, joined[:, 2 * hkv:])
    return sums, counts


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_native_add_holds_the_sums_torchs_adds_hold(dtype, monkeypatch):
    assert native_build.loaded("fused_select")  # (`available` loaded it: the native call is the one taken)
    sums, counts = _advanced(dtype, True, monkeypatch)
    ref_sums, ref_counts = _advanced(dtype, False, monkeypatch)
    assert torch.equal(counts, ref_counts)
    assert torch.equal(sums, ref_sums)
