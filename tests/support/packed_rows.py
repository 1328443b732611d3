"""Decoding with selections read as rows packed per batch row (`KVStore.select_rows`) or by the reference path:
left-padded prompts of different lengths, the policies, and every decoding selection as the policy said it."""
from __future__ import annotations

import torch

from infinigen import runtime
from infinigen.placement import Placement
from infinigen.policies import make_policy
from support.padded_reference import padded_reference
from support.speculation import random_skew

P, T = 9, 24  # prompt length, sequence length


def packed_policy(name, model, **knobs):
    """The registry's policy; InfiniGen with the flat preset, no dense layer and random skew matrices unless
    `knobs` say otherwise."""
    if name == "infinigen":
        knobs = {"preset": "flat", "dense_layers": ()} | knobs
        return make_policy("infinigen", **knobs).with_skew(random_skew(model))
    return make_policy(name, **knobs)


class Selections(runtime.Listener):
    """Every decoding selection as the policy said it: (layer, step) -> keep [B, Hkv, S] (or "all")."""

    def __init__(self):
        self.seen, self.step = {}, 0

    def on_select(self, layer, rows, keep, session):
        self.seen[(layer, int(rows.positions.max()))] = "all" if keep is runtime.ALL else keep[:, :, 0].clone()


def padded_prompts(model, lengths, seed=1):
    """Left-padded prompts of different lengths [B, P] and their mask, and the tokens fed after them."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, model.cfg.vocab_size, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), P, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, P - n:] = True
    return tokens, mask


def decode_rows(model, policy, tokens, mask, read_rows, greedy=False):
    """Prefill P tokens (left-padded by `mask`), then decode T - P steps: logits [B, T-P+1, V], the
    selections and the session. `greedy` feeds each step's argmax instead of the given tokens."""
    seen = Selections()
    sess = Placement().new_session(model, tokens.shape[0], T, policy, listeners=[seen])
    if not read_rows:
        padded_reference(sess)
    out = [runtime.prefill(model, tokens[:, :P], sess, pad_mask=mask)]
    for t in range(P, T):
        nxt = out[-1].argmax(-1) if greedy else tokens[:, t]
        out.append(runtime.decode(model, nxt, sess))
    return torch.stack(out, 1), seen.seen, sess


def first_row_dropped(selection):
    """A native selection's (keep, rows, head, counts, lse) with batch row 0's first packed row never read: the
    breakage the selection tests make on purpose."""
    keep, rows, head, counts, lse = selection
    rows, counts = rows.clone(), counts.clone()
    rows[0, :-1] = rows[0, 1:].clone()
    counts[0, 0] -= 1
    return keep, rows, head, counts, lse
