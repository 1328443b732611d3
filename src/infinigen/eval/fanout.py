"""One dense prefill, many policies: evaluation shortcut for prompts that every policy reads alike.

The prefill is dense for every policy (a policy only chooses what decoding reads), so its compute is
the same whatever the policy; only the hooks differ (`on_prefill`, `on_hidden`) and what the store
keeps (a codec may quantize). `prefill_shared` runs the prompt once, and a listener on it replays into
each policy's own session exactly what `runtime.prefill` does to a session (`Session.begin_prefill`,
`prefill_layer`, `event`) with the same tensors. Each session then decodes on its own, as after its own
prefill (or all of them in one `runtime.decode` call).
tests/eval/test_eval_fanout.py checks the equality against separate prefills.

`repeat=n` gives each session n copies of every prompt row (row i of the prompt becomes rows
i*n .. i*n+n-1), as if the prompt had been prefilled n times: n continuations of one prompt then
decode in one batch (few-shot answer choices) for the cost of one prefill.
"""
from __future__ import annotations

import torch

from .. import runtime
from ..placement import Placement
from ..policy import Policy


class _Fanout(runtime.Listener):
    """Listens to the one real prefill and replays it into the sub-sessions, as a prefill writes a session."""

    def __init__(self, subs: list, repeat: int = 1):
        self.subs, self.repeat = subs, repeat
        self.begun = None  # the positions of the main session's prefill the subs have begun

    def _rep(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.repeat == 1 else x.repeat_interleave(self.repeat, dim=0)

    def _begin(self, main) -> None:
        if self.begun is not main.positions:
            self.begun = main.positions
            positions, valid = self._rep(main.positions), self._rep(main.prompt_valid)
            for s in self.subs:
                s.begin_prefill(positions, valid)

    def on_hidden(self, layer, point, x, main):
        self._begin(main)
        x = self._rep(x)
        for s in self.subs:
            s.event(layer, point, x)

    def on_prefill(self, layer, q, k, v, main):
        self._begin(main)
        q, k, v = self._rep(q), self._rep(k), self._rep(v)
        for s in self.subs:
            s.prefill_layer(layer, q, k, v)


@torch.inference_mode()
def prefill_shared(model, tokens: torch.Tensor, policies: list[Policy], max_len: int,
                   pad_mask: torch.Tensor | None = None, repeat: int = 1, placement: Placement | None = None):
    """Prefill `tokens` [B, T] once; returns (last logits [B, V], one session per policy, each with
    B * repeat rows, ready to decode). A policy may be listed several times: every session has its own
    state. `placement` places each session's KV pool (the shared prefill itself stays in fast memory)."""
    b, t = tokens.shape
    placement = placement or Placement()
    subs = []
    try:
        for p in policies:
            subs.append(placement.new_session(model, b * repeat, max_len, p, prompt_len=t))
        main = Placement().new_session(model, b, t, listeners=[_Fanout(subs, repeat)])
        logits = runtime.prefill(model, tokens, main, pad_mask=pad_mask)
    except BaseException:
        for s in subs:
            s.store.close()
        raise
    main.store.close()
    return logits, subs
