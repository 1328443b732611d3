"""Teacher-forced rows attend as a decoding step does (`attention.attend_rows`): each row's kept entries packed
and read by the step's attention over packed rows (the C++ kernel, or its torch twin `attend_packed_rows`),
against the padded reference (`support.padded_reference.attend_teacher_rows`: every row scored against every key).
"""
from __future__ import annotations

import pytest
import torch

from support.padded_reference import attend_teacher_rows
from infinigen.cache import SelectedRows
from infinigen.codecs import KVCodec, QuantCodec
from infinigen.kernels import fused_select
from infinigen.runtime import attention
from infinigen.selection import Remainder

D = 16
SCALE = D ** -0.5
KERNEL = pytest.param(True, marks=pytest.mark.skipif(not fused_select.available(),
                                                      reason="the fused kernel is not built here"))


def _case(b=1, hkv=2, g=3, t=40, first=8, seed=0, window=None, dtype=torch.float32):
    """q [B,H,R,d], k, v [B,Hkv,T,d], a random keep of each row's past [B,Hkv,R,T] (some rows none, one row all) and
    a remainder's log-mass [B,Hkv,G,R]."""
    gen = torch.Generator().manual_seed(seed)
    r = t - first
    q = torch.randn(b, hkv * g, r, D, generator=gen).to(dtype)
    k = torch.randn(b, hkv, t, D, generator=gen).to(dtype)
    v = torch.randn(b, hkv, t, D, generator=gen).to(dtype)
    rows = torch.arange(first, t)[:, None]
    past = torch.arange(t)[None] < rows
    if window is not None:
        past = past & (rows - torch.arange(t)[None] < window)
    keep = (torch.rand(b, hkv, r, t, generator=gen) < 0.3) & past
    keep[:, 0, 0] = False  # a (row, KV head) that reads nothing of its past
    keep[:, -1, -1] = past[-1]  # one that reads all of it
    lse = torch.randn(b, hkv, g, r, generator=gen)
    return q, k, v, keep, first, Remainder(lse)


def _both(q, k, v, keep, first, codec, remainder, kernel, monkeypatch):
    monkeypatch.setattr(fused_select, "enabled", kernel)
    got = attention.attend_rows(q, k, v, keep, first, codec, SCALE, remainder)
    want = attend_teacher_rows(q, k, v, keep, first, codec, SCALE, remainder)
    return got, want


@pytest.mark.parametrize("kernel", [KERNEL, False])
@pytest.mark.parametrize("shape", [dict(b=1, hkv=1, g=1), dict(b=1, hkv=3, g=3), dict(b=2, hkv=2, g=7),
                                   dict(b=2, hkv=2, g=2, window=6)])
@pytest.mark.parametrize("codec", [KVCodec(), QuantCodec(4, 8)], ids=["as computed", "int4"])
@pytest.mark.parametrize("with_remainder", [False, True])
def test_rows_attend_as_the_padded_reference(kernel, shape, codec, with_remainder, monkeypatch):
    q, k, v, keep, first, remainder = _case(**shape)
    got, want = _both(q, k, v, keep, first, codec, remainder if with_remainder else None, kernel, monkeypatch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [dict(b=1, hkv=1, g=1), dict(b=1, hkv=3, g=3), dict(b=2, hkv=2, g=7),
                                   dict(b=2, hkv=2, g=2, window=6)])
