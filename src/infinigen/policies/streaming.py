"""StreamingLLM: attention sinks (the first tokens) plus a window of the most recent tokens.

Chosen by token position (`store.pos`), so a pool that reorders slots changes nothing. The budget is
`sinks + window` tokens, or, with `ratio`, that fraction of the current length (sinks first, the rest
recent), which is how it is matched to another method's relative KV size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UserError
from .base import Policy


@dataclass(frozen=True)
class StreamingLLM(Policy):
    name = "streaming"
    needs_query = False  # positions alone decide: known a layer ahead
    sinks: int = 4
    window: int = 252
    ratio: float | None = None  # if set: keep floor(ratio * past) tokens, up to `sinks` of them sinks

    def validate(self):
        if self.sinks < 0 or self.window < 0:
            raise UserError(f"StreamingLLM sinks and window must be >= 0, got {self.sinks} and {self.window}")
        if self.ratio is not None and not 0 <= self.ratio <= 1:
            raise UserError(f"StreamingLLM ratio must be in [0, 1], got {self.ratio}")

    def _keep(self, pos: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
        """Which entries at positions pos [..., S] a token at position cur [..., 1] reads (cur is also
        the number of tokens before it: rows are unpadded or positions count real tokens only)."""
        if self.ratio is None:
            return (pos < self.sinks) | (pos >= cur - self.window)
        budget = (self.ratio * cur.double()).floor().long()
        sinks = budget.clamp(max=self.sinks)
        return (pos < sinks) | (pos >= cur - (budget - sinks))

    def keep(self, layer, rows, session):
        cur = rows.positions[:, None, :, None]  # [B, 1, R, 1]
        return self._keep(rows.entry_pos[..., None, :], cur) & rows.valid
