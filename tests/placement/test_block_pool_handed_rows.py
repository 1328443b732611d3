"""The rows a block pool (`BlockedKVStore.hand_rows`) hands the attention are where they lie in its staging buffer,
with no copy: for a selection the prefetch staged, one it staged nothing for, a corrected selection that adds units
(read into the same buffer after the staged ones, the buffer grown) and every visible slot, each packed column's
handed key and value row is that slot's key and value as written (the open block's from memory), and writing the
token's own rows (what the attention does) leaves every selected row as it was."""
from __future__ import annotations

import pytest
import torch

from infinigen.cache import KVStore
from infinigen.placement import BlockedKVStore
from infinigen.placement.tiers import SlowTier

LAYERS, BATCH, HKV, D, BLOCK = 2, 2, 3, 8, 4  # 6 (batch row, KV head) pairs: more spare rows than a block
CAPACITY, PROMPT = 40, 26  # the prompt ends inside a block: the open block holds two of its slots


def _store(tmp_path, keys, values):
    store = BlockedKVStore(LAYERS, BATCH, HKV, CAPACITY, D, torch.float32, tier=SlowTier("disk", "cpu", tmp_path),
                           threaded=False, block=BLOCK)
    valid = torch.ones(BATCH, PROMPT, dtype=torch.bool)
    positions = torch.arange(PROMPT).expand(BATCH, PROMPT)
    for layer in range(LAYERS):
        store.write_prompt(layer, keys[layer], values[layer], valid, positions)
    return store


def _mask(gen, density: float) -> torch.Tensor:
    return torch.rand(BATCH, HKV, PROMPT, generator=gen) < density


def _check(store, layer, sel, handed, keys, values) -> None:
    """Every packed column's handed rows hold its slot's key and value; the own rows are distinct from them and
    from each other, for keys and for values."""
    real = sel.head >= 0
    b = torch.arange(BATCH)[:, None].expand_as(sel.rows)[real]
    h, slot = sel.head[real], sel.rows[real] % CAPACITY
    at = handed.rows[real]
    assert torch.equal(handed.keys[at], keys[layer][b, h, slot])
    assert torch.equal(handed.values[at], values[layer][b, h, slot])
    marks = torch.full((BATCH * HKV, D), -7.0)
    handed.keys.index_copy_(0, handed.own.reshape(-1), marks)
    handed.values.index_copy_(0, handed.own.reshape(-1), 2 * marks)
    assert torch.equal(handed.keys[at], keys[layer][b, h, slot])
    assert torch.equal(handed.values[at], values[layer][b, h, slot])
    assert torch.equal(handed.keys[handed.own.reshape(-1)], marks)
    assert torch.equal(handed.values[handed.own.reshape(-1)], 2 * marks)


@pytest.mark.parametrize("case", ["prefetched", "nothing prefetched", "corrected", "corrected, nothing staged",
                                  "every slot"])
def test_handed_rows_are_the_selected_slots(case, tmp_path):
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(LAYERS, BATCH, HKV, PROMPT, D, generator=gen)
    values = torch.randn(LAYERS, BATCH, HKV, PROMPT, D, generator=gen)
    store = _store(tmp_path, keys, values)
    try:
        layer = 1
        valid = store.valid[layer][:, :, :PROMPT]
        own = _mask(gen, 0.3)
        own[:, :, -1] = True  # a slot of the open block
        plan = {"prefetched": own, "corrected": _mask(gen, 0.15),
                "corrected, nothing staged": torch.zeros_like(own)}.get(case)
        if plan is not None:
            store._issue(layer, plan)
        if case == "every slot":
            sel = store.every_row(layer)
        elif case == "prefetched":
            sel = store.select_rows(layer, own, valid)
            assert sel is store._jobs[layer].selection  # the plan's own packing: handed as staged
        else:
            sel = KVStore.select_rows(store, layer, own, valid)
        handed = store.hand_rows(layer, sel, None, every=case == "every slot")
        _check(store, layer, sel, handed, keys, values)
        if case.startswith("corrected"):
            assert store.stats.missed_blocks > 0
        if case != "every slot":  # views of the staging buffer: nothing gathered
            assert handed.keys.untyped_storage().data_ptr() == handed.values.untyped_storage().data_ptr()
    finally:
        store.close()
