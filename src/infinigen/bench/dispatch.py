"""A count of the aten operators a piece of code dispatches from Python (what a decoding step calls, not what
those call inside a compiled graph or a kernel): the benchmarks' "aten calls per step" and the tests that bound it."""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class DispatchedCalls(TorchDispatchMode):
    """While active: `calls`, the operators dispatched (`by_op`: how many of each); `on_watched`, the names of those
    given a tensor that shares storage with one of `watched`."""

    def __init__(self, watched=()):
        super().__init__()
        self.calls = 0
        self.by_op: Counter = Counter()
        self.on_watched: list[str] = []
        self._storages = {t.untyped_storage().data_ptr() for t in watched}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        self.by_op[str(func)] += 1
        if self._storages and any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self._storages
                                  for a in [*args, *(kwargs or {}).values()]):
            self.on_watched.append(str(func))
        return func(*args, **(kwargs or {}))
