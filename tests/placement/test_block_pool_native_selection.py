"""The disk tier in blocks with InfiniGen choosing blocks through the native block selection
(`kernels.block_select.select_blocks`): the speculation one layer ahead and the layer's own query (the correction)
each make their blocks in one call per layer, and a session decodes what the torch path (`choose_blocks`,
`KVStore.select_rows`) decodes: the same selections at every layer and step, the same units read from the file
(prefetched and on demand), the same tokens and logits; with an unlimited budget the dense result. The comparison
fails when the native selection's blocks are off by a slot or its cap is lifted."""
from __future__ import annotations

import os

import pytest
import torch

from infinigen import runtime
from infinigen.kernels import block_select
from infinigen.placement import BlockedKVStore, Placement
from infinigen.policies import make_policy

from support.offload import GEN, corrected_policy, offload_prompts, run_placed
from support.packed_rows import Selections

needs_kernel = pytest.mark.skipif(not block_select.available(), reason="the block kernel cannot be built here")
BLOCK = 4
# unpadded prompts: every used slot valid, where the native selection applies (a padded prompt keeps torch's)
PROMPTS = (offload_prompts()[0], None)


def _decode(model, placement, pol, native: bool, monkeypatch, wrap=None):
    """Greedy decoding of the unpadded prompts: (tokens, logits, every selection the layers' own queries made,
    the store's counters, native calls)."""
    monkeypatch.setattr(block_select, "enabled", native)
    calls = [0]
    inner = block_select.select_blocks

    def counted(*args, **kw):
        calls[0] += 1
        return (wrap or inner)(*args, **kw)
    monkeypatch.setattr(block_select, "select_blocks", counted)
    seen = Selections()
    pl = placement
    sess = pl.new_session(model, PROMPTS[0].shape[0], PROMPTS[0].shape[1] + GEN, pol, listeners=[seen])
    logits = runtime.prefill(model, PROMPTS[0], sess)
    out, steps = [], []
    for _ in range(GEN):
        out.append(logits.argmax(-1))
        logits = runtime.decode(model, out[-1], sess)
        steps.append(logits)
    st = getattr(sess.store, "stats", None)  # (a store in fast memory moves nothing)
    counters = st and dict(blocks=st.blocks, missed_blocks=st.missed_blocks, missed=st.missed, bytes=st.bytes_moved)
    pl.close(sess)
    return torch.stack(out, 1), torch.stack(steps, 1), seen.seen, counters, calls[0]


def _same_selections(seen, ref):
    return seen.keys() == ref.keys() and all(
        (seen[k] == "all" and ref[k] == "all") or torch.equal(seen[k], ref[k]) for k in seen)


@needs_kernel
@pytest.mark.parametrize("correct", [True, False], ids=["corrected", "speculation-only"])
def test_native_blocks_decode_what_the_torch_path_decodes(tiny_llama, correct, tmp_path, monkeypatch):
    """Both selections of every selecting layer and step go through the native call (two per layer and step when
    corrected: the speculation's plan, then the own query's), and the session selects, reads and decodes what the
    torch path does."""
    _, model = tiny_llama
    pol = corrected_policy(model, budget="layer", block=BLOCK, query="corrected")  # a prefetch to correct
    pl = Placement("disk", pool_dir=str(tmp_path), disk_block=BLOCK, correct=correct)
    ref = _decode(model, pl, pol, False, monkeypatch)
    got = _decode(model, pl, pol, True, monkeypatch)
    selecting = len(pol.selecting_layers(model.cfg))
    assert ref[4] == 0 and got[4] == selecting * GEN * (2 if correct else 1)
    assert torch.equal(got[0], ref[0]) and _same_selections(got[2], ref[2])
    assert got[3] == ref[3] and got[3]["blocks"] > 0
    assert (got[3]["missed_blocks"] > 0) == correct
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-5)


@needs_kernel
def test_native_blocks_in_fast_memory_equal_the_torch_path(tiny_llama, monkeypatch):
    """The KV in RAM: the layer's own query selects its blocks natively, packed, and the attention reads them."""
    _, model = tiny_llama
    pol = corrected_policy(model, budget="layer", block=BLOCK)
    ref = _decode(model, Placement("none"), pol, False, monkeypatch)
    got = _decode(model, Placement("none"), pol, True, monkeypatch)
    assert got[4] == len(pol.selecting_layers(model.cfg)) * GEN
    assert torch.equal(got[0], ref[0]) and _same_selections(got[2], ref[2])
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-5)


