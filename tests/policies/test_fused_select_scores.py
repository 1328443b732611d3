"""The native pieces of a selecting step that must not change a number: the 4-bit keys' scores of every
(batch row, KV head) in one call (`fused_select.score_int4`) equal, bit for bit, torch's int4 kernel called once
per (batch row, KV head) from Python (the torch path, and its fallback without a build); and the fused
attention reads bfloat16 rows as exactly their float32 values (the same log-sum-exp and value sums to the bit,
the output the float32 one rounded once)."""
from __future__ import annotations

import pytest
import torch

from infinigen.kernels import fused_select
from infinigen.kernels.int4 import PackedKeys, tinygemm_ok

needs_kernel = pytest.mark.skipif(not fused_select.available(), reason="the fused kernel cannot be built here")
needs_tinygemm = pytest.mark.skipif(not tinygemm_ok(64), reason="torch's CPU int4 kernel does not take this layout")

# (batch, KV heads, group of query heads, capacity, the lengths scored): G 1/3/7; lengths inside a 64-token
# block, on its edge and the whole capacity; several lengths over the same keys (sessions of different lengths)
CASES = [(2, 3, 3, 300, (200, 64, 1)), (1, 1, 1, 128, (64, 128)), (3, 2, 7, 1000, (999, 577)),
         (8, 3, 3, 1100, (1024, 1090))]