@pytest.mark.parametrize("codec", [KVCodec(), QuantCodec(4, 8)], ids=["as computed", "int4"])
@pytest.mark.parametrize("with_remainder", [False, True])
def test_rows_attend_as_the_padded_reference_on_the_test_device(device, shape, codec, with_remainder, monkeypatch):
    """On CUDA (INFINIGEN_TEST_DEVICE=cuda) the rows take the Triton kernel: the same cases, within 1e-5 of the
    padded reference computed on the CPU."""
    if device.type != "cuda":
        pytest.skip("on a CPU: the test above")
    q, k, v, keep, first, remainder = _case(**shape)
    want = attend_teacher_rows(q, k, v, keep, first, codec, SCALE, remainder if with_remainder else None)
    monkeypatch.setattr(fused_select, "enabled", True)
    on = Remainder(*(x.to(device) if torch.is_tensor(x) else x for x in remainder)) if with_remainder else None
    got = attention.attend_rows(q.to(device), k.to(device), v.to(device), keep.to(device), first, codec, SCALE, on)
    assert got.is_cuda
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [KERNEL, False])
def test_rows_in_many_small_parts_attend_as_in_one(kernel, monkeypatch):
    """A long sequence's rows are packed a part at a time (ROW_ENTRIES) and, without the kernel, gathered a
    part at a time (GATHER_ELEMENTS): parts of one row attend as one call over all of them."""
    q, k, v, keep, first, remainder = _case(b=2, hkv=2, g=3, t=60, first=5)
    monkeypatch.setattr(fused_select, "enabled", kernel)
    whole = attention.attend_rows(q, k, v, keep, first, QuantCodec(4, 8), SCALE, remainder)
    monkeypatch.setattr(attention, "ROW_ENTRIES", 2 * 2 * 60 * 3)  # three rows per part
    monkeypatch.setattr(attention, "GATHER_ELEMENTS", 1)  # one row per gather
    torch.testing.assert_close(attention.attend_rows(q, k, v, keep, first, QuantCodec(4, 8), SCALE, remainder),
                               whole, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kernel", [KERNEL, False])
def test_a_selection_packed_per_row_attends_as_its_mask(kernel, monkeypatch):
    """Calibration's rows come packed per row (`SelectedRows` with the rows as its batch): they attend as the
    mask they pack."""
    q, k, v, keep, first, remainder = _case(b=1, hkv=3, g=2)
    rows, counts = attention._packed(keep, torch.arange(3).view(1, 3) * k.shape[2])
    sel = SelectedRows(keep[0].transpose(0, 1), rows, torch.zeros_like(rows), counts)
    monkeypatch.setattr(fused_select, "enabled", kernel)
    torch.testing.assert_close(attention.attend_rows(q, k, v, sel, first, KVCodec(), SCALE, remainder),
                               attend_teacher_rows(q, k, v, keep, first, KVCodec(), SCALE, remainder),
                               atol=1e-5, rtol=1e-5)


def test_packing_keeps_every_entry_once_in_order():
    """`_packed`: each row's kept entries, head-major and ascending, each as its row of the flat keys."""
    _, k, _, keep, _, _ = _case(b=2, hkv=3, g=1, t=30, first=4)
    b, hkv, r, t = keep.shape
    heads = torch.arange(b * hkv).view(b, hkv) * t
    rows, counts = attention._packed(keep, heads)
    for i in range(b):
        for j in range(r):
            n = int(counts[i * r + j].sum())
            want = (keep[i, :, j].reshape(-1).nonzero()[:, 0] + i * hkv * t).tolist()
            assert rows[i * r + j, :n].tolist() == want
            assert counts[i * r + j].tolist() == keep[i, :, j].sum(-1).tolist()


@pytest.mark.parametrize("kernel", [KERNEL, False])
def test_a_wrong_read_is_seen(kernel, monkeypatch):
    """The comparison above sees a row's read changed by one entry: the reference itself tells them apart."""
    q, k, v, keep, first, remainder = _case(b=1, hkv=2, g=3)
    changed = keep.clone()
    r, c = 10, int(changed[0, 1, 10].nonzero()[0])
    changed[0, 1, r, c] = False  # one entry of row 10, KV head 1, dropped
    monkeypatch.setattr(fused_select, "enabled", kernel)
    got = attention.attend_rows(q, k, v, changed, first, KVCodec(), SCALE, remainder)
    want = attend_teacher_rows(q, k, v, keep, first, KVCodec(), SCALE, remainder)
    assert not torch.allclose(got[:, 3:6, r], want[:, 3:6, r], atol=1e-5)
    torch.testing.assert_close(got[:, :, :r], want[:, :, :r], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_a_layer_that_reads_all_in_view_attends_as_the_padded_reference(window):
    """`attend_visible` (a layer that does not select, no remainder, keys as computed): one fused call, the same
    as reading every entry in view."""
    q, k, v, _, first, _ = _case(b=2, hkv=2, g=3, window=window)
    t = k.shape[2]
    rows = torch.arange(first, t)[:, None]
    visible = torch.arange(t)[None] < rows
    if window is not None:
        visible = visible & (rows - torch.arange(t)[None] < window)
    torch.testing.assert_close(attention.attend_visible(q, k, v, visible, first, SCALE),
                               attend_teacher_rows(q, k, v, visible[None, None], first, KVCodec(), SCALE),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_remainder", [False, True])
def test_rows_that_keep_all_their_past_take_one_causal_call(with_remainder, monkeypatch):
    """A mask keeping every past entry (a layer that does not select, a budget that binds nowhere) leaves nothing
    unread: one fused causal call (`attend_visible`), the remainder weighing 0, to the bit; one entry fewer and the
    packed rows are read."""
    q, k, v, keep, first, remainder = _case(b=2, hkv=2, g=3)
    t = k.shape[2]
    past = (torch.arange(t)[None] < torch.arange(first, t)[:, None]).expand(2, 2, -1, -1)
    rem = remainder if with_remainder else None
    causal = attention.attend_visible(q, k, v, past[0, 0], first, SCALE)
    assert torch.equal(attention.attend_rows(q, k, v, past.clone(), first, KVCodec(), SCALE, rem), causal)
    torch.testing.assert_close(causal, attend_teacher_rows(q, k, v, past, first, KVCodec(), SCALE, rem),
                               atol=1e-5, rtol=1e-5)
    calls = []
    monkeypatch.setattr(attention, "attend_visible", lambda *a: calls.append(1))
    one_fewer = past.clone()
    one_fewer[1, 0, 5, 3] = False
    attention.attend_rows(q, k, v, one_fewer, first, KVCodec(), SCALE, rem)
    attention.attend_rows(q, k, v, past.clone(), first, QuantCodec(4, 8), SCALE, rem)  # coded: read as stored
    assert not calls
