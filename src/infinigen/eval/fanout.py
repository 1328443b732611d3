"""One dense prefill, many policies: evaluation shortcut for prompts that every policy reads alike.

The prefill is dense for every policy (a policy only chooses what decoding reads), so its compute is
the same whatever the policy; only the hooks differ (`on_prefill`, `on_hidden`) and what the store
keeps (a codec may quantize). `prefill_shared` runs the prompt once and replays, for each policy's own
session, exactly what `Transformer.prefill` does to a session: write the prompt's keys and values into
its store, then call its policy's hooks with the same tensors. Each session then decodes on its own,
as after its own prefill. tests/test_eval_fanout.py checks the equality against separate prefills.

`repeat=n` gives each session n copies of every prompt row (row i of the prompt becomes rows
i*n .. i*n+n-1), as if the prompt had been prefilled n times: n continuations of one prompt then
decode in one batch (few-shot answer choices) for the cost of one prefill.
"""
from __future__ import annotations

import copy

import torch

from ..policies.base import Policy


class _Fanout(Policy):
    """The main session's policy: forwards the prefill hooks to the sub-sessions."""
    name = "fanout"

    def __init__(self, subs: list, repeat: int = 1):
        self.subs, self.repeat = subs, repeat

    def _rep(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.repeat == 1 else x.repeat_interleave(self.repeat, dim=0)

    def _sync(self, main) -> None:
        positions, next_pos = self._rep(main.positions), self._rep(main.next_pos)
        for s in self.subs:
            s.positions, s.row, s.mode, s.next_pos = positions, main.row, main.mode, next_pos

    def on_hidden(self, layer, point, x, main):
        self._sync(main)
        x = self._rep(x)
        for s in self.subs:
            s.policy.on_hidden(layer, point, x, s)
            s.store.ahead(layer, point, s)

    def on_prefill(self, layer, q, k, v, main):
        self._sync(main)
        valid = self._rep(main.store.past(layer)[2][:, 0])  # [B, T] real tokens, as written by the runtime
        q, k, v = self._rep(q), self._rep(k), self._rep(v)
        for s in self.subs:
            s.store.write_prompt(layer, k, v, valid, s.positions)
            s.policy.on_prefill(layer, q, k, v, s)


def fresh(policy: Policy, model) -> Policy:
    """An independent copy of `policy` (its per-request state is its own; the model is shared)."""
    memo = {id(model): model}
    memo.update({id(p): p for p in model.parameters()})
    memo.update({id(b): b for b in model.buffers()})
    return copy.deepcopy(policy, memo)


@torch.inference_mode()
def prefill_shared(model, tokens: torch.Tensor, policies: list[Policy], max_len: int,
                   pad_mask: torch.Tensor | None = None, copy_policies: bool = True, repeat: int = 1):
    """Prefill `tokens` [B, T] once; returns (last logits [B, V], one session per policy, each with
    B * repeat rows, ready to decode). With `copy_policies`, each session gets its own copy of its policy
    (the same object may be listed several times)."""
    b = tokens.shape[0]
    subs = [model.new_session(b * repeat, max_len, fresh(p, model) if copy_policies else p) for p in policies]
    fan = _Fanout(subs, repeat)
    main = model.new_session(b, tokens.shape[1], fan)
    logits = model.prefill(tokens, main, pad_mask=pad_mask)
    fan._sync(main)
    main.store.close()
    return logits, subs
