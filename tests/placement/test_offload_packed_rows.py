"""An offloaded pool's selection is read by the one attention over packed rows: the rows its store fetched (one
layer ahead) are handed over in a fast buffer with a spare row per KV head for the token, and the fused kernel
reads them there. With the remainder on, the logits are the in-memory store's; a handed buffer that drops a
row or leaves the token's spare row stale changes them (the comparison catches a broken hand-over)."""
from __future__ import annotations

import pytest
import torch

from infinigen import runtime
from infinigen.cache import HandedRows, KVStore
from infinigen.placement import OffloadedKVStore, Placement
from infinigen.policies import make_policy
from support.models import build_tiny
from support.padded_reference import padded_reference
from support.offload import PROMPT, FifoVictims, offload_policy, offload_prompts, run_placed


@pytest.fixture(scope="module")
def model():
    return build_tiny("llama")[1]


def _policy(model):
    """InfiniGen reading about half of each step's rows, with the remainder mixed in (random skew matrices)."""
    mats = offload_policy("infinigen", model).matrices
    return make_policy("infinigen", preset="flat", dense_layers=(0,), min_fetch=0, remainder=True,
                       max_fetch_ratio=0.5).with_skew(mats)


def _dropped_row(handed: HandedRows, sel) -> HandedRows:
    """Batch row 0's last selected row read as its first one instead."""
    rows = handed.rows.clone()
    n = int(sel.counts[0].sum())
    if n > 1:
        rows[0, n - 1] = rows[0, 0]
    return handed._replace(rows=rows)


def _stale_own(handed: HandedRows, sel) -> HandedRows:
    """The token's spare rows point at a past row: the token is never read."""
    return handed._replace(own=torch.zeros_like(handed.own))


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_offloaded_selection_reads_the_in_memory_rows(model, kind, tmp_path, monkeypatch):
    ref_tokens, ref_logits, _ = run_placed(model, Placement("none"), _policy(model))
    calls = []
    inner = OffloadedKVStore.hand_rows

    def counted(self, layer, sel, *a, **kw):
        calls.append(layer)
        return inner(self, layer, sel, *a, **kw)
    monkeypatch.setattr(OffloadedKVStore, "hand_rows", counted)
    tokens, logits, sess = run_placed(model, Placement(kind, pool_dir=str(tmp_path)), _policy(model))
    assert len(calls) == ref_logits.shape[1] * model.cfg.num_layers  # every layer of every step, packed
    assert sess.store.stats.on_demand == 0  # each the rows fetched one layer ahead
    assert torch.equal(tokens, ref_tokens)
    assert (logits - ref_logits).abs().max() <= 1e-5
    read = sess.stats.overall()
    assert 0 < read < 1  # a real subset was read


@pytest.mark.parametrize("fault", [_dropped_row, _stale_own], ids=["dropped-row", "stale-own-row"])
def test_a_broken_hand_over_changes_the_logits(model, fault, tmp_path, monkeypatch):
    _, ref_logits, _ = run_placed(model, Placement("none"), _policy(model))
    inner = OffloadedKVStore.hand_rows

    def broken(self, layer, sel, *a, **kw):
        handed = inner(self, layer, sel, *a, **kw)
        return fault(handed, sel) if layer > 0 else handed
    monkeypatch.setattr(OffloadedKVStore, "hand_rows", broken)
    _, logits, _ = run_placed(model, Placement("cpu"), _policy(model))
    assert (logits - ref_logits).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["int4", "pool-limit", "h2o-pool-limit"])
def test_stores_not_read_in_place_equal_the_reference(model, case, monkeypatch):
    """In fast memory, a store the attention cannot read in place (INT4-coded values; a pool limit whose victims
    the token may overwrite) hands its rows over (`KVStore.hand_rows`) and stores the token after the attention:
    the logits equal the padded reference path's (`read_rows` False) and the tokens are the same."""
    policy = {"int4": "int4", "pool-limit": "planned-random", "h2o-pool-limit": "h2o"}[case]
    limited = case != "int4"

    def run(read_rows):
        tokens, pad = offload_prompts()
        pl = Placement("none", capacity=PROMPT + 4 if limited else None)
        sess = pl.new_session(model, tokens.shape[0], PROMPT + 10, offload_policy(policy, model),
                              allocator=FifoVictims() if limited else None)
        assert not sess.store.reads_rows()
        if not read_rows:
            padded_reference(sess)
        logits, out = runtime.prefill(model, tokens, sess, pad), []
        for _ in range(10):
            logits = runtime.decode(model, logits.argmax(-1), sess)
            out.append(logits)
        return torch.stack(out, 1)

    ref = run(False)
    handed = []
    inner = KVStore.hand_rows
    monkeypatch.setattr(KVStore, "hand_rows", lambda self, *a, **kw: handed.append(1) or inner(self, *a, **kw))
    got = run(True)
    assert handed  # the packed path ran
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (got - ref).abs().max() <= 1e-5
