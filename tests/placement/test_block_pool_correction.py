"""Speculation with correction on the disk tier in blocks (`BlockedKVStore`, `Placement.correct`): placement
prefetches the units of what the speculation one layer ahead selected, the layer selects again with its own query,
and the store reads on demand only the units holding own-selected rows that the prefetch did not read. Checked
here: a corrected block pool decodes what the session in fast memory decodes, for tokens, blocks and tokens within
blocks; the units read on demand are exactly the missing ones (counted at the positioned reads), and the file is
read for the prefetch and those units only."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from infinigen import runtime
from infinigen.placement import BlockedKVStore, Placement
from infinigen.placement import blocks as blocks_mod
from infinigen.selection import ALL

from support.offload import B, GEN, PROMPT, FifoVictims, corrected_policy, offload_prompts, run_placed


def _speculated(model, **knobs):
    """`corrected_policy` speculating one layer ahead on the block pool too (`query` corrected: on this store "auto"
    selects with the own query alone), so that there is a prefetch to correct."""
    return corrected_policy(model, query="corrected", **knobs)


BLOCK = 4
SELECTIONS = {"tokens": {}, "blocks": dict(budget="layer", block=BLOCK),
              "tokens within blocks": dict(budget="layer", block=BLOCK, block_fetch=2.0, max_fetch_ratio=0.3)}


@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_corrected_block_pool_decodes_what_fast_memory_decodes(tiny_llama, selection, tmp_path):
    _, model = tiny_llama
    pol = _speculated(model, **SELECTIONS[selection])
    ref_tokens, ref_logits, _ = run_placed(model, Placement("none"), pol)
    pl = Placement("disk", pool_dir=str(tmp_path), disk_block=BLOCK)
    tokens, logits, sess = run_placed(model, pl, pol)
    assert isinstance(sess.store, BlockedKVStore)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    st = sess.store.stats
    # every selecting layer was prefetched, then corrected (or its own selection was the plan: reused as it is);
    # some units were read on demand
    assert st.on_demand + st.reused == GEN * (model.cfg.num_layers - 1) and st.on_demand > 0
    assert st.missed_blocks > 0 and st.missed > 0
    assert st.bytes_moved == st.blocks * sess.store.unit
    # the speculation alone reads something else: the correction is what makes the two equal
    _, uncorrected, sess = run_placed(model, Placement("disk", pool_dir=str(tmp_path), disk_block=BLOCK,
                                                       correct=False), pol)
    assert not torch.allclose(uncorrected, ref_logits, rtol=0, atol=1e-3)
    assert sess.store.stats.missed_blocks == 0 and sess.store.stats.on_demand == 0


@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_by_default_each_layer_reads_its_own_selection_at_its_attention(tiny_llama, selection, tmp_path):
    """InfiniGen's default query ("auto") on the disk in blocks: no speculation one layer ahead (nothing prefetched
    for a selecting layer, nothing to correct), each selecting layer's units read when its own query has selected
    them; the same selection as the speculated and corrected form, so the same logits to the bit."""
    _, model = tiny_llama
    pl = Placement("disk", pool_dir=str(tmp_path), disk_block=BLOCK)
    _, corrected, _ = run_placed(model, pl, _speculated(model, **SELECTIONS[selection]))
    tokens, logits, sess = run_placed(model, pl, corrected_policy(model, **SELECTIONS[selection]))
    st = sess.store.stats
    assert st.on_demand == GEN * (model.cfg.num_layers - 1) and st.missed_blocks == 0 and st.reused == 0
    assert sum(step[0] for step in st.steps) == 0  # no selection's rows prefetched
    assert torch.equal(logits, corrected)


def test_corrected_block_pool_with_an_unlimited_budget_is_dense(tiny_llama, tmp_path):
    _, model = tiny_llama
    from infinigen.policies import make_policy
    _, ref_logits, _ = run_placed(model, Placement("none"), make_policy("full"))
    pol = _speculated(model, alpha=1e9, max_fetch_ratio=1.0)
    _, logits, sess = run_placed(model, Placement("disk", pool_dir=str(tmp_path), disk_block=BLOCK), pol)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert sess.store.stats.missed_blocks == 0  # the speculation selected everything too


def _units(store, layer: int, chosen: torch.Tensor) -> torch.Tensor:
    """The units [B * Hkv, blocks] holding a chosen slot of `layer` (chosen [B, Hkv, n]) that live in the file
    (the open block is in fast memory)."""
    n, bs = chosen.shape[-1], store.block
    nb = -(-n // bs)
    per_block = F.pad(chosen, (0, nb * bs - n)).reshape(store.bh, nb, bs).any(-1)
    if n < store.capacity:
        per_block[:, n // bs:] = False
    return per_block


@pytest.mark.parametrize("selection", ["tokens", "tokens within blocks"])
def test_on_demand_units_are_exactly_those_the_prefetch_missed(tiny_llama, selection, tmp_path, monkeypatch):
    """Per layer and step, from what placement prefetched (the plan) and what the layer's own query selected:
    the units read on demand (their file offsets, at the reads) are the units holding own-selected rows and no
    prefetched one, less those the layer's last `hold_steps` steps read on demand too (held in fast memory since;
    no cap here), and the file is read for the prefetched units and those only."""
    _, model = tiny_llama
    pol = _speculated(model, **SELECTIONS[selection])
    tokens, pad = offload_prompts()
    pl = Placement("disk", pool_dir=str(tmp_path), disk_block=BLOCK, threaded=False)
    planned: dict = {}
    want = {"read": 0, "missed": [], "held": 0}  # missed: file offsets, a unit per step it was read on demand
    missed_at: dict = {}  # per layer and unit: the last step it was missed

    class Own(runtime.Listener):
        def on_select(self, layer, rows, keep, s):
            store = s.store
            n = store.length[layer]
            plan, valid = planned.pop(layer), store.valid[layer][:, :, :n]
            if plan is ALL:  # every used slot's unit, padding's too
                want["read"] += int(_units(store, layer, torch.ones_like(valid)).sum())
                return
            prefetched = _units(store, layer, plan[:, :, :n] & valid)
            missed = _units(store, layer, keep[:, :, 0, :n] & valid) & ~prefetched
            last = missed_at.setdefault(layer, torch.full((store.bh, store.blocks_per_head), -10**6))
            last = last[:, :missed.shape[1]]
            held = missed & (last >= store._step - store.hold_steps)
            last[missed] = store._step
            missed &= ~held
            want["held"] += int(held.sum())
            want["read"] += int(prefetched.sum() + missed.sum())
            for bh, j in missed.nonzero().tolist():
                want["missed"].append(store._offset(layer, bh, j))

    sess = pl.new_session(model, B, PROMPT + GEN, pol, listeners=[Own()])
    store = sess.store
    store.hold_share = 1.0  # every recent miss held
    issue, corrected = store._issue, store._corrected

    def remember(layer, plan):  # what placement prefetches for `layer`
        planned[layer] = plan
        issue(layer, plan)

    reads, on_demand = [], []
    preadv = os.preadv

    def counting_preadv(fd, bufs, offset):
        n = preadv(fd, bufs, offset)
        reads.append(n)
        if store._correcting:
            on_demand.extend(range(offset, offset + n, store.unit))
        return n

    def correcting(*args):
        store._correcting = True
        try:
            return corrected(*args)
        finally:
            store._correcting = False

    store._issue, store._corrected, store._correcting = remember, correcting, False
    logits = runtime.prefill(model, tokens, sess, pad)
    store.stats.reset()
    monkeypatch.setattr(blocks_mod.os, "preadv", counting_preadv)
    monkeypatch.setattr(blocks_mod, "native_reads", False)  # every read through os.preadv, counted
    for _ in range(GEN):
        logits = runtime.decode(model, logits.argmax(-1), sess)
    pl.close(sess)
    assert sorted(on_demand) == sorted(want["missed"]) and len(want["missed"]) > 0 and want["held"] > 0
    assert len(on_demand) == store.stats.missed_blocks
    assert sum(reads) == want["read"] * store.unit == store.stats.bytes_moved


@pytest.mark.parametrize("correct", [True, False])
def test_breakdown_times_the_correction_apart(tiny_llama, correct, tmp_path):
    """`Breakdown` on a block pool that corrects times the layer's own selection, the corrected hand-over and its
    on-demand reads apart (what `benchmarks/disk_blocks.py --breakdown` reports); one that reads the speculation
    alone has no such part. Leaving it puts every instrumented method back."""
    from infinigen.placement.timing import Breakdown
    _, model = tiny_llama
    pol = _speculated(model, budget="layer", block=BLOCK)
    tokens, pad = offload_prompts()
    sess = Placement("disk", pool_dir=str(tmp_path), disk_block=BLOCK, correct=correct).new_session(
        model, B, tokens.shape[1] + GEN, pol)
    try:
        store = sess.store
        tok = runtime.prefill(model, tokens, sess, pad).argmax(-1)
        for _ in range(GEN - 2):
            tok = runtime.decode(model, tok, sess).argmax(-1)
        missed0 = store.stats.missed_blocks
        with Breakdown(model, sess) as bd:
            for _ in range(2):
                tok = bd.step(tok).argmax(-1)
        detail = bd.summary().get("detail_ms_per_step", {})
        assert not {"keep", "hand_rows", "_corrected", "_load"} & (set(vars(store)) | set(vars(sess.policy)))
        if not correct:
            assert detail == {}
            return
        assert set(detail) == {"own selection", "hand rows", "corrected hand-over", "on-demand reads"}
        assert detail["own selection"] > 0 and detail["hand rows"] >= detail["corrected hand-over"] > 0
        assert (detail["on-demand reads"] > 0) == (store.stats.missed_blocks > missed0)
        # the main thread reads only in a corrected hand-over here (the prefetches ran on the worker)
        assert detail["on-demand reads"] <= detail["corrected hand-over"]
    finally:
        Placement.close(sess)


class HeldUnitVictims(FifoVictims):
    """Victims at the first slot of the last unit a layer's block pool holds (`BlockedKVStore._held`), slot 0 where
    it holds none, every choice recorded; or the recorded choices replayed (`replay`) by a store in fast memory."""

    def __init__(self, replay=None):
        self.chosen, self.replay = [], None if replay is None else iter(replay)

    def victims(self, layer, store):
        if self.replay is not None:
            return next(self.replay)
        b, h = store.valid[layer].shape[:2]
        held = store._held.get(layer)
        slot = 0 if held is None else int(held[0][-1]) % store.blocks_per_head * store.block
        self.chosen.append(torch.full((b, h), slot, dtype=torch.long))
        return self.chosen[-1]


def test_held_units_are_the_files_with_victims(tiny_llama, tmp_path):
    """The units a corrected block pool holds for its next steps, checked after every step against the file, with
    victims written into held units: a held copy of a unit a victim's token changed is gone, never read; the tokens
    are those of fast memory evicting the same slots."""
    _, model = tiny_llama
    pol = _speculated(model, remainder=False)  # (no remainder under a pool limit)
    victims = HeldUnitVictims()
    tokens, steps, sess = run_placed(model, Placement("disk", pool_dir=str(tmp_path), disk_block=BLOCK,
                                                       threaded=False), pol, capacity=PROMPT, allocator=victims,
                                     keep=True, gen=1)
    store = sess.store
    store.hold_share = 1.0
    out, checked, logits = [tokens[:, 0]], 0, steps[:, -1]
    for _ in range(GEN - 1):
        out.append(logits.argmax(-1))
        logits = runtime.decode(model, out[-1], sess)
        for layer, (ids, units, _) in store._held.items():
            fresh = torch.empty_like(units)
            store._load(layer, ids, fresh)
            assert torch.equal(fresh, units)
            checked += ids.numel()
    Placement("disk").close(sess)
    assert checked > 0
    ref_tokens, _, _ = run_placed(model, Placement("none"), pol, capacity=PROMPT, gen=GEN,
                                  allocator=HeldUnitVictims(replay=victims.chosen))
    assert torch.equal(torch.stack(out, 1), ref_tokens)
