"""InfiniGen below its crossing reads every cached entry, so its decoding step is the full cache's: the same
logits, and no more operator calls than the full cache's step plus the few that decide, once per step, that
no row has reached the crossing (the step's fewest and most cached tokens, read to the host)."""
from __future__ import annotations

import pytest
import torch
from infinigen.bench.dispatch import DispatchedCalls

from infinigen import compiled, runtime
from infinigen.placement import Placement
from infinigen.policies import make_policy
from support.models import build_tiny
from support.speculation import random_skew

P, T = 10, 20
# aten calls a dense InfiniGen step may add, once per step: the positions' min and max and their read to the host
DECIDING = 6


pytestmark = pytest.mark.usefixtures("private_inductor_cache")


@pytest.fixture(scope="module")
def model():
    return build_tiny("llama")[1]


def _policy(name, model):
    if name == "infinigen":  # the default's knobs, every layer selecting, its crossing beyond the test's lengths
        return make_policy("infinigen", dense_layers=(), dense_below=1000).with_skew(random_skew(model))
    return make_policy("full")


def _steps(model, policy, tokens, parts) -> tuple[torch.Tensor, list[int]]:
    """Teacher-fed decoding after a P-token prompt: every step's logits and aten calls."""
    model.step_parts = parts
    try:
        sess = Placement().new_session(model, tokens.shape[0], T, policy)
        logits = [runtime.prefill(model, tokens[:, :P], sess)]
        calls = []
        for t in range(P, T - 1):
            with DispatchedCalls() as counter:
                logits.append(runtime.decode(model, tokens[:, t], sess))
            calls.append(counter.calls)
        return torch.stack(logits, 1), calls
    finally:
        model.step_parts = None


@pytest.mark.parametrize("mode", ["whole", "eager"])
@pytest.mark.parametrize("batch", [1, 2])
def test_infinigen_below_its_crossing_runs_the_full_cache_step(model, mode, batch):
    tokens = torch.randint(3, model.cfg.vocab_size, (batch, T), generator=torch.Generator().manual_seed(batch))
    runs = {}
    for name in ("full", "infinigen"):
        parts = compiled.StepParts() if mode == "whole" else None
        runs[name] = _steps(model, _policy(name, model), tokens, parts)
        if parts is not None:
            assert parts.failed is None
            assert any(key[0] == "attend_leave" for key in parts._parts)  # the whole step ran
    torch.testing.assert_close(runs["infinigen"][0], runs["full"][0], atol=0, rtol=0)
    full_calls, infinigen_calls = runs["full"][1], runs["infinigen"][1]
    # the first step compiles the parts (whole): compared from the second
    assert all(i <= f + DECIDING for f, i in zip(full_calls[1:], infinigen_calls[1:])), (full_calls, infinigen_calls)