@needs_kernel
def test_native_blocks_with_an_unlimited_budget_are_dense(tiny_llama, tmp_path, monkeypatch):
    _, model = tiny_llama
    full = make_policy("full")
    _, ref_logits, _ = run_placed(model, Placement("none"), full, prompts=PROMPTS)
    pol = corrected_policy(model, budget="layer", block=BLOCK, alpha=1e9, max_fetch_ratio=1.0)
    pl = Placement("disk", pool_dir=str(tmp_path), disk_block=BLOCK)
    _, logits, _, counters, calls = _decode(model, pl, pol, True, monkeypatch)
    assert calls > 0 and counters["missed_blocks"] == 0
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("breakage", ["block boundary off by one", "cap lifted"])
def test_the_session_check_catches_a_broken_native_selection(tiny_llama, breakage, tmp_path, monkeypatch):
    _, model = tiny_llama
    pol = corrected_policy(model, budget="layer", block=BLOCK)
    pl = Placement("disk", pool_dir=str(tmp_path), disk_block=BLOCK)
    ref = _decode(model, pl, pol, False, monkeypatch)
    inner = block_select.select_blocks

    def broken(scores, scale, alpha, total, block, capacity, with_lse, pack=True):
        if breakage == "block boundary off by one":
            block += 1
        else:
            total = scores.shape[1] * scores.shape[3]
        return inner(scores, scale, alpha, total, block, capacity, with_lse, pack)
    got = _decode(model, pl, pol, True, monkeypatch, wrap=broken)
    assert got[4] > 0
    assert not _same_selections(got[2], ref[2]) or got[3] != ref[3]


def test_a_padded_prompt_keeps_the_torch_path(tiny_llama, tmp_path, monkeypatch):
    """Where some used slot is not valid (a left-padded prompt) the torch path selects: the kernel assumes every
    slot valid."""
    _, model = tiny_llama
    calls = [0]
    inner = block_select.select_blocks
    monkeypatch.setattr(block_select, "select_blocks", lambda *a, **kw: (calls.__setitem__(0, calls[0] + 1),
                                                                        inner(*a, **kw))[1])
    pol = corrected_policy(model, budget="layer", block=BLOCK)
    _, _, sess = run_placed(model, Placement("disk", pool_dir=str(tmp_path), disk_block=BLOCK), pol)
    assert isinstance(sess.store, BlockedKVStore) and sess.store.padded
    assert calls[0] == 0


# ---- the corrected hand-over's bookkeeping (`block_select.staged_places`) -----------------------------------------
def _pool(tmp_path, batch, hkv, capacity, block):
    from infinigen.placement.tiers import SlowTier
    return BlockedKVStore(1, batch, hkv, capacity, 8, torch.float32, tier=SlowTier("disk", "cpu", tmp_path),
                          threaded=False, block=block)


def _places_case(store, seed, n, density, staged_share):
    """A random packed selection over the first n slots and a random ascending set of staged units."""
    from infinigen.cache import KVStore
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(store.batch, store.kv_heads, n, generator=gen) < density
    sel = KVStore.select_rows(store, 0, keep, torch.ones_like(keep))
    units = store.bh * store.blocks_per_head
    held = (torch.rand(units, generator=gen) < staged_share).nonzero().squeeze(1)
    return held, sel


def _native_places(store, held, sel, block=None):
    return block_select.staged_places(held, sel.rows, sel.head, store.capacity, block or store.block,
                                      store.blocks_per_head, store.unit_rows, store.bh * store.blocks_per_head)


PLACES = [(2, 3, 40, 4, 26), (3, 3, 512, 32, 500), (1, 2, 64, 16, 64), (4, 1, 30, 8, 3)]  # B, Hkv, cap, block, n


@needs_kernel
@pytest.mark.parametrize("case", PLACES, ids=["x".join(map(str, c)) for c in PLACES])
def test_staged_places_equal_the_torch_bookkeeping(case, tmp_path):
    """The units to read, each packed column's row in the staging buffer and the count of missed entries equal the
    torch bookkeeping's, whatever share of the units the prefetch staged (none, some, all) and the selection holds
    (nothing, sparse, dense)."""
    b, hkv, cap, block, n = case
    store = _pool(tmp_path, b, hkv, cap, block)
    try:
        for seed in range(6):
            for density in (0.0, 0.05, 0.4, 1.0):
                for staged in (0.0, 0.3, 1.0):
                    held, sel = _places_case(store, seed, n, density, staged)
                    ids, rows, missed = _native_places(store, held, sel)
                    ids_ref, rows_ref, missed_ref = store._staged_places(held, sel)
                    assert torch.equal(ids, ids_ref) and torch.equal(rows, rows_ref) and missed == missed_ref
    finally:
        store.close()