def _scores_both_ways(pk: PackedKeys, q: torch.Tensor, n: int, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    native = pk.scores(q, n)
    with monkeypatch.context() as m:
        m.setattr(fused_select, "enabled", False)  # the torch path: one kernel call per (batch row, KV head)
        reference = pk.scores(q, n)
    return native, reference


@needs_kernel
@needs_tinygemm
@pytest.mark.parametrize("case", CASES, ids=["x".join(map(str, c[:4])) for c in CASES])
@pytest.mark.parametrize("part_slots", [64, 192, None])
def test_one_call_scores_equal_the_per_head_kernel_calls(case, part_slots, monkeypatch):
    """Every (batch row, KV head)'s slots scored in parts of whole blocks (one block, three, the default): the
    same bits as one kernel call per (batch row, KV head) over all of them."""
    b, hkv, g, capacity, lengths = case
    if part_slots:
        monkeypatch.setattr(fused_select, "SLOTS_PER_PART", part_slots)
    gen = torch.Generator().manual_seed(capacity)
    pk = PackedKeys(b, hkv, capacity, 64, group=32, layout="tinygemm")
    pk.write(0, torch.randn(b, hkv, capacity, 64, generator=gen) * torch.linspace(0.1, 3, hkv).view(1, hkv, 1, 1))
    q = torch.randn(b, hkv, g, 64, generator=gen)
    for n in lengths:
        native, reference = _scores_both_ways(pk, q, n, monkeypatch)
        assert native.shape == (b, hkv, g, n) and native.dtype == torch.float32
        assert torch.equal(native, reference), f"n={n}: largest difference {(native - reference).abs().max()}"


@needs_kernel
@needs_tinygemm
def test_the_score_comparison_catches_a_wrong_head_or_slot(monkeypatch):
    """What the equality above would see of a scorer that mixed up (batch row, KV head) or shifted a slot."""
    b, hkv, g, capacity, n = 2, 3, 3, 300, 200
    gen = torch.Generator().manual_seed(1)
    pk = PackedKeys(b, hkv, capacity, 64, group=32, layout="tinygemm")
    pk.write(0, torch.randn(b, hkv, capacity, 64, generator=gen))
    q = torch.randn(b, hkv, g, 64, generator=gen)
    native, reference = _scores_both_ways(pk, q, n, monkeypatch)
    assert not torch.equal(native.flip(1), reference)
    assert not torch.equal(native.roll(1, -1), reference)


@needs_kernel
@pytest.mark.parametrize("g", [1, 3, 7])
def test_bfloat16_rows_are_read_as_their_float32_values(g):
    b, hkv, d, s = 3, 2, 64, 700
    gen = torch.Generator().manual_seed(g)
    keys = torch.randn(b * hkv * s, d, generator=gen).bfloat16()
    values = torch.randn(b * hkv * s, d, generator=gen).bfloat16()
    q = torch.randn(b, hkv * g, d, generator=gen).bfloat16()
    counts = torch.randint(0, s // 2, (b, hkv), generator=gen)
    counts[0, 0] = 0  # a (batch row, KV head) that reads only its own token
    rows = torch.zeros(b, int(counts.sum(1).max()), dtype=torch.long)
    for i in range(b):
        run = [torch.randperm(s, generator=gen)[:int(c)].sort().values + (i * hkv + j) * s
               for j, c in enumerate(counts[i])]
        rows[i, :int(counts[i].sum())] = torch.cat(run)
    own = (torch.arange(b * hkv).view(b, hkv) + 1) * s - 1
    out16, lse16, sums16 = fused_select.attend_rows(q, keys, values, rows, counts, own, d ** -0.5)
    out32, lse32, sums32 = fused_select.attend_rows(q.float(), keys.float(), values.float(), rows, counts, own,
                                                    d ** -0.5)
    assert torch.equal(lse16, lse32) and torch.equal(sums16, sums32)
    assert torch.equal(out16, out32.bfloat16())


def _appended_both_ways(rows: torch.Tensor, slots: torch.Tensor, capacity: int, monkeypatch):
    """The same prompt keys, then `rows` scattered into `slots` natively and by the torch path."""
    b, hkv, _, d = rows.shape
    prompt = torch.randn(b, hkv, capacity, d, generator=torch.Generator().manual_seed(5))
    native = PackedKeys(b, hkv, capacity, d, group=32, layout="tinygemm")
    reference = PackedKeys(b, hkv, capacity, d, group=32, layout="tinygemm")
    for keys in (native, reference):
        keys.write(0, prompt)
    native.scatter(slots, rows)
    with monkeypatch.context() as m:
        m.setattr(fused_select, "enabled", False)  # the torch path: quantize, then scatter the bytes
        reference.scatter(slots, rows)
    return native, reference


@needs_kernel
@needs_tinygemm
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_call_append_writes_the_bytes_of_the_torch_path(seed, monkeypatch):
    """Slots in both halves of a 64-token block (low and high nibbles) and in the last block; keys of every
    scale, a group of equal values (the smallest scale), codes exactly half-way between two levels."""
    b, hkv, d, capacity = 4, 3, 64, 200
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(b, hkv, 1, d, generator=gen) * torch.logspace(-3, 3, b).view(b, 1, 1, 1)
    rows[0, 0, 0, :32] = 0.7  # one group of equal values
    # min 0 and max 15: scale 1 and zero 8, exact in bfloat16, so x + 0.5 lies half-way between two codes
    rows[1, 1, 0, 32:] = torch.cat([torch.tensor([0.0, 15.0]), torch.arange(30) % 15 + 0.5])
    slots = torch.randint(0, capacity, (b, hkv), generator=gen)
    slots[0] = torch.tensor([5, 40, 199])  # low nibble, high nibble, the last slot
    native, reference = _appended_both_ways(rows, slots, capacity, monkeypatch)
    assert torch.equal(native.codes, reference.codes)
    assert torch.equal(native.sz.view(torch.int16), reference.sz.view(torch.int16))


@needs_kernel
@needs_tinygemm
def test_the_append_comparison_catches_a_wrong_nibble_or_slot(monkeypatch):
    b, hkv, d, capacity = 2, 3, 64, 200
    rows = torch.randn(b, hkv, 1, d, generator=torch.Generator().manual_seed(3))
    slots = torch.tensor([[5, 40, 199], [64, 100, 31]])
    native, reference = _appended_both_ways(rows, slots, capacity, monkeypatch)
    other, _ = _appended_both_ways(rows, (slots + 32) % capacity, capacity, monkeypatch)  # the other nibble
    assert not torch.equal(other.codes, reference.codes)
    assert torch.equal(native.codes, reference.codes)


@needs_kernel
@needs_tinygemm
def test_an_append_out_of_range_is_refused():
    keys = PackedKeys(1, 1, 64, 64, group=32, layout="tinygemm")
    with pytest.raises(RuntimeError, match="slot out of range"):
        keys.scatter(torch.tensor([[64]]), torch.randn(1, 1, 1, 64))
