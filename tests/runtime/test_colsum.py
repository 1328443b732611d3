"""H2O's prefill scoring without the attention matrix: the blocked column sums equal
the materialized definition, with left padding, GQA and any block size."""
from __future__ import annotations

import pytest
import torch

from infinigen.kernels.colsum import attention_column_sums


def reference(q, k, valid, scale):
    """The definition: causal softmax over valid keys, summed over valid rows and the group's heads."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    sc = (q.double().view(b, hkv, h // hkv, t, d) @ k.double()[:, :, None].transpose(-1, -2)) * scale
    ar = torch.arange(t)
    mask = (ar[None, :] <= ar[:, None])[None] & valid[:, None, :]  # [B, rows, cols]
    p = torch.softmax(sc.masked_fill(~mask[:, None, None], float("-inf")), -1).nan_to_num(0.0)
    return (p * valid[:, None, None, :, None]).sum(dim=(2, 3))


@pytest.mark.parametrize("rows", [None, 1, 5, 64])
@pytest.mark.parametrize("h,hkv", [(6, 2), (4, 4)])
def test_column_sums_match_the_definition(rows, h, hkv):
    g = torch.Generator().manual_seed(0)
    b, t, d = 3, 37, 8
    q = torch.randn(b, h, t, d, generator=g) * 2
    k = torch.randn(b, hkv, t, d, generator=g) * 2
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :9] = False  # left padding
    valid[2, :36] = False  # one real token
    got = attention_column_sums(q, k, valid, d ** -0.5, rows=rows)
    want = reference(q, k, valid, d ** -0.5)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    assert (got[~valid[:, None].expand_as(got)] == 0).all()  # padding columns get nothing
    # every valid row hands out exactly one unit per query head
    torch.testing.assert_close(got.sum(-1), (valid.sum(-1, keepdim=True) * (h // hkv)).float().expand(b, hkv))


def test_low_precision_inputs():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 20, 16, generator=g).bfloat16()
    k = torch.randn(2, 2, 20, 16, generator=g).bfloat16()
    valid = torch.ones(2, 20, dtype=torch.bool)
    got = attention_column_sums(q, k, valid, 0.25, rows=7)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference(q.float(), k.float(), valid, 0.25).float(), rtol=1e-5, atol=1e-5)
