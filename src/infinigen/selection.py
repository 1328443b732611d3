"""What a layer's attention reads: the vocabulary policies, the runtime and placement share.

A policy answers one question per layer, `keep(layer, rows, session)`: which of the candidate entries
each decoding row in `rows` reads. The answer is a bool mask [B, Hkv, R, S] (R rows, S candidates), or
`ALL` for every candidate; while decoding, where the runtime offers it (`Rows.packs`), also the selection
already packed as the rows it reads (`cache.SelectedRows`, whose `keep` is that mask). The runtime asks it
in three situations and takes the same answer in each: decoding (one row against the store's slots, at the
layer's attention), the prefetch plan (the same row, asked one layer ahead when the policy says it can answer
without the layer's query) and teacher-forced scoring (every decoding row of a sequence at once, against the
sequence's own tokens).

Placement and the cache import this module, never a policy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class All:
    """The selection "every candidate entry" (`ALL`, the only instance): no mask is built for it."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ALL"

    def __reduce__(self):  # a copy or a pickle is the same object
        return (All, ())


ALL = All()


@dataclass(frozen=True)
class Rows:
    """Decoding rows of one layer and the entries they may read.

    first      index of the first row among the tokens of the current pass (`Session.positions[:, first]`)
    positions  [B, R] position of each row's token (the number of real tokens before it)
    entry_pos  [B|1, Hkv|1, S] position of the token each candidate entry holds
    valid      [B|1, Hkv|1, R|1, S] entries that exist and precede the row (padding and, in a pool, free
               slots excluded); a sliding window is applied by the runtime afterwards
    in_store   True while decoding: the candidates are the store's used slots (in slot order, any
               position), the row is the current token. False in teacher-forced scoring: the candidates
               are the sequence's tokens 0..S-1, every row at once.
    query      [B, H, R, d] the rows' queries (post-RoPE), or None when asked one layer ahead
    own_keys   [B, Hkv, R, d] the rows' own keys (not among the candidates), or None when asked ahead
    keys       [B, Hkv, S, d] the candidates' keys, or None when asked ahead (or when the store keeps
               them packed in the slow tier)
    packs      decoding only: the runtime reads the answer as packed rows (`KVStore.select_rows`) and every
               used slot is a valid, visible candidate (no padding, no window, no victims); the policy may
               then answer with the packed selection itself (`cache.SelectedRows`) instead of the mask
    """
    first: int
    positions: torch.Tensor
    entry_pos: torch.Tensor
    valid: torch.Tensor
    in_store: bool
    query: torch.Tensor | None = None
    own_keys: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    packs: bool = False

    @property
    def count(self) -> int:
        return self.positions.shape[1]


class Remainder(NamedTuple):
    """What a selection leaves unread at a layer, as the policy estimates it without reading it
    (`Policy.unread`). The runtime adds it to the attention over the selection:

        r = exp(lse) / (exp(lse) + exp(lse_read))    lse_read: the log-sum-exp of the exact scaled scores of
                                                     what attention read (the selection and the row's token)
        out = (1 - r) * out_read + r * mean of the unread entries' values

    lse     [B, Hkv, G, R] log of the unread past entries' attention mass (the log-sum-exp of their speculated
            scaled scores), per query head and decoding row; -inf where nothing is left unread (r is then 0)
    sums    [B, Hkv, d] float32: the sum of the values of every cached entry (decoding, kept by the policy in
            fast memory); None in teacher-forced scoring, where the runtime sums the sequence's values itself
    counts  [B, Hkv] the cached entries those sums cover (decoding), or None
    """
    lse: torch.Tensor
    sums: torch.Tensor | None = None
    counts: torch.Tensor | None = None


__all__ = ["ALL", "All", "Rows", "Remainder"]


def first_key_read(mask: torch.Tensor, default: int) -> int:
    """The first key (last dim) that some row of a bool mask [..., R, S] reads, or `default` when none does:
    a chunk of rows attends only from there (the keys before get a weight of exactly 0)."""
    seen = mask.any(-2).flatten(0, -2).any(0)
    return int(seen.to(torch.uint8).argmax()) if bool(seen.any()) else default
