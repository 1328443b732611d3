"""An offloaded pool's selection is read by the one attention over packed rows: the rows its store fetched (one
layer ahead) are handed over in a fast buffer with a spare row per KV head for the token, and the fused kernel
reads them there. With the remainder on, the logits are the in-memory store's; a handed buffer that drops a
row or leaves the token's spare row stale changes them (the comparison catches a broken hand-over)."""
from __future__ import annotations

import pytest
import torch

from infinigen.cache import HandedRows
from infinigen.placement import OffloadedKVStore, Placement
from infinigen.policies import make_policy
from support.models import build_tiny
from support.offload import offload_policy, run_placed


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
