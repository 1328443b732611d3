"""H2O (Heavy-Hitter Oracle): keep the tokens with the largest accumulated attention plus the most
recent ones; evict the rest for good.

Per layer and KV head, every cached token carries the attention it has received so far, summed over
the group's query heads (prompt rows included, from `on_prefill`). Before each decoding step the
cache is cut to the budget: the `recent` newest positions stay, the remaining room goes to the
highest scores. An evicted entry never comes back, which is what distinguishes H2O from InfiniGen's
per-step selection. Budgets are token counts (`heavy`, `recent`) or fractions of the current length
(`heavy_ratio`, `recent_ratio`, H2O's own setting). Stateful (`H2OState`), so teacher-forced runs replay decoding.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import UserError
from ..kernels.colsum import attention_column_sums
from .base import Policy


@dataclass
class H2OState:
    """Per layer [B, Hkv, capacity]: attention received so far, whether the entry is still cached; and
    the current token's own share of this step's attention, until it is stored."""
    score: list
    alive: list
    own: list = field(default_factory=list)


@dataclass(frozen=True)
class H2O(Policy):
    name = "h2o"
    needs_query = False  # the scores so far decide: known before the step
    needs_weights = True  # the attention each read entry receives accumulates into its score
    replays = True  # evictions follow every step's scores: teacher-forced scoring replays decoding
    heavy: int | None = None  # tokens; wins over heavy_ratio
    recent: int | None = None
    heavy_ratio: float = 0.1  # fraction of the current length
    recent_ratio: float = 0.1

    def validate(self):
        for name in ("heavy", "recent"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise UserError(f"H2O {name} must be >= 0, got {v}")
        for name in ("heavy_ratio", "recent_ratio"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise UserError(f"H2O {name} must be in [0, 1], got {v}")

    def budgets(self, cur: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(heavy, recent) token counts for rows with `cur` tokens in the past."""
        def one(tokens, ratio):
            if tokens is not None:
                return torch.full_like(cur, tokens)
            return (ratio * cur.double()).floor().long()
        return one(self.heavy, self.heavy_ratio), one(self.recent, self.recent_ratio)

    def begin(self, model, session) -> H2OState:
        store = session.store
        shape = (store.k[0].shape[0], store.k[0].shape[1], store.capacity)
        dev = store.k[0].device
        n = model.cfg.num_layers
        return H2OState(score=[torch.zeros(shape, dtype=torch.float32, device=dev) for _ in range(n)],
                        alive=[torch.zeros(shape, dtype=torch.bool, device=dev) for _ in range(n)], own=[None] * n)

    def on_prefill(self, layer, q, k, v, session):
        """Column sums of the prompt's causal attention, over valid query rows and the group's heads."""
        t = q.shape[2]
        _, _, valid, _ = session.store.past(layer)  # [B,Hkv,t]
        total = attention_column_sums(q, k, valid[:, 0], session.model.scale)  # blocked: never [t, t] scores
        session.state.score[layer][:, :, :t] = total
        session.state.alive[layer][:, :, :t] = valid

    def _keep(self, layer, cur: torch.Tensor, session) -> torch.Tensor:
        """The entries this step reads, cur [B] tokens before the row: the recent window plus the best
        scores, within the budget."""
        store = session.store
        n = store.length[layer]
        _, _, valid, pos = store.past(layer)
        st = session.state
        alive = st.alive[layer][:, :, :n] & valid
        cur = cur[:, None, None]  # [B,1,1]
        heavy, recent = self.budgets(cur)
        is_recent = alive & (pos >= cur - recent)
        room = (heavy + recent - is_recent.sum(-1, keepdim=True)).clamp(min=0)  # [B,Hkv,1]
        score = st.score[layer][:, :, :n].masked_fill(~alive | is_recent, float("-inf"))
        order = score.argsort(dim=-1, descending=True, stable=True)
        ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=order.device).expand_as(order))
        return is_recent | ((ranks < room) & alive & ~is_recent)

    def keep(self, layer, rows, session):
        """Decoding only (`replays`): asked once per layer and step, so the eviction happens here."""
        keep = self._keep(layer, rows.positions[:, 0], session)
        session.state.alive[layer][:, :, :keep.shape[-1]] = keep  # eviction is permanent
        return keep[:, :, None]

    def observe(self, layer, weights, rows, own, session):
        st = session.state
        # the attention each read entry received, group summed, into its slot's score ([B, Hkv, capacity] is
        # the store's flat row order)
        st.score[layer].view(-1).index_add_(0, rows.reshape(-1), weights.reshape(-1).float())
        st.own[layer] = own.float()  # [B,Hkv]: the current token's own share

    def on_append(self, layer, slots, k, v, session):
        st = session.state
        st.score[layer].scatter_(2, slots[..., None], st.own[layer][..., None])
        st.alive[layer].scatter_(2, slots[..., None], True)
