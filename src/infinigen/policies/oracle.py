"""The paper's "Optimal": the tokens layer i's true attention ranks highest, known exactly.

Not implementable in a real system (it needs every key of layer i before choosing which keys to
fetch); it bounds what any speculation can reach. Scores use the exact query of the layer and all
key columns. Per KV head the selection is the union over its group's query heads, either
  * a count: the top `ratio * past` (or `tokens`) entries ranked by the max over the group's heads of
    the true softmax probability (the current token in the denominator), or
  * a threshold: per query head, entries scoring above max - alpha, where the max runs over the past
    entries (`alpha` set; the speculation's rule applied to true scores).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UserError
from .base import ALL, Policy, parse_layers

ROW_CHUNK = 256  # decoding rows scored at once in teacher-forced mode: bounds [B,H,rows,T] scores


@dataclass(frozen=True)
class Oracle(Policy):
    name = "oracle"
    needs_query = True  # the layer's true scores decide: known only when its attention runs
    ratio: float | None = None  # keep this fraction of the past tokens (count budget)
    tokens: int | None = None  # or this many
    alpha: float | None = None  # or the threshold rule
    dense_layers: tuple[int, ...] = ()  # layers read in full (e.g. (0, 1): the same dense layers as InfiniGen)

    def __post_init__(self):
        object.__setattr__(self, "dense_layers", parse_layers(self.dense_layers))
        super().__post_init__()

    def validate(self):
        set_ = [x is not None for x in (self.ratio, self.tokens, self.alpha)]
        if sum(set_) > 1:
            raise UserError("oracle: give one of ratio, tokens or alpha")
        if self.ratio is not None and not 0 <= self.ratio <= 1:
            raise UserError(f"oracle ratio must be in [0, 1], got {self.ratio}")
        if self.tokens is not None and self.tokens < 0:
            raise UserError("oracle token budget must be >= 0")
        if self.alpha is not None and self.alpha < 0:
            raise UserError(f"oracle alpha must be >= 0, got {self.alpha}")
        if any(i < 0 for i in self.dense_layers):
            raise UserError("dense layers must be non-negative")

    def selects(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def _unlimited(self, layer: int | None = None) -> bool:
        return (self.ratio is None and self.tokens is None and self.alpha is None) or layer in self.dense_layers

    # ---- selection from scores: shared by decoding and teacher-forced rows ---------------------------
    def _choose(self, s: torch.Tensor, past: torch.Tensor, s_cur: torch.Tensor, n_past: torch.Tensor):
        """s [B,Hkv,G,R,S] scores, past [B|1,1,1|R,S] bool (which entries are cached before each row),
        s_cur [B,Hkv,G,R] the row's own score, n_past [R] or [B,1,1] tokens before each row.
        Returns bool [B,Hkv,R,S]."""
        s = s.masked_fill(~past, float("-inf"))
        if self.alpha is not None:
            m = s.amax(-1, keepdim=True)
            return ((s > m - self.alpha) & past).any(2)
        lse = torch.logaddexp(torch.logsumexp(s, dim=-1), s_cur)  # [B,Hkv,G,R]
        logp = (s - lse[..., None]).amax(2)  # [B,Hkv,R,S]: max over the group's heads
        if self.ratio is not None:
            n = (self.ratio * n_past.double()).floor().long()
        else:
            n = n_past.clamp(max=self.tokens)
        order = logp.argsort(-1, descending=True)
        ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(s.shape[-1], device=s.device).expand_as(order))
        return (ranks < n[..., None]) & past.any(2)

    def known_ahead(self, layer, session) -> bool:
        return self._unlimited(layer)  # else the layer's own query decides

    def keep(self, layer, rows, session):
        if self._unlimited(layer):
            return ALL
        if rows.in_store:
            return self._decoding_row(rows, session.model.scale)
        return self._sequence_rows(rows, session.model.scale)

    def _decoding_row(self, rows, scale: float) -> torch.Tensor:
        """One decoding row against the store's slots; its own key is not among them."""
        q, kp = rows.query, rows.keys
        b, h, _, d = q.shape
        hkv = kp.shape[1]
        qg = q.view(b, hkv, h // hkv, 1, d)
        s = torch.matmul(qg, kp[:, :, None].transpose(-1, -2)).float() * scale  # [B,Hkv,G,1,S]
        s_cur = (qg.float() * rows.own_keys[:, :, None].float()).sum(-1) * scale  # [B,Hkv,G,1]
        n_past = rows.positions[:, 0][:, None, None]  # [B,1,1] tokens before this one
        return self._choose(s, rows.valid[:, :, None], s_cur, n_past)

    def _sequence_rows(self, rows, scale: float) -> torch.Tensor:
        """Every decoding row of a sequence (teacher-forced) against the sequence's keys, in chunks."""
        q, k = rows.query, rows.keys
        b, h, r, d = q.shape
        hkv, t = k.shape[1], k.shape[2]
        p = rows.first
        qg = q.view(b, hkv, h // hkv, r, d)
        out = torch.empty(b, hkv, r, t, dtype=torch.bool, device=q.device)
        cols = torch.arange(t, device=q.device)
        for s0 in range(0, r, ROW_CHUNK):
            e = min(r, s0 + ROW_CHUNK)
            at = torch.arange(p + s0, p + e, device=q.device)
            qc = qg[:, :, :, s0:e]
            s = torch.matmul(qc, k[:, :, None].transpose(-1, -2)).float() * scale  # [B,Hkv,G,c,T]
            s_cur = s.gather(-1, at.view(1, 1, 1, -1, 1).expand(*s.shape[:-1], 1))[..., 0]
            past = (cols[None, :] < at[:, None])[None, None, None]  # [1,1,1,c,T]
            out[:, :, s0:e] = self._choose(s, past, s_cur, at)
        return out
