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
from .base import Policy, parse_layers

ROW_CHUNK = 256  # decoding rows scored at once in teacher-forced mode: bounds [B,H,rows,T] scores


@dataclass(frozen=True)
class Oracle(Policy):
    name = "oracle"
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
            raise UserError("oracle: give one of --ratio, --budget (tokens) or --alpha")
        if self.ratio is not None and not 0 <= self.ratio <= 1:
            raise UserError(f"--ratio must be in [0, 1], got {self.ratio}")
        if self.tokens is not None and self.tokens < 0:
            raise UserError("oracle token budget must be >= 0")
        if self.alpha is not None and self.alpha < 0:
            raise UserError("--alpha must be >= 0")
        if any(i < 0 for i in self.dense_layers):
            raise UserError("dense layers must be non-negative")

    def begin(self, model, session) -> dict:
        return {}  # layer -> this step's attention input (for the current token's key)

    def speculated(self, layer: int) -> bool:
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

    # ---- decoding --------------------------------------------------------------------------------
    def on_hidden(self, layer, point, x, session):
        if point == "attn_in" and not self._unlimited(layer):
            session.state[layer] = x

    def _current_key(self, layer, session) -> torch.Tensor:
        """The current token's key [B,Hkv,1,d] (select only receives the query)."""
        m, r = session.model, session.row
        x = session.state[layer][:, r:r + 1]
        attn = m.layers[layer].attn
        b = x.shape[0]
        k = attn.k_proj(x).view(b, 1, m.cfg.num_kv_heads, m.cfg.head_dim).transpose(1, 2)
        return m.rotary.apply(k, session.positions[:, r:r + 1]) if m.cfg.uses_rope else k

    def select(self, layer, q, session):
        if self._unlimited(layer):
            return None
        kp, _, valid, _ = session.store.past(layer)
        b, h, _, d = q.shape
        hkv = kp.shape[1]
        qg = q.view(b, hkv, h // hkv, 1, d)
        s = torch.matmul(qg, kp[:, :, None].transpose(-1, -2)).float() * session.model.scale  # [B,Hkv,G,1,S]
        kc = self._current_key(layer, session)
        s_cur = (qg.float() * kc[:, :, None].float()).sum(-1) * session.model.scale  # [B,Hkv,G,1]
        n_past = session.positions[:, session.row][:, None, None]  # [B,1,1] tokens before this one
        return self._choose(s, valid[:, :, None, None], s_cur, n_past)[:, :, 0]

    # ---- teacher-forced rows -----------------------------------------------------------------------
    def select_rows(self, layer, q, k, session):
        if self._unlimited(layer):
            return None
        b, h, r, d = q.shape
        hkv, t = k.shape[1], k.shape[2]
        p = session.first_row
        qg = q.view(b, hkv, h // hkv, r, d)
        out = torch.empty(b, hkv, r, t, dtype=torch.bool, device=q.device)
        cols = torch.arange(t, device=q.device)
        for s0 in range(0, r, ROW_CHUNK):
            e = min(r, s0 + ROW_CHUNK)
            rows = torch.arange(p + s0, p + e, device=q.device)
            qc = qg[:, :, :, s0:e]
            s = torch.matmul(qc, k[:, :, None].transpose(-1, -2)).float() * session.model.scale  # [B,Hkv,G,c,T]
            s_cur = s.gather(-1, rows.view(1, 1, 1, -1, 1).expand(*s.shape[:-1], 1))[..., 0]
            past = (cols[None, :] < rows[:, None])[None, None, None]  # [1,1,1,c,T]
            out[:, :, s0:e] = self._choose(s, past, s_cur, rows)
        return out