@needs_kernel
@pytest.mark.parametrize("breakage", ["block off by one", "a staged unit forgotten"])
def test_the_places_check_catches_a_wrong_unit(breakage, tmp_path):
    store = _pool(tmp_path, 3, 3, 512, 32)
    try:
        held, sel = _places_case(store, 1, 500, 0.05, 0.3)
        ref = store._staged_places(held, sel)
        if breakage == "block off by one":
            got = _native_places(store, held, sel, block=store.block + 1)
        else:
            got = _native_places(store, held[1:], sel)
        assert not (torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) and got[2] == ref[2])
    finally:
        store.close()


@needs_kernel
@pytest.mark.parametrize("density", [0.0, 0.03, 0.5, 1.0])
def test_packed_plan_equals_select_rows(density):
    """A prefetched plan packed natively (`block_select.pack_rows`) is `KVStore.select_rows`'s packing: the same
    rows, heads and counts, batch rows of unequal totals padded alike."""
    from infinigen.cache import KVStore
    gen = torch.Generator().manual_seed(int(density * 100))
    for b, hkv, n, cap in [(3, 3, 300, 320), (1, 2, 17, 17), (5, 1, 64, 100)]:
        keep = torch.rand(b, hkv, n, generator=gen) < density
        keep[0] &= density < 1  # one batch row keeping nothing (unless all)
        store = KVStore(1, b, hkv, cap, 4, torch.float32)
        ref = store.select_rows(0, keep, torch.ones_like(keep))
        rows, head, counts = block_select.pack_rows(keep, cap)
        assert torch.equal(rows, ref.rows) and torch.equal(head, ref.head) and torch.equal(counts, ref.counts)
        wrong = block_select.pack_rows(keep, cap + 1)[0]
        assert not torch.equal(wrong, ref.rows) or not keep[1:].any()  # the store's capacity matters


# ---- the units loaded and held natively (`block_select.load_units`, `hold_units`) ------------------------------
@needs_kernel
def test_native_loads_and_holds_stage_the_bytes_the_python_ones_stage(tiny_llama, tmp_path, monkeypatch):
    """A session whose units are loaded (open blocks, held units, the file) and held by the native kernel decodes,
    stages and counts what the same session reading through os.preadv and holding in torch does, to the bit; held
    units are copied from fast memory along the way."""
    from infinigen.placement import blocks as blocks_mod
    _, model = tiny_llama
    pol = corrected_policy(model, budget="layer", block=BLOCK, query="corrected")  # a prefetch to correct
    pl = Placement("disk", pool_dir=str(tmp_path), disk_block=BLOCK)
    monkeypatch.setattr(blocks_mod, "native_reads", False)
    ref = _decode(model, pl, pol, True, monkeypatch)
    monkeypatch.setattr(blocks_mod, "native_reads", True)
    calls = {"load_units": 0, "hold_units": 0, "copied": 0}
    for name in ("load_units", "hold_units"):
        def counted(*a, _inner=getattr(block_select, name), _name=name, **kw):
            calls[_name] += 1
            out = _inner(*a, **kw)
            if _name == "load_units":
                calls["copied"] += out[1]
            return out
        monkeypatch.setattr(block_select, name, counted)
    got = _decode(model, pl, pol, True, monkeypatch)
    assert calls["load_units"] > 0 and calls["hold_units"] > 0 and calls["copied"] > 0
    assert got[3] == ref[3]
    assert torch.equal(got[0], ref[0]) and _same_selections(got[2], ref[2])
    assert torch.equal(got[1], ref[1])  # the same bytes attended: the same logits to the bit


