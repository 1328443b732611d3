"""Speculation with correction on an offloaded tier (`Placement.correct`, the default): placement prefetches what
the speculation one layer ahead selected, the layer selects again with its own query at its attention over the
same 4-bit keys, and the store fetches on demand, in one gather, only the rows of that selection the prefetch
missed. Checked here: an offloaded session then decodes what the session in fast memory decodes (its own
selection and its remainder), with an unlimited budget the dense result; the rows fetched on demand are exactly
the own selection less the prefetched one, and the slow tier is read for the prefetch and those rows only."""
from __future__ import annotations

import pytest
import torch

from infinigen import runtime
from infinigen.placement import Placement
from infinigen.policies import make_policy
from infinigen.selection import ALL

from support.offload import (B, GEN, PROMPT, FifoVictims, SlowReads, corrected_policy, offload_prompts,
                             run_placed)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_corrected_offload_decodes_what_fast_memory_decodes(tiny_llama, kind, tmp_path, device):
    model = tiny_llama[1].to(device)
    pol = corrected_policy(model)
    ref_tokens, ref_logits, _ = run_placed(model, Placement("none"), pol)
    tokens, logits, sess = run_placed(model, Placement(kind, pool_dir=str(tmp_path)), pol)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    st = sess.store.stats
    # every selecting layer was prefetched and corrected (on demand: only the missed rows), some missed rows
    assert st.fetches == GEN * model.cfg.num_layers and st.on_demand == GEN * (model.cfg.num_layers - 1)
    assert st.missed > 0 and len(st.steps) == GEN and sum(s[1] for s in st.steps) == st.missed
    # the speculation alone reads something else: the correction is what makes the two equal
    _, uncorrected, sess = run_placed(model, Placement(kind, pool_dir=str(tmp_path), correct=False), pol)
    assert not torch.allclose(uncorrected, ref_logits, rtol=0, atol=1e-3)
    assert sess.store.stats.missed == 0 and sess.store.stats.on_demand == 0


def test_corrected_offload_with_an_unlimited_budget_is_dense(tiny_llama, device):
    model = tiny_llama[1].to(device)
    pol = corrected_policy(model, alpha=1e9, max_fetch_ratio=1.0)
    ref_tokens, ref_logits, _ = run_placed(model, Placement("none"), make_policy("full"))
    tokens, logits, sess = run_placed(model, Placement("cpu"), pol)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert sess.store.stats.missed == 0  # the speculation selected everything too


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_on_demand_rows_are_the_own_selection_less_the_prefetched(tiny_llama, kind, tmp_path, device):
    """Per decoding step, counted from what the policy planned (placement's prefetch) and what each layer's
    own query selected: the rows fetched on demand are |own - prefetched| less those the layer's previous step
    missed too (held in fast memory since), and the slow tier (counted at the tier) is read for the prefetched
    rows and those only, never the whole selection again."""
    model = tiny_llama[1].to(device)
    pol = corrected_policy(model)
    tokens, pad = (x.to(device) for x in offload_prompts())
    pl = Placement(kind, pool_dir=str(tmp_path), threaded=False, disk_bulk_share=1.0)
    planned: dict = {}
    want = {"missed": 0, "rows": 0, "held": 0}
    missed_before: dict = {}  # per layer: what its previous step's own selection read beyond its prefetch

    class Own(runtime.Listener):  # what each layer's own selection reads, against what was prefetched
        def on_select(self, layer, rows, keep, s):
            store = s.store
            n = store.length[layer]
            plan, valid = planned.pop(layer), store.valid[layer][:, :, :n]
            if plan is ALL:
                want["rows"] += store.bh * n
                return
            own = keep[:, :, 0, :n] & valid
            prefetched = plan[:, :, :n] & valid
            missed_now = torch.nn.functional.pad(own & ~prefetched, (0, store.capacity - n))
            want["missed"] += int(missed_now.sum())
            want["rows"] += int(prefetched.sum())
            if layer in missed_before:
                want["held"] += int((missed_now & missed_before[layer]).sum())
            missed_before[layer] = missed_now

    sess = pl.new_session(model, B, PROMPT + GEN, pol, listeners=[Own()])
    store = sess.store
    issue = store._issue

    def remember(layer, plan):  # what placement prefetches for `layer`
        planned[layer] = plan
        issue(layer, plan)
    store._issue = remember
    logits = runtime.prefill(model, tokens, sess, pad)
    store.stats.reset()
    read, missed = 0, []
    for _ in range(GEN):
        before = store.stats.missed
        with SlowReads(store) as reads:
            logits = runtime.decode(model, logits.argmax(-1), sess)
        read += reads.bytes
        missed.append(store.stats.missed - before)
    pl.close(sess)
    st = store.stats
    assert st.missed + st.held == want["missed"] > 0 and st.held == want["held"] > 0
    assert [s[1] for s in st.steps] == missed
    assert read == (want["rows"] + st.missed) * 2 * store.layout.row_bytes == st.bytes_moved
    assert all(0 < share < 1 for share in st.missed_shares())


def test_corrected_offload_of_one_unpadded_row_decodes_what_fast_memory_decodes(tiny_llama, device):
    """One unpadded row: the own selection may come packed from the policy (the fused selection of fast
    memory), handed by the store as the prefetched rows and the missed ones."""
    model = tiny_llama[1].to(device)
    pol = corrected_policy(model)
    tokens, _ = offload_prompts()
    prompts = (tokens[1:2], None)
    ref_tokens, ref_logits, _ = run_placed(model, Placement("none"), pol, prompts=prompts)
    tokens, logits, sess = run_placed(model, Placement("cpu"), pol, prompts=prompts)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert sess.store.stats.missed > 0



class HeldVictims(FifoVictims):
    """Victims chosen among the slots a layer's store holds missed rows of (`OffloadedKVStore._held`), oldest
    slot first where it holds none, every choice recorded; or the recorded choices replayed (`replay`), so a store
    in fast memory evicts the same slots."""

    def __init__(self, replay=None):
        self.chosen, self.replay = [], None if replay is None else iter(replay)

    def victims(self, layer, store):
        if self.replay is not None:
            return next(self.replay)
        held = getattr(store, "_held", {}).get(layer)
        if held is None:
            slots = super().victims(layer, store)
        else:
            b, h = store.valid[layer].shape[:2]
            slots = torch.full((b, h), int(held[0][-1]) % store.capacity, dtype=torch.long)
        self.chosen.append(slots)
        return slots


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_corrected_offload_with_victims_decodes_what_fast_memory_decodes(tiny_llama, kind, tmp_path):
    """A pool limit whose victims are slots the store holds missed rows of: the token written there is another
    token than the held copy, which must not be read; the session in fast memory evicts the same slots."""
    model = tiny_llama[1]
    pol = corrected_policy(model, remainder=False)  # (no remainder under a pool limit)
    victims = HeldVictims()
    tokens, logits, sess = run_placed(model, Placement(kind, pool_dir=str(tmp_path)), pol, capacity=PROMPT,
                                      allocator=victims)
    ref_tokens, ref_logits, _ = run_placed(model, Placement("none"), pol, capacity=PROMPT,
                                           allocator=HeldVictims(replay=victims.chosen))
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert sess.store.stats.missed > 0
