"""A layer behind a sliding window (Gemma 3's local layers) on an offloaded tier fetches only the slots its window
shows, not its whole used layer: on the disk tier in blocks exactly the units the window lies in (a window of 8
over blocks of 3, so a window's edges cut blocks), on the cpu tier exactly the window's rows; the tokens and
logits stay those of the store in memory, with a left-padded batch row and with victims."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from infinigen import runtime
from infinigen.placement import BlockedKVStore, Placement
from infinigen.policies import make_policy
from support.models import WINDOW, build_gemma

PROMPT, GEN, BLOCK = 21, 10, 3  # both longer than the window (8); blocks of 3 do not divide it


@pytest.fixture(scope="module")
def gemma():
    return build_gemma()[1]


def _policy(name, model):
    if name == "full":
        return make_policy("full")
    c = model.cfg  # random orthogonal skew; the same query on every tier
    g = torch.Generator().manual_seed(3)
    skew = torch.linalg.qr(torch.randn(c.num_layers, c.num_kv_heads, c.head_dim, c.head_dim, generator=g,
                                       dtype=torch.float64))[0]
    pol = make_policy("infinigen", dense_layers=(), alpha=1.0)
    return dataclasses.replace(pol, query="ahead").with_skew(skew)


def _decode(model, placement, policy, tokens, pad=None, capacity=None, per_step=None):
    """Greedy decoding after the prompt: (tokens [B, GEN], logits [B, GEN, V], the session, kept open);
    `per_step(store)` after every step."""
    placement = dataclasses.replace(placement, capacity=capacity)
    sess = placement.new_session(model, tokens.shape[0], tokens.shape[1] + GEN, policy)
    logits = runtime.prefill(model, tokens, sess, pad)
    out, steps = [], []
    for _ in range(GEN):
        t = logits.argmax(-1)
        out.append(t)
        if per_step is not None:
            per_step(sess.store, before=True)
        logits = runtime.decode(model, t, sess)
        steps.append(logits)
        if per_step is not None:
            per_step(sess.store, before=False)
    return torch.stack(out, 1), torch.stack(steps, 1), sess


def _prompts(batch):
    tokens = torch.randint(3, 256, (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    pad = torch.ones(batch, PROMPT, dtype=torch.bool)
    if batch > 1:
        pad[1, :4] = False  # a shorter, left-padded row
    return tokens, pad


PLACEMENTS = {"cpu": dict(kv_offload="cpu"), "disk": dict(kv_offload="disk"),
              "disk-blocks": dict(kv_offload="disk", disk_block=BLOCK),
              "disk-blocks-16": dict(kv_offload="disk", disk_block=16)}


@pytest.mark.parametrize("where", list(PLACEMENTS))
@pytest.mark.parametrize("policy", ["full", "infinigen"])
@pytest.mark.parametrize("capacity", [None, PROMPT + 4])
def test_windowed_layers_offloaded_equal_memory(gemma, where, policy, capacity, tmp_path):
    """Tokens equal and logits within float32 rounding of the in-memory store's, a left-padded row in the batch;
    with a pool limit the victims' slots are anywhere, and the window is taken from their positions."""
    tokens, pad = _prompts(2)
    ref_tokens, ref_logits, ref = _decode(gemma, Placement(), _policy(policy, gemma), tokens, pad, capacity)
    pl = Placement(pool_dir=str(tmp_path), **PLACEMENTS[where])
    got_tokens, got_logits, sess = _decode(gemma, pl, _policy(policy, gemma), tokens, pad, capacity)
    stats = sess.store.stats
    pl.close(sess)
    assert torch.equal(got_tokens, ref_tokens)
    assert (got_logits - ref_logits).abs().max() <= 1e-5
    assert stats.on_demand == 0 and stats.stale == 0  # every layer's rows were fetched ahead, as planned


def _window_slots(n: int) -> range:
    """The used slots a decoding token at position n sees behind the window (no padding, no victims)."""
    return range(max(0, n - WINDOW + 1), n)


@pytest.mark.parametrize("policy", ["full", "infinigen"])
def test_disk_blocks_read_only_the_window_units(gemma, policy, tmp_path):
    """Per decoding step, the units read from the file are, on each local layer, exactly those its window's
    slots lie in (less the open block, in memory), and on the global layer what its selection names: with the
    full cache every closed unit. Counted by the store's reads (its `blocks` counter) step by step."""
    tokens, _ = _prompts(1)
    model = gemma
    local = [layer for layer in range(model.cfg.num_layers) if model.cfg.local(layer)]
    seen = {"read": [], "want": []}

    def per_step(store, before):
        if before:
            seen["at"] = store.stats.blocks
            n = store.length[0]
            open_block = n // BLOCK
            window = {s // BLOCK for s in _window_slots(n)} - {open_block}
            seen["want"].append(len(local) * len(window))
            seen["closed"] = open_block  # the global layer's closed units (every one, with the full cache)
        else:
            seen["read"].append(store.stats.blocks - seen["at"])

    pl = Placement("disk", pool_dir=str(tmp_path), disk_block=BLOCK)
    _, _, sess = _decode(model, pl, _policy(policy, model), tokens, per_step=per_step)
    assert isinstance(sess.store, BlockedKVStore)
    pl.close(sess)
    global_layers = model.cfg.num_layers - len(local)
    if policy == "full":
        want = [w + global_layers * (PROMPT + i) // BLOCK for i, w in enumerate(seen["want"])]
        assert seen["read"] == want
    else:  # the global layer reads at most its closed units
        for i, (read, w) in enumerate(zip(seen["read"], seen["want"])):
            assert w <= read <= w + global_layers * (PROMPT + i) // BLOCK
    # and far less than every layer read whole
    whole = sum(model.cfg.num_layers * -(-(PROMPT + i) // BLOCK) for i in range(GEN))
    assert sum(seen["read"]) < whole / 2


def test_cpu_tier_fetches_only_the_window_rows(gemma):
    """On the cpu tier a local layer's fetch is its window's rows (WINDOW - 1 past slots), the global layer's
    (full cache) every used slot: counted by the rows the store moved each step."""
    tokens, _ = _prompts(1)
    model = gemma
    local = sum(model.cfg.local(layer) for layer in range(model.cfg.num_layers))
    moved = []

    def per_step(store, before):
        if before:
            moved.append(-store.stats.rows_moved)
        else:
            moved[-1] += store.stats.rows_moved

    pl = Placement("cpu")
    _, _, sess = _decode(model, pl, _policy("full", model), tokens, per_step=per_step)
    pl.close(sess)
    global_layers = model.cfg.num_layers - local
    assert moved == [local * (WINDOW - 1) + global_layers * (PROMPT + i) for i in range(GEN)]