@needs_kernel
def test_native_loads_take_each_unit_from_where_it_is_and_fail_in_one_line(tmp_path):
    """Units at scattered places of a file land in order (runs of adjacent units in one read), an open block comes
    from the open blocks and a held unit from the held data, not from the file; a unit past the file's end is an
    OSError naming where it ended."""
    unit, nb = 4096, 8  # 2 (batch row, KV head) of 8 blocks each; the open block is block 6
    words = unit // 8
    data = torch.arange(16 * words, dtype=torch.int64)  # 16 units in the file, each its own numbers
    path = tmp_path / "pool"
    path.write_bytes(data.numpy().tobytes())
    open_blocks = -torch.arange(1, 2 * words + 1, dtype=torch.int64)  # (negative: not the file's)
    held, held_data = torch.tensor([3, 12]), torch.full((2, words), 7, dtype=torch.int64)
    fd = os.open(path, os.O_RDONLY)
    try:
        ids = torch.tensor([1, 2, 3, 6, 7, 12, 14])
        dst = torch.full((7, words), -1, dtype=torch.int64)
        read, copied = block_select.load_units(fd, ids, 0, nb, 6, open_blocks, held, held_data, dst, unit, True)
        assert (read, copied) == (3, 2)
        units = data.view(16, words)
        for place, want in enumerate([units[1], units[2], held_data[0], open_blocks.view(2, words)[0], units[7],
                                      held_data[1], open_blocks.view(2, words)[1]]):
            assert torch.equal(dst[place], want), place
        empty = torch.empty(0, dtype=torch.long)
        with pytest.raises(OSError, match="ended at byte"):
            block_select.load_units(fd, torch.tensor([0]), 16, nb, -1, open_blocks, empty, empty, dst, unit, False)
    finally:
        os.close(fd)


@needs_kernel
@pytest.mark.parametrize("limit", [1000, 5, 0])
def test_native_hold_equals_the_torch_hold(limit, tmp_path):
    """Step after step, the units held natively are those `HoldsMisses._hold` holds, with the same data and steps:
    old ones staying while recent and not added again, past the limit the most recently added first; an open block
    not added."""
    store = _pool(tmp_path, 2, 2, 64, 4)  # 4 (batch row, KV head) x 16 blocks
    try:
        store.hold_share = limit * store.block / (store.bh * store.capacity)
        store.length[0] = store.capacity
        gen = torch.Generator().manual_seed(limit)
        per, d = store.unit_rows, store.head_dim
        units = store.bh * store.blocks_per_head
        native = None
        for step in range(12):
            store._step = step
            ids = (torch.rand(units, generator=gen) < 0.2).nonzero().squeeze(1)
            added = torch.randn(ids.numel(), per, d, generator=gen)
            open_j = step % store.blocks_per_head
            closed = ids % store.blocks_per_head != open_j
            store._hold(0, ids[closed], (added[closed],), store.block)
            prev = native or (torch.empty(0, dtype=torch.long), torch.empty(0), torch.empty(0, dtype=torch.long))
            got = block_select.hold_units(*prev, ids, added, store.blocks_per_head, open_j, step, store.hold_steps,
                                          int(store.hold_share * store.capacity * store.bh) // store.block,
                                          store.unit)
            native = (got[0], got[1].view(torch.float32).view(-1, per, d), got[2]) if got[0].numel() else None
            ref = store._held.get(0)
            if ref is None:
                assert native is None
                continue
            assert native is not None and torch.equal(native[0], ref[0]) and torch.equal(native[2], ref[2])
            assert torch.equal(native[1], ref[1])
    finally:
        store.close()


@needs_kernel
def test_the_own_selection_on_disk_is_packed_by_the_native_selection(tiny_llama, tmp_path, monkeypatch):
    """The default on the disk in blocks (each layer's own query, read at its attention): the policy's native
    selection packs the rows the store reads, as in fast memory; the runtime's torch packing
    (`KVStore.select_rows`) never runs for a selecting layer, and the session decodes what fast memory decodes."""
    from infinigen.cache import KVStore
    _, model = tiny_llama
    pol = corrected_policy(model, budget="layer", block=BLOCK)
    ref = _decode(model, Placement("none"), pol, True, monkeypatch)
    calls = [0]
    inner = KVStore.select_rows

    def counted(self, *a, **kw):
        calls[0] += 1
        return inner(self, *a, **kw)
    monkeypatch.setattr(KVStore, "select_rows", counted)
    got = _decode(model, Placement("disk", pool_dir=str(tmp_path), disk_block=BLOCK), pol, True, monkeypatch)
    assert got[4] == len(pol.selecting_layers(model.cfg)) * GEN and calls[0] == 0
    assert torch.equal(got[0], ref[0]) and _same_selections(got[2], ref[2])
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-5)
