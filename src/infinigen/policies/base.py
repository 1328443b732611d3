"""The one interface every KV-cache method implements.

A policy decides, at every decoding step and layer, which cached entries attention reads.
The runtime calls these hooks in this order for each layer of a decoding step:

    on_hidden(layer, "attn_in", x)      normed attention input of `layer` (speculation point of the paper)
    select(layer, q)                    which past slots to read: bool [B, Hkv, S], or None for all
    observe(layer, probs, idx)          attention weights over what was read (H2O, counters)
    on_append(layer, slots, k, v)       the current token was stored in `slots`
    on_hidden(layer, "attn_out", h)     residual stream after `layer`'s attention

`on_prefill` runs once per layer after the prompt. Selection is per KV head: every query head
of a GQA group attends over the same entries. State is per request and lives on the policy,
which `begin` resets. Policies never move data: placement (`infinigen.placement`) does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import KVCodec


@dataclass
class Policy:
    name = "full"

    def codec(self) -> KVCodec | None:
        """How keys and values are stored (None: as computed)."""
        return None

    def begin(self, model, session) -> None:
        self.model = model

    def on_prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, session) -> None:
        pass

    def on_hidden(self, layer: int, point: str, x: torch.Tensor, session) -> None:
        pass

    def select(self, layer: int, q: torch.Tensor, session) -> torch.Tensor | None:
        return None

    def planned(self, layer: int, session):
        """What `select(layer, ...)` will return at this decoding step, if it is known already (placement
        then fetches those rows one layer ahead, overlapped with compute): bool [B,Hkv,S], None for every
        entry, or NotImplemented while unknown (the default; rows are then fetched when `select` runs).
        Only a hint for speed: the runtime always uses what `select` returns."""
        return NotImplemented

    def observe(self, layer: int, probs: torch.Tensor, idx: torch.Tensor | None, session) -> None:
        pass

    def on_append(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, session) -> None:
        pass

    def select_rows(self, layer: int, q: torch.Tensor, k: torch.Tensor, session):
        """Teacher-forced fast path for stateless policies.

        q [B, H, R, d] are the queries of decoding rows `session.first_row ..`, k [B, Hkv, T, d] every key.
        Return a bool mask [B, Hkv, R, T] of the past entries each row reads (the runtime adds the row's
        own token and removes the future), None for all, or NotImplemented to have the runtime replay
        decoding row by row through `select`/`observe`/`on_append`.
        """
        return NotImplemented


@dataclass
class FullCache(Policy):
    """Every cached entry, every step: the exact dense result."""
    name = "full"

    def planned(self, layer, session):
        return None

    def select_rows(self, layer, q, k, session):
        return None
