"""The serving tests' shared steps: random prompts, and an engine stepped until it is idle."""
from __future__ import annotations

import torch


def random_prompts(vocab: int, lengths, seed: int = 5) -> list[list[int]]:
    """One prompt of random token ids (3 and above: clear of the special ids) per length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def run_until_idle(eng, limit: int = 10_000) -> None:
    """Step the engine until it has nothing left to do (at most `limit` steps)."""
    for _ in range(limit):
        if eng.idle():
            return
        eng.step()
    raise AssertionError("the engine did not finish")
