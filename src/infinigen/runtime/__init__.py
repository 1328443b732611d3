"""The decoding step: sessions, and the three passes a model runs over them.

    prefill(model, tokens, session)          the prompt, dense causal attention, keys/values to the store
    decode(model, tokens, sessions)          one new token per row, for one session or many at once (the
                                             server's batch, a fan-out): each layer reads what the
                                             session's policy keeps, in one batched attention call
    teacher_forced(model, tokens, p, session)
                                             a whole sequence, every position after the first p as if
                                             decoded one token at a time with the session's policy
                                             (perplexity, log-likelihood scoring)

The network (`infinigen.model`) runs the blocks; a block asks `attend(layer, q, k, v)` for its attention
and tells `event(layer, point, x)` that a hidden state is ready. A `Session` answers both for one batch of
requests: its policy's selection, its KV store, its listeners and its cursor (which tokens are being
processed). `Session.attend` is the one entry point of attention on every path, `infinigen.hf` included.
"""
from __future__ import annotations

from ..selection import ALL, Rows
from .attention import attend_all, attend_masked, attend_rows, attend_visible
from .passes import decode, prefill, prefill_in_slices, teacher_forced
from .session import Listener, Session
from .stats import KVStats

__all__ = ["Session", "Listener", "KVStats", "prefill", "prefill_in_slices", "decode", "teacher_forced", "attend_all",
           "attend_masked", "attend_rows", "attend_visible", "ALL", "Rows"]
