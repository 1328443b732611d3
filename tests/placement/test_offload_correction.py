"""Speculation with correction on an offloaded tier (`Placement.correct`, the default): placement prefetches what the
speculation one layer ahead selected, the layer selects again with its own query at its attention over the same
4-bit keys, and the store fetches on demand, in one gather, only the rows of that selection the prefetch missed
(behind a GPU `read_in_place` reads every selection where it lies instead: the tests that count the prefetch say
`read_in_place=False`, so they keep counting it whichever is the default). Checked here: an offloaded session then
decodes what the session in fast memory decodes (its own selection and its remainder), with an unlimited budget the
dense result; the rows fetched on demand are exactly the own selection less the prefetched one, and the slow tier is
read for the prefetch and those rows only."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from infinigen import runtime
from infinigen.placement import Placement
from infinigen.policies import make_policy
from infinigen.selection import ALL

from support.offload import (B, GEN, PROMPT, FifoVictims, SlowReads, corrected_policy, offload_policy,
                             offload_prompts, run_placed)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_corrected_offload_decodes_what_fast_memory_decodes(tiny_llama, kind, tmp_path, device):
    model = tiny_llama[1].to(device)
    pol = corrected_policy(model)
    ref_tokens, ref_logits, _ = run_placed(model, Placement("none"), pol)
    tokens, logits, sess = run_placed(model, Placement(kind, pool_dir=str(tmp_path), read_in_place=False), pol)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    st = sess.store.stats
    # every selecting layer was prefetched and corrected (on demand: only the missed rows), some missed rows
    assert st.fetches == GEN * model.cfg.num_layers and st.on_demand == GEN * (model.cfg.num_layers - 1)
    assert st.missed > 0 and len(st.steps) == GEN and sum(s[1] for s in st.steps) == st.missed
    # the speculation alone reads something else: the correction is what makes the two equal
    speculated = Placement(kind, pool_dir=str(tmp_path), correct=False, read_in_place=False)
    _, uncorrected, sess = run_placed(model, speculated, pol)
    assert not torch.allclose(uncorrected, ref_logits, rtol=0, atol=1e-3)
    assert sess.store.stats.missed == 0 and sess.store.stats.on_demand == 0


def test_corrected_offload_with_an_unlimited_budget_is_dense(tiny_llama, device):
    model = tiny_llama[1].to(device)
    pol = corrected_policy(model, alpha=1e9, max_fetch_ratio=1.0)
    ref_tokens, ref_logits, _ = run_placed(model, Placement("none"), make_policy("full"))
    tokens, logits, sess = run_placed(model, Placement("cpu", read_in_place=False), pol)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert sess.store.stats.missed == 0  # the speculation selected everything too


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_on_demand_rows_are_the_own_selection_less_the_prefetched(tiny_llama, kind, tmp_path, device):
    """Per decoding step, counted from what the policy planned (placement's prefetch) and what each layer's
    own query selected: the rows fetched on demand are |own - prefetched| less those the layer's last `hold_steps`
    steps missed too (held in fast memory since; no cap here), and the slow tier (counted at the tier) is read for
    the prefetched rows and those only, never the whole selection again."""
    model = tiny_llama[1].to(device)
    pol = corrected_policy(model)
    tokens, pad = (x.to(device) for x in offload_prompts())
    pl = Placement(kind, pool_dir=str(tmp_path), threaded=False, disk_bulk_share=1.0, read_in_place=False)
    planned: dict = {}
    want = {"missed": 0, "rows": 0, "held": 0}
    missed_at: dict = {}  # per layer and slot: the last step whose own selection read it beyond its prefetch

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
            step = store._step
            last = missed_at.setdefault(layer, torch.full_like(missed_now, -10**6, dtype=torch.long))
            want["held"] += int((missed_now & (last >= step - store.hold_steps)).sum())
            last[missed_now] = step

    sess = pl.new_session(model, B, PROMPT + GEN, pol, listeners=[Own()])
    store = sess.store
    store.corrects_on_device = False  # behind a GPU too: the host fetches (and holds) what the prefetch missed
    store.hold_share = 1.0  # every recent miss held (the cap: `test_held_rows_stay_under_their_cap`)
    assert store.hold_steps > 1
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
    tokens, logits, sess = run_placed(model, Placement("cpu", read_in_place=False), pol, prompts=prompts)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert sess.store.stats.missed > 0



def test_a_correction_on_the_gpu_reads_the_rows_the_host_would_hand(tiny_llama):
    """Behind a GPU a corrected selection stays there (`_select_on_device`, `_corrected_on_device`): packed to a
    fixed width without counting, its prefetched entries read from the fast buffer and the others from the pool
    where it lies (`HandedRows.far`). Run here on the CPU's tensors beside the host path at every corrected layer
    of a decode: each selected entry reads the same key and value row, in the same order, the spare rows follow
    the prefetched ones, and the rows it reads from the pool are those the host path fetches (or holds)."""
    model = tiny_llama[1]
    pol = corrected_policy(model)
    tokens, pad = offload_prompts()
    pl = Placement("cpu", threaded=False)
    sess = pl.new_session(model, B, PROMPT + GEN, pol)
    store = sess.store
    host_corrected, checked = store._corrected, []

    def both(layer, job, sel, buffer):
        handed = host_corrected(layer, job, sel, buffer)
        real = sel.head >= 0
        want_k, want_v = handed.keys[handed.rows[real]], handed.values[handed.rows[real]]
        counted = []
        store.stats.fetched_later = lambda rows, row_bytes, seconds: counted.append(rows.tolist())
        dev_sel = store._select_on_device(sel.keep, torch.ones_like(sel.keep))
        assert torch.equal(dev_sel.counts, sel.counts) and int(dev_sel.read) == int(sel.counts.sum())
        def fresh(n, like):  # a buffer of the step's: nothing in it before the store writes
            return torch.full((n, like.shape[1]), float("nan")), torch.full((n, like.shape[1]), float("nan"))
        dev = store._corrected_on_device(layer, job, dev_sel, fresh)
        del store.stats.fetched_later
        far_k, far_v, split = dev.far
        assert split == dev.keys.shape[0] == job.selected + store.bh
        assert torch.equal(dev.own, job.selected + torch.arange(store.bh).view(store.batch, store.kv_heads))
        both_k, both_v = torch.cat([dev.keys, far_k]), torch.cat([dev.values, far_v])
        at = dev.rows[dev_sel.head >= 0]
        assert torch.equal(both_k[at], want_k) and torch.equal(both_v[at], want_v)
        from_pool = int(real.sum()) - int((handed.rows[real] < job.selected).sum())  # the host's fetched or held
        differs = not torch.equal(sel.keep, job.selection.keep)  # (the host path runs only where they differ)
        assert differs and counted == [[int((at >= split).sum()), 1]] and from_pool == counted[0][0]
        # read in place (`Placement.read_in_place`): every entry from the pool, only the spare rows in the buffer
        store.stats.fetched_later = lambda rows, row_bytes, seconds, missed: counted.append(
            (rows.tolist(), missed))
        store._spare_like = torch.empty(0, store.head_dim)
        here = store._read_in_place(layer, dev_sel, fresh)
        del store.stats.fetched_later
        far_k, far_v, split = here.far
        assert split == here.keys.shape[0] == store.bh and torch.equal(here.own.reshape(-1), torch.arange(store.bh))
        at = here.rows[dev_sel.head >= 0]
        assert bool((at >= split).all())
        assert torch.equal(far_k[at - split], want_k) and torch.equal(far_v[at - split], want_v)
        assert counted[-1] == ([int(real.sum()), 1], False)
        checked.append(layer)
        return handed
    store._corrected = both
    logits = runtime.prefill(model, tokens, sess, pad)
    for _ in range(GEN):
        logits = runtime.decode(model, logits.argmax(-1), sess)
    pl.close(sess)
    assert len(checked) == GEN * (model.cfg.num_layers - 1)
    assert store.stats.missed > 0


@pytest.mark.parametrize("correct", [False, True], ids=["speculated", "corrected"])
def test_read_in_place_decodes_what_the_prefetch_decodes(tiny_llama, correct, device):
    """`Placement.read_in_place` (behind a GPU): no selection is prefetched; the attention reads each selection's
    rows from the pinned pool where they lie. It decodes what the prefetching form decodes: the speculated
    selection as prefetched, or corrected by each layer's own query as in fast memory."""
    if device.type != "cuda":
        pytest.skip("the GPU reads pinned host memory over the bus (the index logic on a CPU: the test above)")
    model = tiny_llama[1].to(device)
    pol = corrected_policy(model)
    ref = Placement("cpu" if not correct else "none", correct=correct, read_in_place=False)
    ref_tokens, ref_logits, _ = run_placed(model, ref, pol)
    tokens, logits, sess = run_placed(model, Placement("cpu", correct=correct, read_in_place=True), pol)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    st, layers = sess.store.stats, model.cfg.num_layers
    assert sess.store.reads_in_place and st.missed == 0 and st.on_demand == 0
    # each step: layer 0 (dense) prefetched whole and read from there, every other layer's selection read in place
    assert st.fetches == GEN * layers and st.stale == 0 and st.rows_moved > 0


@pytest.mark.parametrize("policy", ["full", "h2o", "streaming", "planned-random", "infinigen"])
def test_reading_in_place_decodes_what_fast_memory_decodes_for_every_policy(tiny_llama, policy, device):
    """Read in place behind a GPU (a plain pinned pool, no limit), whatever the policy's selection: the tokens and
    logits of the KV in GPU memory, nothing fetched on demand or wasted."""
    if device.type != "cuda":
        pytest.skip("the GPU reads pinned host memory over the bus")
    model = tiny_llama[1].to(device)
    ref_tokens, ref_logits, _ = run_placed(model, Placement("none"), offload_policy(policy, model))
    tokens, logits, sess = run_placed(model, Placement("cpu", read_in_place=True), offload_policy(policy, model))
    assert sess.store._in_place()
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert sess.store.stats.on_demand == 0 and sess.store.stats.stale == 0


def test_reading_in_place_applies_only_behind_a_gpu_without_a_pool_limit(tiny_llama, monkeypatch):
    """`Placement.read_in_place` asked for is off in effect where the GPU cannot read the pool where it lies (a CPU
    host), and under a pool limit (whose victims the prefetch's pace keeps apart from the reads) even where it can
    (here a readable pool pretended on the CPU: the rule, not the reads)."""
    model = tiny_llama[1]
    opened = {}
    for limit in (None, PROMPT):
        pl = Placement("cpu", capacity=limit, read_in_place=True)
        opened[limit] = (pl, pl.new_session(model, B, PROMPT + GEN, corrected_policy(model)))
    for pl, sess in opened.values():
        assert sess.store.reads_in_place and not sess.store._in_place()  # a CPU host
    monkeypatch.setattr(type(opened[None][1].store), "_pool_readable", lambda self: True)
    assert opened[None][1].store._in_place() and not opened[PROMPT][1].store._in_place()
    for pl, sess in opened.values():
        pl.close(sess)


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


def _check_held(store) -> int:
    """Every layer's held rows: ascending, added at one of the last `hold_steps` steps, and copies of what the pool
    holds in those rows now (never a token a victim's slot no longer holds). Returns their count."""
    total = 0
    for layer, (rows, keys, values, last) in store._held.items():
        assert torch.equal(rows, rows.sort().values) and rows.numel() == rows.unique().numel()
        assert bool((last > store._step - store.hold_steps).all())
        k, v = torch.empty_like(keys), torch.empty_like(values)
        store._gather_rows(layer, store._slow_rows(rows), k, v)
        assert torch.equal(k, keys) and torch.equal(v, values)
        total += rows.numel()
    return total


@pytest.mark.parametrize("victims,share", [(False, 0.03), (True, 0.15)])
def test_held_rows_are_the_pools_under_their_cap(tiny_llama, victims, share):
    """The rows held for the next steps, checked after every step: none older than `hold_steps` steps, each a copy
    of the pool's row (with victims chosen among the held rows' slots: the held copy of a slot a new token took is
    gone), and as they are held never more than `hold_share` of the layer's used rows (a small share: the cap is
    reached); the tokens are fast memory's."""
    model = tiny_llama[1]
    pol = corrected_policy(model, remainder=False)  # (no remainder under a pool limit)
    chooser = HeldVictims() if victims else None
    capacity = PROMPT if victims else None
    pl = dataclasses.replace(Placement("cpu", threaded=False), capacity=capacity)
    tokens, pad = offload_prompts()
    sess = pl.new_session(model, B, PROMPT + GEN, pol, allocator=chooser)
    store = sess.store
    store.hold_steps, store.hold_share = 3, share
    hold, capped = store._hold, []

    def held_under_cap(layer, want, data, rows_each=1):
        hold(layer, want, data, rows_each)
        n = store._held[layer][0].numel() if layer in store._held else 0
        limit = int(share * store.length[layer] * store.bh)
        assert n <= limit
        capped.append(n == limit)
    store._hold = held_under_cap
    logits = runtime.prefill(model, tokens, sess, pad)
    out, held = [], 0
    for _ in range(GEN):
        t = logits.argmax(-1)
        out.append(t)
        logits = runtime.decode(model, t, sess)
        held += _check_held(store)
    pl.close(sess)
    assert held > 0 and (any(capped) if not victims else store.stats.held > 0)
    replay = HeldVictims(replay=chooser.chosen) if victims else None
    ref_tokens, _, _ = run_placed(model, Placement("none"), pol, capacity=capacity, allocator=replay)
    assert torch.equal(torch.stack(out, 1), ref_tokens)


def _decoded_on_cpu_tier(model, pol, **store_settings):
    """(placement, session, tokens [B, GEN]): the offload prompts prefilled on the cpu tier with these store
    settings, then GEN greedy steps counted from a clean slate (the session still open)."""
    pl = Placement("cpu", threaded=False)
    tokens, pad = offload_prompts()
    sess = pl.new_session(model, B, PROMPT + GEN, pol)
    for name, value in store_settings.items():
        setattr(sess.store, name, value)
    logits = runtime.prefill(model, tokens, sess, pad)
    sess.store.stats.reset()
    sess.store.stats.steps.clear()
    out = []
    for _ in range(GEN):
        out.append(logits.argmax(-1))
        logits = runtime.decode(model, out[-1], sess)
    return pl, sess, torch.stack(out, 1)


def test_holding_recent_misses_serves_more_of_them(tiny_llama):
    """Held over several steps (`hold_steps`) the rows the prefetch misses are served from fast memory more often
    than held for one step: fewer rows fetched on demand, the same tokens, the same rows missed."""
    model = tiny_llama[1]
    pol = corrected_policy(model)
    counts = {}
    for steps in (1, 4):
        pl, sess, tokens = _decoded_on_cpu_tier(model, pol, hold_steps=steps, hold_share=1.0)
        st = sess.store.stats
        counts[steps] = (st.missed, st.held, tokens)
        pl.close(sess)
    (m1, h1, t1), (m4, h4, t4) = counts[1], counts[4]
    assert torch.equal(t1, t4) and m1 + h1 == m4 + h4
    assert h4 > h1 > 0 and m4 < m1


def test_a_layer_holding_nothing_prefetches_a_wider_speculation(tiny_llama):
    """`first_margin`: a corrected layer that holds none of its recent misses (its first step) prefetches the
    speculation at that factor on its cap, so fewer of its own picks are fetched on demand; later steps (rows
    held) prefetch the plain speculation; the tokens are fast memory's."""
    model = tiny_llama[1]
    pol = corrected_policy(model)
    per = {}
    for margin in (1.0, 1.5):
        pl, sess, tokens = _decoded_on_cpu_tier(model, pol, first_margin=margin)
        per[margin] = ([s[:2] for s in sess.store.stats.steps], tokens)
        store = sess.store  # later steps: the margin only where the layer holds nothing
        assert store._held and all(store.prefetch_margin(layer) == (1.0 if layer in store._held else margin)
                                   for layer in range(1, model.cfg.num_layers))
        pl.close(sess)
    (plain, t1), (wide, t2) = per[1.0], per[1.5]
    assert torch.equal(t1, t2)
    assert wide[0][0] > plain[0][0] and wide[0][1] < plain[0][1]  # step 1: more prefetched, fewer on demand
