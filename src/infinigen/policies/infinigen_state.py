"""InfiniGen's per-request state (`InfiniGenState`, made by `InfiniGen.begin`) and the caps it reads per layer
(`InfiniGenCaps`, a part of the `InfiniGen` policy: the all-layer bound at a length, each selecting layer's cap, the
fused cut's arguments once per step, and where it reads densely)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cuts import layer_totals
from .budgets import layer_caps
from .speculation import layer_sparsity


@dataclass
class InfiniGenState:
    """Per request: the skew in use and, per layer, the partial index and weights, the partial (or 4-bit)
    key cache per store slot, the queries of the rows last seen and the selection made a layer ahead."""
    A: torch.Tensor | None  # [L, Hkv, d, d] float64, or None (no rotation); model-wide, shared
    alpha: float
    spec_layers: set
    cols: int
    caps: dict = field(default_factory=dict)  # selecting layer -> share of the cached entries it may read
    caps_for_length: tuple = (None, None)  # budget_growth < 1: (cached length, its caps), the last asked
    # teacher-forced rows in blocks: ((first, t), every layer's caps per row's length or None, layer -> [R] float32)
    row_caps: tuple = (None, None, None)
    layout: str | None = None  # key_mode "int4": the PackedKeys layout
    key_dtype: torch.dtype | None = None  # key_mode "partial": dtype of the stored partial columns
    idx: dict = field(default_factory=dict)  # layer -> [B, Hkv, cols] partial index
    proj: dict = field(default_factory=dict)  # layer -> [B, Hkv, d, cols] partial weights A[:, idx] (model dtype)
    # layer -> the keys speculation scores against: PackedKeys (int4) | [B, Hkv, capacity, cols] partial keys
    spec_keys: dict = field(default_factory=dict)
    spec: dict = field(default_factory=dict)  # layer -> [B, Hkv, G, T, d] post-RoPE queries (projected per row)
    # layer -> [B, Hkv, G, d]: a decoding row's own query, where the layer selected with it (in place of `spec`'s
    # entry, which `speculation._query` then gives as [B, Hkv, G, 1, d])
    spec_rows: dict = field(default_factory=dict)
    ready: set = field(default_factory=set)  # layers whose speculation for this decoding step has run
    # dense_below with packed keys in fast memory: the packed keys are built from the store at the first step
    # that selects, not kept up to date while every step reads densely (their append costs ~20% of a dense
    # step at 512 tokens, batch 1, on a 2-core CPU; building them once at the crossing, a prefill's work)
    lazy_keys: bool = False
    dense_below: int = 0  # the policy's `dense_below` in effect for this session's store
    # dense_below: (positions of the pass last asked, per token of the pass the fewest and the most cached
    # tokens of a row), read to the host once per pass
    lengths: tuple = (None, (), ())
    # `remainder`, where this session can keep it (no sliding window, no pool limit): per
    # selecting layer the sum of the values of every cached entry [B, Hkv, d] float32 and their count [B, Hkv],
    # kept in fast memory; the unread entries' log-mass of the rows last selected, until the runtime asks
    with_remainder: bool = False
    # every selecting layer selects with its own query at its attention (knob `query`), not one layer ahead
    own_query: bool = False
    # decoding speculates each selecting layer's selection one layer ahead (placement prefetches it); with
    # own_query too, the layer selects again with its own query (the correction, `reselects`)
    ahead: bool = False
    # the factor on the layer's cap while its selection is speculated for the prefetch (the store's
    # `prefetch_margin`: a wider prefetch of a layer that holds none of its last misses); 1 otherwise
    widen: float = 1.0
    # teacher-forced rows chosen a block at a time (`infinigen_select.rows_in_blocks`: calibration's scoring)
    rows_in_blocks: bool = False
    value_sums: dict = field(default_factory=dict)
    value_counts: dict = field(default_factory=dict)
    remainders: dict = field(default_factory=dict)  # layer -> the unread entries' log-mass, then Remainder
    keys_beside: dict = field(default_factory=dict)  # rerank: layer -> the candidates' keys not kept [B, Hkv, R]
    key_mean: dict = field(default_factory=dict)  # key_centre: layer -> [B, Hkv, 1, d] the packed keys' mean key
    rotations: tuple = ()  # A's layers as views, made once (`SpeculationKeys.rotation`)
    # decoding's fused cut: ((cached length, capacity), layer -> the cut's arguments at it), made once per step
    cuts: tuple = (None, None)
    # layer -> (its speculation keys, whether decoding's fused own-query cut applies to them, its rotation)
    lanes: dict = field(default_factory=dict)


# The policies `prepare` returned, per model (by id, held weakly): preparing one again for its model keeps its
# calibration. Kept here, not on the policy: a policy holds no reference to a model.

class InfiniGenCaps:
    """The caps of `InfiniGen` (its knobs: kv_budget, budget_growth, budget_ref, budget_power, max_fetch_ratio,
    min_fetch, crossing, dense_below; `selects`)."""

    def budget_at(self, cached: int) -> float:
        """The all-layer share read at `cached` tokens: kv_budget at budget_ref tokens, the tokens read
        growing as cached ** budget_growth (at most everything)."""
        if self.budget_growth == 1 or cached <= 0:
            return self.kv_budget
        return min(1.0, self.kv_budget * (self.budget_ref / cached) ** (1 - self.budget_growth))

    def layer_caps(self, model, cached: int | None = None) -> dict:
        """Selecting layer -> the share of its cached entries it may read per step: `max_fetch_ratio` for
        each, or the selecting layers' part of `kv_budget` (at `cached` tokens: `budget_at`; None: at
        budget_ref) spread by the calibrated sparsity."""
        # the bound is over the layers a policy may read sparsely: a local layer of a model mixing local and
        # global layers (Gemma 3) reads its window whatever the policy (`Session.selects`)
        counted = [i for i in range(model.cfg.num_layers) if not model.cfg.local(i)]
        n = len(counted)
        sel = [j for j, i in enumerate(counted) if self.selects(i)]
        if self.kv_budget is None:
            return {counted[j]: self.max_fetch_ratio for j in sel}
        share = self.budget_at(self.budget_ref if cached is None else cached)
        if n - len(sel) >= share * n:
            # the dense layers asked for alone read more than the bound: it cannot hold, so each selecting
            # layer reads at most kv_budget of its entries (the paper's per-layer reading of the cap)
            return {counted[j]: share for j in sel}
        sparsity = layer_sparsity(self, model)
        caps = layer_caps(n, sel, share, None if sparsity is None else [sparsity[i] for i in counted],
                          self.budget_power)
        return {counted[j]: c for j, c in caps.items()}

    def _cap(self, st: InfiniGenState, model, layer: int, cached: int) -> float:
        """Layer's cap at `cached` tokens; with a growth below 1 the caps of the last length asked are kept
        (every layer of a decoding step asks at the same length); times `st.widen` (a prefetch margin)."""
        cap = self._caps_at(st, model, cached)[layer]
        return cap if cap is None or st.widen == 1.0 else cap * st.widen

    def _caps_at(self, st: InfiniGenState, model, cached: int) -> dict:
        """Every selecting layer's cap at `cached` tokens (`_cap`)."""
        if self.budget_growth == 1 or self.kv_budget is None:
            return st.caps
        if st.caps_for_length[0] != cached:
            st.caps_for_length = (cached, self.layer_caps(model, cached))
        return st.caps_for_length[1]

    def _cut(self, st: InfiniGenState, model, layer: int, cached: int, capacity: int, with_lse: bool) -> dict:
        """The arguments of decoding's fused layer cut at `cached` tokens (scale, alpha, total, capacity, with_lse:
        `fused_select.select_packed`'s), every used slot valid: each layer's cap (`_layer_total`) computed for every
        layer at once when the length changes (once per step: every layer of a step asks at one length); a
        widened plan (`st.widen`, the store's prefetch margin) from its own widened cap."""
        at, cuts = st.cuts
        if at != (cached, capacity):
            caps = self._caps_at(st, model, cached)
            layers = list(caps)
            ratios = [self.max_fetch_ratio if caps[i] is None else caps[i] for i in layers]
            totals = layer_totals(ratios, cached, model.cfg.num_kv_heads, cached, self.min_fetch)
            cuts = {i: {"scale": model.scale, "alpha": st.alpha, "total": t, "capacity": capacity}
                    for i, t in zip(layers, totals)}
            st.cuts = ((cached, capacity), cuts)
        cut = cuts[layer]
        if st.widen != 1.0:
            cap = self._cap(st, model, layer, cached)
            ratio = self.max_fetch_ratio * st.widen if cap is None else cap
            cut = cut | {"total": layer_totals([ratio], cached, model.cfg.num_kv_heads, cached,
                                                      self.min_fetch)[0]}
        return cut | {"with_lse": with_lse}

    def dense_below_at(self, rows: int) -> int:
        """The cached length below which a session of `rows` rows reads densely: the crossing measured at the
        largest batch not above `rows` (policies/crossing.py), else the knob."""
        by_batch = (self.crossing or {}).get("by_batch") or {}
        measured = [int(b) for b in by_batch if int(b) <= rows]
        return by_batch[str(max(measured))] if measured else self.dense_below or 0

    # ---- per-request state ----------------------------------------------------------------------
