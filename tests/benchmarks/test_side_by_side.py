"""What the side-by-side benchmark scripts share (`bench.side_by_side`): prompts staggered through one text, and
decoding steps interleaved between systems without one system's tokens reaching another."""
from __future__ import annotations

import pytest
import torch

from infinigen.bench.side_by_side import (STRIDE, interleaved_decode, parse_cells, per_block_breakdown,
                                          staggered_prompts)
from infinigen.eval.fanout import prefill_shared
from infinigen.placement import Placement
from infinigen.policies import make_policy


def test_cells_parse_as_prompt_length_by_batch():
    assert parse_cells("512x1, 4096x4") == [(512, 1), (4096, 4)]


def test_each_prompt_starts_a_stride_after_the_one_before():
    ids = torch.arange(1000)
    prompts = staggered_prompts(ids, 40, 3)
    assert prompts.shape == (3, 40)
    assert [int(row[0]) for row in prompts] == [0, STRIDE, 2 * STRIDE]
    assert torch.equal(prompts[2], ids[2 * STRIDE:2 * STRIDE + 40])


def test_a_text_too_short_for_the_prompts_is_refused():
    with pytest.raises(ValueError, match="need"):
        staggered_prompts(torch.arange(100), 40, 2)


def _alone(model, tokens, policy, steps):
    """Greedy tokens of `policy` decoding `tokens` by itself."""
    from infinigen import runtime
    session = Placement().new_session(model, tokens.shape[0], tokens.shape[1] + steps + 1, policy)
    last = runtime.prefill(model, tokens, session).argmax(-1)
    out = []
    for _ in range(steps):
        last = runtime.decode(model, last, session).argmax(-1)
        out.append(last.tolist())
    return out


def _systems():
    """Three systems that decode differently: the full cache and two short sliding windows."""
    return [make_policy("full"), make_policy("streaming", sinks=1, window=3), make_policy("streaming", sinks=0,
                                                                                          window=2)]


def test_interleaved_sessions_alternate_their_order_and_decode_as_they_would_alone(make_tiny):
    _, model = make_tiny("llama")
    tokens = staggered_prompts(torch.arange(3, 250), 24, 2)
    steps = 6
    logits, sessions = prefill_shared(model, tokens, _systems(), 24 + steps + 4)
    order = []
    times, generated, last = interleaved_decode(model, logits.argmax(-1), sessions, steps, before=order.append)
    assert order == [0, 1, 2, 2, 1, 0] * (steps // 2)
    assert [len(t) for t in times] == [steps] * 3 and all(ms >= 0 for t in times for ms in t)
    alone = [_alone(model, tokens, policy, steps) for policy in _systems()]
    assert alone[0] != alone[1] or alone[0] != alone[2]  # the systems differ, so a mix-up would show
    assert generated == alone
    assert [x.tolist() for x in last] == [a[-1] for a in alone]

    per_block, after = per_block_breakdown(model, sessions[0], last[0], 2)
    assert per_block and after.shape == last[0].shape
