"""The serving tests' shared steps: random prompts, an engine stepped until it is idle, the process's heap."""
from __future__ import annotations

import pytest
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


def anon_bytes() -> int:
    """This process's anonymous resident memory (RssAnon: heap and tensors, not the page cache of files)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no RssAnon in /proc/self/status")
