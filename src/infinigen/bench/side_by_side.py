"""Systems timed side by side in one process: the same staggered prompts for each, their decoding steps
interleaved A B C ... C B A so that a shared CPU's load falls on each alike (the benchmarks/ scripts)."""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from .. import runtime
from ..paths import load_text

STRIDE = 97  # consecutive rows start this many tokens apart: different prompts of one length


def parse_cells(spec: str) -> list[tuple[int, int]]:
    """"512x1,4096x4" -> [(512, 1), (4096, 4)]: (prompt length, batch) of each cell."""
    cells = []
    for cell in spec.split(","):
        length, batch = (int(part) for part in cell.strip().split("x"))
        cells.append((length, batch))
    return cells


def text_ids(tokenizer, text: str = "prideprejudice") -> torch.Tensor:
    """The token ids of a text file or bundled corpus name, 1-D."""
    return tokenizer(load_text(text), return_tensors="pt").input_ids[0]


def staggered_prompts(ids: torch.Tensor, length: int, batch: int) -> torch.Tensor:
    """[batch, length] prompts: row i is ids[STRIDE * i : STRIDE * i + length]."""
    need = STRIDE * (batch - 1) + length
    if len(ids) < need:
        raise ValueError(f"{batch} prompts of {length} tokens, {STRIDE} apart, need {need} tokens; the text has "
                         f"{len(ids)}")
    return torch.stack([ids[i * STRIDE:i * STRIDE + length] for i in range(batch)])


def interleaved_decode(model, first: torch.Tensor, sessions: Sequence, steps: int,
                       clock: Callable[[], float] = time.perf_counter,
                       before: Callable[[int], None] | None = None):
    """`steps` greedy decoding steps of every session from the same `first` tokens, the sessions taken in turn
    A B C on even steps and C B A on odd ones. `before(i)` runs ahead of each of session i's steps, outside
    the clock. Returns (ms of each step per session, the tokens each generated per step, each session's
    last tokens)."""
    last = [first] * len(sessions)
    times: list[list[float]] = [[] for _ in sessions]
    generated: list[list] = [[] for _ in sessions]
    with torch.inference_mode():
        for step in range(steps):
            for i in list(range(len(sessions)))[::-1 if step % 2 else 1]:
                if before is not None:
                    before(i)
                t0 = clock()
                out = runtime.decode(model, last[i], sessions[i])
                times[i].append((clock() - t0) * 1e3)
                last[i] = out.argmax(-1)
                generated[i].append(last[i].tolist())
    return times, generated, last


def per_block_breakdown(model, session, last: torch.Tensor, steps: int):
    """`steps` more instrumented greedy steps of `session` from `last`: (ms per block of a step, the last
    tokens)."""
    from ..placement.timing import Breakdown
    with Breakdown(model, session) as breakdown:
        for _ in range(steps):
            last = breakdown.step(last).argmax(-1)
    return breakdown.summary()["per_block_ms"], last
