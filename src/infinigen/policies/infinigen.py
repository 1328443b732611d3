"""InfiniGen (paper section 4.3): speculate layer i's important tokens one layer ahead, fetch only those.

Per request, at prefill, layer i >= 1 (except dense layers) gets a partial index: the top ceil(r*d)
columns of |Q~| + |K~| summed over the prompt (Q~ = Q A, K~ = K A skewed, A from `infinigen.skew`),
the partial weights A[:, idx], and a partial key cache K~[:, idx] of every cached token in the model's
dtype (rewritten in `on_append`, so it follows pool evictions). At decoding, when layer i-1's hook
fires, the speculative query of layer i is computed from the hidden state available there, projected
by the partial weights and scored against the partial key cache; tokens
within `alpha` of each head's maximum are selected and counted per `budget`, at most
`max_fetch_ratio` of the cached tokens. Layer i's attention then runs over those plus the current
token (the runtime does that).

Skew matrices are a model-wide resource: `prepare(model, tokenizer)` loads the artifact of `infinigen
skew` from the cache (or the one the package ships for the model), or calibrates on `calib` (default: a
bundled novel) and caches it; `with_skew(skew)`
(an `infinigen.skew.Skew` or a tensor [L,Hkv,d,d]) sets them by hand. The rotation is applied at run time
(after RoPE for the Llama family); for a model whose weights already hold it (`skew.skew_model`) it is
not applied twice. Per-request state (`InfiniGenState`) lives on the session.

Modes beyond the paper (ARCHITECTURE.md, "The default InfiniGen preset", says what was measured):
`spec_input="attn_out"` speculates from
LN_i(h_{i-1} + attn_out_{i-1}) (layer i's own input norm of the residual after layer i-1's attention);
`key_mode="int4"` scores all columns against packed 4-bit skewed keys (`kernels.int4.PackedKeys`:
two codes per byte, a 16-bit scale and minimum per group of 32; 40 B per token and KV head at d 64, the
same as 30% of the columns in 16 bits, 7.8% of float32 K+V) with torch's CPU int4 kernel where it fits;
`budget="union"` lets a KV head fetch every token any of its query heads selects, and `budget="layer"`
pools the cap over a layer's KV heads and spends it on the entries with the most speculated attention
mass. The default preset combines the three (see PRESETS); `InfiniGen.paper()` is exactly the paper's method.

How much is read is one all-layer bound, `kv_budget` (the share of the cached entries read
over every layer, dense layers counting 100%); the selecting layers' caps are derived from it
(`budgets.layer_caps`), spread by the attention sparsity the skew calibration recorded per layer
(`budget_power`: 0 the same cap everywhere, 1 proportional). The bound may shrink with the length:
with `budget_growth` q < 1 the tokens read grow as n ** q (`budget_at`: kv_budget at `budget_ref` cached
tokens), because the tokens that matter grow more slowly than the context. `exact_first` selects layer 0
too, with its exact query (nothing precedes layer 0 to speculate from), scored against layer 0's partial or
packed keys. That query is known as soon as a decoding step's tokens are embedded, so
the selection is made then and placement prefetches layer 0's rows like every other layer's. Layer 1 is
then speculated from layer 0's output like every other layer.

`calibrate` chooses alpha, kv_budget and the treatment of layer 0 per model in `prepare`
(`policies.calibrate`: the cheapest setting within `calibrate_target` of the full cache's perplexity on
held-apart calibration tokens, under `calibrate_bound`); knobs the caller sets are kept. The choice is
stored in the skew artifact's metadata and recorded in `settings(model)["calibration"]`.

The speculation scores cover every cached token, so with `remainder` the attention mass of
the entries a selection leaves unread is estimated without reading them (the log-sum-exp of their speculated
scores, `Remainder.lse`), and the runtime adds that mass times their mean value: the sum of every cached value
per (batch row, KV head), kept in fast memory (float32, updated in `on_prefill` / `on_append`), minus what
attention read, over their count. Their share of the row's mass is measured against the exact scores of
what was read (the row's own token included). Nothing unread: the dense result to the bit. Off under a pool
limit (an append overwrites a value the sums hold) and a sliding window; needs key_mode int4 (the partial
columns' scores are not on the scores' scale). `remainder_from`: the selecting layers before it go without.

Which query selects (`query`): the paper speculates layer i's query at layer i-1 so that the rows can be fetched
while layer i-1 still runs. Where the KV sits in fast memory there is no transfer to hide, and the layer's own
query, known once its projection ran, ranks the same 4-bit keys better (and its unread mass is the remainder's
weight): "own" selects with it at the layer's attention, "ahead" speculates as the paper does, and "auto" (the
default preset) takes "own" in fast memory and "ahead" on an offloaded tier. Measured on the validation texts:
results/accuracy_models.md.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from ..cache import KVStore, SelectedRows
from ..errors import UserError
from ..kernels import fused_select
from ..kernels.int4 import PackedKeys, tinygemm_ok
from ..memory import tensor_bytes, weight_bytes
from .base import ALL, Policy, Remainder, jsonable, parse_layers
from .budgets import layer_caps

BUDGETS = ("mean", "per_head", "union", "layer")
SPEC_INPUTS = ("attn_in", "attn_out")
KEY_MODES = ("partial", "int4")
# which query selects a layer's entries (knob `query`): the one speculated a layer ahead (the paper: its rows can
# be fetched while the layer before runs), the layer's own (after its projection, scored against the same
# speculation keys: nothing is fetched ahead), or the own query where the KV is in fast memory (no transfer
# to overlap, so nothing is lost by waiting for it) and the speculated one where placement fetches from a slower tier
QUERIES = ("ahead", "own", "auto")
INT4_GROUP = 32
ROWS_PER_CHOICE = 64  # teacher-forced rows per `_choose` call in `_rows_in_blocks`
SCORE_BLOCK = 2 ** 27  # speculated scores per call when a teacher-forced pass scores its rows in blocks

# Why each preset is what it is, with the measurements: results/presets.md
PRESETS = {
    # the paper, sections 4.2-4.3: alpha 4 for OPT, 5 for Llama
    "paper": dict(alpha={"opt": 4.0, "llama": 5.0}, partial_ratio=0.3, max_fetch_ratio=0.2, min_fetch=0,
                  dense_layers=(0, 1), budget="mean", spec_input="attn_in", key_mode="partial", skew=True,
                  kv_budget=None, budget_power=0.0, exact_first=False, budget_growth=1.0, budget_ref=2048,
                  calibrate=False, remainder=False, remainder_from=0, query="ahead", dense_below=0),
    # the one default. `prepare` calibrates this model's alpha, kv_budget, layer 0 and the
    # remainder on held-apart tokens (policies/calibrate.py); the values below are the starting point and what
    # applies where no calibration can run (no tokenizer, a model shorter than budget_ref). Chosen over the
    # others by the validation texts on two families (results/accuracy_models.md): the tokens read grow as
    # sqrt(length), so the 20% over a 2048-token run is 10% over 8192 and 5% over 32K; the search chose the
    # largest budget under that bound on both families, alpha 7 on SmolLM2 and 9 on Gemma 3, and the remainder
    # (from layer 1 on SmolLM2), with each layer's own query where the KV is in fast memory ("auto")
    "default": dict(alpha=9.0, partial_ratio=0.3, max_fetch_ratio=None, min_fetch=32,
                    dense_layers=(), budget="layer", spec_input="attn_out", key_mode="int4", skew=True,
                    kv_budget=0.13, budget_power=0.0, exact_first=True, budget_growth=0.5, budget_ref=2048,
                    calibrate=True, remainder=True, remainder_from=1, query="auto"),
    # (and `dense_below` left to `prepare`: where selection pays on this machine, measured once, policies/crossing.py)
    # the earlier default (`--knob preset=flat`): a flat 14% cap per selecting layer at every length, layers 0 and 1
    # dense, with what the selection leaves unread added (Emma +2.65% -> +0.76%, Mansfield Park +2.59% ->
    # +2.12% at 2048: results/accuracy.md). Under 20% of the KV at 2048 but not less at 8192 (results/accuracy.md)
    "flat": dict(alpha=7.0, partial_ratio=0.3, max_fetch_ratio=0.14, min_fetch=32,
                 dense_layers=(0, 1), budget="layer", spec_input="attn_out", key_mode="int4", skew=True,
                 kv_budget=None, budget_power=0.0, exact_first=False, budget_growth=1.0, budget_ref=2048,
                 calibrate=False, remainder=True, remainder_from=0, query="ahead", dense_below=0),
    # `--knob preset=budget`: one all-layer bound that shrinks with the context (the
    # remainder, with the speculated query, made it worse: +1.44% -> +3.14%)
    "budget": dict(alpha=9.0, partial_ratio=0.3, max_fetch_ratio=None, min_fetch=32,
                   dense_layers=(), budget="layer", spec_input="attn_out", key_mode="int4", skew=True,
                   kv_budget=0.13, budget_power=0.0, exact_first=True, budget_growth=0.5, budget_ref=2048,
                   calibrate=False, remainder=False, remainder_from=0, query="ahead", dense_below=0),
}


# what `calibrate` chooses per model (policies/calibrate.py), unless the caller sets it
CALIBRATED = ("alpha", "kv_budget", "max_fetch_ratio", "budget_growth", "exact_first", "dense_layers", "remainder",
              "remainder_from", "budget")
# perplexity within 0.5% of the full cache's on the calibration tokens: half the 1% a user is promised, as a margin
# for text the calibration never saw (SmolLM2, own query with the remainder at the largest budget: Mansfield
# Park +0.17%, the three validation texts +0.09% to +0.71%; at 14% of the KV, chosen with a 1% target, Mansfield
# Park +0.80% and Pride and Prejudice +0.93%)
CALIBRATE_TARGET = 0.005
CALIBRATE_BOUND = 0.2  # at most 20% of the KV read over all layers at budget_ref tokens (10% at 4x: growth 0.5)
CALIBRATE_TEXT = "mansfieldpark"  # held apart: the skew calibrates on emma, evaluation reads the other three
CALIBRATE_GROWTH = 0.5  # the tokens read grow as n ** 0.5: the bound at 4x the length is half the share


def fake_int4(x: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """Group-wise asymmetric 4-bit quantize-dequantize along the last dim (per token, groups of `group`)."""
    d = x.shape[-1]
    if d % group:
        group = d
    g = x.reshape(*x.shape[:-1], d // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = ((g - lo) / scale).round().clamp(0, 15)
    return (q * scale + lo).reshape(x.shape)


def _kth_largest(score: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest value of each row (last dim) of `score`, [..., 1]: the cut's threshold. On a CPU,
    numpy's introselect (a partition, no sort) is 10x faster than torch's top-k, which sorts partially:
    0.6 against 5.6 ms for 8 rows of 3 x 8192 entries at k = 14%, one thread. Both give the same value."""
    if score.device.type == "cpu":
        a = score.contiguous().numpy()
        n = a.shape[-1]
        return torch.from_numpy(np.partition(a, n - k, axis=-1)[..., n - k:n - k + 1])
    return score.topk(k, dim=-1, sorted=False).values.amin(-1, keepdim=True)


def _cut_in_one_pass(score: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The k-th largest value of each row, [..., 1], and, on a CPU, `score >= it` when that is exactly the
    top k of every row: the (k+1)-th largest is smaller (no tie at the threshold left out) and the threshold
    is above -inf. Then the cut is this one pass instead of the tie-breaking cumulative sum; None otherwise
    (or on CUDA, where the check would synchronize). One introselect finds both values."""
    if score.device.type != "cpu":
        return _kth_largest(score, k), None
    a = score.contiguous().numpy()
    n = a.shape[-1]
    part = np.partition(a, [n - k - 1, n - k] if k < n else n - k, axis=-1)
    thr = torch.from_numpy(part[..., n - k:n - k + 1])
    if not bool((thr > float("-inf")).all()):
        return thr, None
    if k < n and not bool((torch.from_numpy(part[..., n - k - 1:n - k]) < thr).all()):
        return thr, None
    return thr, score >= thr


def int4_layout(d: int, capacity: int, device) -> str:
    """The `PackedKeys` layout of a request's 4-bit speculation keys, chosen once in `begin` so that decoding
    and teacher-forced scoring quantize the same way: torch's CPU int4 kernel where it takes this head_dim and padding
    the capacity to its 64-token blocks keeps the bytes within 2.4% (40 B/token/head then stays under 8% of
    float32 K+V), else the portable rows layout."""
    padded = -(-capacity // 64) * 64
    return "tinygemm" if tinygemm_ok(d, INT4_GROUP, device) and padded <= 1.024 * capacity else "rows"


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
    layout: str | None = None  # key_mode "int4": the PackedKeys layout
    key_dtype: torch.dtype | None = None  # key_mode "partial": dtype of the stored partial columns
    idx: dict = field(default_factory=dict)  # layer -> [B, Hkv, cols] partial index
    proj: dict = field(default_factory=dict)  # layer -> [B, Hkv, d, cols] partial weights A[:, idx] (model dtype)
    # layer -> the keys speculation scores against: PackedKeys (int4) | [B, Hkv, capacity, cols] partial keys
    spec_keys: dict = field(default_factory=dict)
    spec: dict = field(default_factory=dict)  # layer -> [B, Hkv, G, T, d] post-RoPE queries (projected per row)
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
    with_rest: bool = False
    # every selecting layer selects with its own query at its attention (knob `query`), not one layer ahead
    own_query: bool = False
    # teacher-forced rows chosen a block at a time (`_rows_in_blocks`: calibration's scoring), not row by row
    rows_in_blocks: bool = False
    value_sums: dict = field(default_factory=dict)
    value_counts: dict = field(default_factory=dict)
    rest: dict = field(default_factory=dict)
    key_mean: dict = field(default_factory=dict)  # key_centre: layer -> [B, Hkv, 1, d] the packed keys' mean key


# Skew matrices are a model-wide resource: loaded or computed once per (model, calibration text) by
# `prepare`, shared by every policy object and session on that model.
_SKEWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# Calibrated settings (`calibrate`), per model and search key: the search runs once per process
_CHOICES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# Where selection pays (`dense_below` of the default preset), per model and settings: measured once per process
_CROSSINGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class InfiniGen(Policy):
    name = "infinigen"
    # the speculation made at the layer before decides (see `known_ahead`; layer 0 with exact_first: its query),
    # unless this session selects with each layer's own query (`query`): then nothing is known ahead
    needs_query = False

    # "default" (calibrated per model), "flat" (a flat cap), "budget" (one shrinking bound) or "paper"; knobs left
    # None come from it
    preset: str = "default"
    alpha: float | None = None  # select tokens whose speculated score > max - alpha (None: the preset's, per arch)
    partial_ratio: float | None = None  # r: share of the d columns in the partial weights / key cache
    # at most this share of the cached tokens per step and selecting layer (per KV head; per layer for budget
    # "layer"): the paper's cap, instead of kv_budget
    max_fetch_ratio: float | None = None
    min_fetch: int | None = None  # ... but the cap is never below this many tokens per KV head (short prompts)
    # selection unit, in consecutive slots per KV head (budget "layer"): a block is read whole when any of its
    # tokens is chosen, blocks ranked by their speculated mass; 1: single tokens. 16 float32 rows at d 64
    # would be one 4 KB page of a pool file laid out per KV head: measured to cost too much accuracy for
    # what it saves on this machine's disk (results/offload.md), so a knob for experiments
    block: int = 1
    # layers attending densely (layer 0 too unless exact_first: nothing precedes it)
    dense_layers: tuple[int, ...] | None = None
    budget: str | None = None  # "mean" (paper) | "per_head" | "union" | "layer" (see `_choose`)
    spec_input: str | None = None  # "attn_in" (paper) | "attn_out"
    key_mode: str | None = None  # "partial" (paper) | "int4"
    # int4: pack each key less the layer's mean key (per KV head, of the tokens cached when the keys are first
    # packed: the prompt's). Every score of a query row shifts by the same q . mean, added back, so the scale is
    # the attention's; the 4 bits then resolve what tells keys apart instead of what they share (a bias, a
    # norm's weight: results/recall.md)
    key_centre: bool = False
    skew: bool | None = None  # rotate queries and keys with the skew matrices
    calib: str | None = None  # calibration text of the skew (file or corpus name; None: the cached or default one)
    # share of the KV read over all layers (dense layers count 100%): the caps follow from it
    kv_budget: float | None = None
    budget_power: float | None = None  # kv_budget's layer caps ~ calibrated sparsity ** this (0: the same for all)
    # how the tokens read grow with the cached length n: n ** budget_growth, kv_budget being the share at
    # budget_ref tokens (1: the same share at every length; 0.5: twice the tokens for 4x the context)
    budget_growth: float | None = None
    budget_ref: int | None = None
    # layer 0 selects with its exact query (no prefetch overlap there) instead of reading all
    exact_first: bool | None = None
    # a decoding row with fewer cached tokens than this reads every layer densely (0: never): below it
    # speculation costs more than the rows it saves (results/sparse_pays.md). A step whose every row is below
    # it skips speculation altogether and reads ALL (the runtime's fused dense path). None: the preset's; the
    # default preset's is measured on this machine by `prepare` (policies/crossing.py) and applies where the
    # KV is in fast memory; before `prepare`, 0
    dense_below: int | None = None
    # `prepare` chooses this model's alpha, kv_budget (growth 0.5) and layer-0 treatment on held-apart
    # calibration tokens (policies/calibrate.py); a knob of CALIBRATED the caller sets is kept as set
    calibrate: bool | None = None
    calibrate_target: float | None = None  # relative perplexity over the full cache allowed (None: 0.5%)
    calibrate_bound: float | None = None  # all-layer KV share at budget_ref tokens, at most (None: 20%)
    calibrate_text: str | None = None  # file or corpus name (None: mansfieldpark, apart from the skew's emma)
    # add what the selection leaves unread, estimated from the speculation scores (which cover
    # every cached token) and a running sum of the values per KV head kept in fast memory (`remainder`)
    # (None: the preset's; off where the speculation keys are partial columns, whose scores are not on the
    # attention's scale)
    remainder: bool | None = None
    # the first layer whose selection adds the remainder (the selecting layers before it read only what they
    # select): calibration tries 0 and the layer after the first selecting one
    remainder_from: int | None = None
    query: str | None = None  # which query selects: "ahead" (paper), "own" or "auto" (see QUERIES)
    # explicit skew matrices (`with_skew`): a resource, not a knob
    matrices: object = field(default=None, init=False, repr=False, compare=False)
    # the knobs of CALIBRATED the caller set, and every knob's value before calibration (`prepare`)
    given: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)
    base: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # what calibration chose for the model last prepared (`calibration_record`), None before
    calibration: object = field(default=None, init=False, repr=False, compare=False)
    calibrated_on: object = field(default=None, init=False, repr=False, compare=False)  # weakref to that model
    calibrate_set: bool = field(default=False, init=False, repr=False, compare=False)  # by the caller, not the preset
    # where `dense_below` came from ("set", "preset", "measured", "cached", "not measured (...)", "not prepared")
    # and what the measurement found (policies/crossing.py), recorded in `settings()`
    crossing: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise UserError(f"unknown InfiniGen preset {self.preset!r}; choose from {', '.join(PRESETS)}")
        object.__setattr__(self, "given", frozenset(k for k in CALIBRATED if getattr(self, k) is not None))
        object.__setattr__(self, "calibrate_set", self.calibrate is not None)
        object.__setattr__(self, "crossing", {"source": "set"} if self.dense_below is not None else
                           {"source": "preset"} if "dense_below" in PRESETS[self.preset] else
                           {"source": "not prepared"})
        preset = PRESETS[self.preset]
        # one bound: a cap the caller gives (per selecting layer, or over all layers) replaces the preset's
        if self.max_fetch_ratio is not None and self.kv_budget is None:
            # (a per-layer cap is a flat share: the all-layer budget's growth goes with it)
            preset = {k: v for k, v in preset.items() if k != "kv_budget"} | {"budget_growth": 1.0}
        elif self.kv_budget is not None and self.max_fetch_ratio is None:
            preset = {k: v for k, v in preset.items() if k != "max_fetch_ratio"}
        for k, v in preset.items():
            if getattr(self, k) is None:
                if k == "remainder" and self.key_mode != "int4":
                    v = False
                if k == "alpha" and isinstance(v, dict):
                    if len(set(v.values())) > 1:
                        continue  # depends on the architecture: `alpha_for` resolves it
                    v = next(iter(v.values()))
                object.__setattr__(self, k, v)
        object.__setattr__(self, "dense_layers", parse_layers(self.dense_layers))
        super().__post_init__()
        object.__setattr__(self, "base", {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init})

    @classmethod
    def paper(cls, **overrides) -> "InfiniGen":
        """Exactly the paper's method (alpha 4 for OPT, 5 for Llama; r 0.3; 20% cap; layers 0, 1 dense)."""
        return cls(preset="paper", **overrides)

    def validate(self) -> None:
        if self.alpha is not None and not self.alpha > 0:
            raise UserError(f"alpha must be positive, got {self.alpha}")
        if not 0 < self.partial_ratio <= 1:
            raise UserError(f"partial ratio must be in (0, 1], got {self.partial_ratio}")
        if (self.kv_budget is None) == (self.max_fetch_ratio is None):
            raise UserError("give one of kv_budget (all layers) and max_fetch_ratio (per selecting layer)")
        if self.kv_budget is not None and not 0 < self.kv_budget <= 1:
            raise UserError(f"kv budget must be in (0, 1], got {self.kv_budget}")
        if self.max_fetch_ratio is not None and not 0 < self.max_fetch_ratio <= 1:
            raise UserError(f"max fetch ratio must be in (0, 1], got {self.max_fetch_ratio}")
        if not isinstance(self.budget_power, (int, float)) or isinstance(self.budget_power, bool) \
                or self.budget_power < 0:
            raise UserError(f"budget power must be a number >= 0, got {self.budget_power!r}")
        if not isinstance(self.budget_growth, (int, float)) or isinstance(self.budget_growth, bool) \
                or not 0 < self.budget_growth <= 1:
            raise UserError(f"budget growth must be in (0, 1], got {self.budget_growth!r}")
        if not isinstance(self.budget_ref, int) or isinstance(self.budget_ref, bool) or self.budget_ref < 1:
            raise UserError(f"budget ref must be a whole number of tokens >= 1, got {self.budget_ref!r}")
        if self.budget_growth != 1 and self.kv_budget is None:
            raise UserError("budget growth applies to kv_budget (give kv_budget instead of max_fetch_ratio)")
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 1:
            raise UserError(f"block must be a whole number of tokens >= 1, got {self.block!r}")
        if self.block > 1 and self.budget != "layer":
            raise UserError("block selection needs budget=layer")
        if not isinstance(self.exact_first, bool):
            raise UserError(f"exact_first must be true or false, got {self.exact_first!r}")
        if not isinstance(self.min_fetch, int) or isinstance(self.min_fetch, bool) or self.min_fetch < 0:
            raise UserError(f"min fetch must be a whole number of tokens >= 0, got {self.min_fetch}")
        if self.budget not in BUDGETS:
            raise UserError(f"budget must be one of {', '.join(BUDGETS)}, got {self.budget!r}")
        if self.spec_input not in SPEC_INPUTS:
            raise UserError(f"speculation input must be one of {', '.join(SPEC_INPUTS)}, got {self.spec_input!r}")
        if self.key_mode not in KEY_MODES:
            raise UserError(f"key mode must be one of {', '.join(KEY_MODES)}, got {self.key_mode!r}")
        if any(i < 0 for i in self.dense_layers):
            raise UserError("dense layers must be non-negative")
        if not isinstance(self.skew, bool):
            raise UserError(f"skew must be true or false, got {self.skew!r}")
        if self.dense_below is not None and (not isinstance(self.dense_below, int)
                                             or isinstance(self.dense_below, bool) or self.dense_below < 0):
            raise UserError(f"dense below must be a whole number of cached tokens >= 0, got {self.dense_below!r}")
        if not isinstance(self.remainder_from, int) or isinstance(self.remainder_from, bool) \
                or self.remainder_from < 0:
            raise UserError(f"remainder from must be a layer index >= 0, got {self.remainder_from!r}")
        if self.query not in QUERIES:
            raise UserError(f"query must be one of {', '.join(QUERIES)}, got {self.query!r}")
        if not isinstance(self.remainder, bool):
            raise UserError(f"remainder must be true or false, got {self.remainder!r}")
        if self.remainder and self.key_mode != "int4":
            raise UserError("remainder needs key_mode=int4: partial columns do not estimate the scores' scale")
        if not isinstance(self.key_centre, bool):
            raise UserError(f"key_centre must be true or false, got {self.key_centre!r}")
        if self.key_centre and self.key_mode != "int4":
            raise UserError("key_centre needs key_mode=int4 (it centres the packed 4-bit keys)")
        if not isinstance(self.calibrate, bool):
            raise UserError(f"calibrate must be true or false, got {self.calibrate!r}")
        if self.calibrate_target is not None and not 0 < self.calibrate_target < 1:
            raise UserError(f"calibrate target must be a relative perplexity in (0, 1), got {self.calibrate_target}")
        if self.calibrate_bound is not None and not 0 < self.calibrate_bound <= 1:
            raise UserError(f"calibrate bound must be a share of the KV in (0, 1], got {self.calibrate_bound}")

    def alpha_for(self, cfg) -> float:
        """The threshold in effect on a model of this config (the paper's preset depends on the architecture)."""
        return float(self.alpha if self.alpha is not None else PRESETS[self.preset]["alpha"][cfg.arch])

    def settings(self, model=None) -> dict:
        out = super().settings()
        if model is not None:
            out["alpha"] = self.alpha_for(model.cfg)
        elif self.alpha is None:
            out["alpha"] = dict(PRESETS[self.preset]["alpha"])  # per architecture
        if self.calibrate:
            out["calibration"] = self.calibration  # chosen, set by hand, and what the choice measured
        out["dense_below_source"] = self.crossing.get("source")
        if "lengths" in self.crossing:  # what the measurement found
            out["crossing"] = {k: v for k, v in self.crossing.items() if k != "source"}
        return out

    def for_random_weights(self, model, fixed_ratio: float | None) -> "InfiniGen":
        """Every token qualifies (alpha 1e9) and the cap picks the top `fixed_ratio` of them; random
        orthogonal skew matrices stand in for calibrated ones."""
        if fixed_ratio is None:
            raise UserError("InfiniGen on random weights needs a fixed selection ratio (fixed_ratio): "
                            "speculation on random weights means nothing")
        if model is None:
            return self
        cfg = model.cfg
        g = torch.Generator().manual_seed(0)
        rand = torch.randn(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim, generator=g,
                           dtype=torch.float64)
        pol = dataclasses.replace(self, alpha=1e9, max_fetch_ratio=fixed_ratio, kv_budget=None, min_fetch=0,
                                  budget_growth=1.0, calibrate=False)  # the fixed share at every length
        return pol.with_skew(torch.linalg.qr(rand)[0]) if pol.skew else pol

    # ---- skew matrices ----------------------------------------------------------------------------
    def with_skew(self, skew) -> "InfiniGen":
        """Use these skew matrices (an `infinigen.skew.Skew` or a tensor [L, Hkv, d, d]) on any model
        instead of calibrated ones; returns self."""
        object.__setattr__(self, "matrices", skew)
        return self

    def _needs_skew(self, model) -> bool:
        # no rotation, or the weights already produce q~ and k~ (`skew.skew_model`)
        return bool(self.skew) and getattr(model, "skew_folded", None) is None

    def prepare_skew(self, model, tokenizer=None, progress=False) -> "InfiniGen":
        """Make the model's skew matrices ready: those of `infinigen skew` (or of an earlier `prepare`)
        from the cache, else calibrated on `calib` (default: a bundled novel) with `tokenizer` and cached."""
        if not self._needs_skew(model) or self.matrices is not None:
            return self
        cached = _SKEWS.setdefault(model, {})
        if self.calib in cached:
            return self
        from ..skew import find_cached_skew, load_or_compute_skew
        skew = find_cached_skew(model) if self.calib is None else None
        if skew is None:
            if tokenizer is None:
                raise UserError("InfiniGen needs this model's skew matrices: run `infinigen skew` once, or give "
                                "prepare() the tokenizer to calibrate them (or set the knob skew=false)")
            skew = load_or_compute_skew(model, tokenizer, self.calib, progress=progress)
        cached[self.calib] = skew
        return self

    def prepare(self, model, tokenizer=None, progress=False, longest: int | None = None) -> "InfiniGen":
        """The skew matrices (`prepare_skew`), then, with `calibrate`, this model's settings: from the skew
        artifact's metadata when this search ran before on the same tokens (or the package ships it), else
        searched (`policies.calibrate`) and stored there. Prints one line with the choice. `progress`: True
        for a bar on stderr, or a callback `progress(desc, done, total, eta_seconds)` (`skew.Progress`).
        `longest`: the most tokens a session of this run caches (None: unknown), see `_resolve_dense_below`."""
        self.prepare_skew(model, tokenizer, progress)
        done = self.calibrated_on is not None and self.calibrated_on() is model
        if self.calibrate and not done:
            try:
                self._calibrate(model, tokenizer, progress)
            except UserError as e:
                if self.calibrate_set:
                    raise
                # the preset asked for calibration, the caller did not: its own values, said in one line
                print(f"InfiniGen not calibrated ({e}); the {self.preset} preset's settings apply", file=sys.stderr)
        if self.crossing["source"] not in ("set", "preset"):
            self._resolve_dense_below(model, progress, longest)
        return self

    def _resolve_dense_below(self, model, progress: bool, longest: int | None = None) -> None:
        """`dense_below` from where selection pays on this machine (policies/crossing.py): stored, else measured
        now (a few seconds) and stored. Once per model and settings in a process. A run that caches fewer tokens
        than the shortest length measured (`longest`) measures nothing and reads densely (not remembered: a
        longer run in the same process measures)."""
        from .crossing import measure_crossing
        object.__setattr__(self, "dense_below", None)
        key = json.dumps({k: v for k, v in self.settings(model).items() if k not in ("dense_below_source", "crossing")},
                         sort_keys=True, default=str)
        memo = _CROSSINGS.setdefault(model, {})
        if key not in memo:
            found = measure_crossing(model, self, log=(lambda m: print(m, file=sys.stderr)) if progress else None,
                                     longest=longest)
            if found["source"].startswith("not measured (this run"):
                object.__setattr__(self, "dense_below", found["dense_below"])
                object.__setattr__(self, "crossing", found)
                return
            memo[key] = found
            if memo[key]["source"] == "measured" or progress:
                print(f"InfiniGen reads densely below {memo[key]['dense_below']} cached tokens "
                      f"({memo[key]['source']}: where its selection pays on this machine)", file=sys.stderr)
        object.__setattr__(self, "dense_below", memo[key]["dense_below"])
        object.__setattr__(self, "crossing", dict(memo[key]))

    # ---- per-model calibration -----------------------------------------------------------
    def _calibration_setup(self, model) -> dict:
        """What the search varies and what it keeps, for `model`: a function of the caller's knobs only."""
        from .calibrate import ALPHA_HIGH, ALPHA_LOW
        base, given = self.base, self.given
        structures = [{}]
        if not ({"exact_first", "dense_layers"} & given) and not model.cfg.local(0):
            # layer 0 selected with its exact query (every layer selects), or read densely (layer 1 speculated
            # from layer 0's output): which one costs less accuracy per entry read depends on the model
            structures = [{"exact_first": True, "dense_layers": []}, {"exact_first": False, "dense_layers": [0]}]
        elif not ({"exact_first", "dense_layers"} & given):
            # a local layer 0 reads its window whatever the policy: speculate every global layer
            structures = [{"exact_first": False, "dense_layers": []}]
        alphas = () if "alpha" in given else (ALPHA_HIGH, ALPHA_LOW)
        # a per-layer cap or a budget the caller gave is the bound; otherwise the search chooses kv_budget
        budget_free = not ({"kv_budget", "max_fetch_ratio"} & given)
        growth = base["budget_growth"] if "budget_growth" in given else CALIBRATE_GROWTH
        # (dense_below: the search measures selection at every length, whatever it is)
        # (key_centre off: left out, so the choices stored before the knob existed keep their keys)
        fixed = {k: v for k, v in base.items() if (k not in CALIBRATED or k in given) and k != "dense_below"
                 and not (k == "key_centre" and v is False)}
        # the remainder needs the int4 keys' scores (on the attention's scale)
        remainder = "remainder" not in given and base["key_mode"] == "int4"
        # where the target is out of reach: the other ways of counting the budget (per KV head), tried last
        budgets = [] if "budget" in given else [b for b in ("union", "per_head") if b != base["budget"]]
        return dict(structures=structures, alphas=alphas, budget_free=budget_free, growth=growth, fixed=fixed,
                    remainder=remainder, budgets=budgets, own_query=base["query"] != "ahead")

    def _remainder_starts(self, model, knobs: dict, growth: float) -> list[int]:
        """The layers from which calibration tries adding the remainder: the caller's `remainder_from`, else
        0 and the layer after the first selecting one (a model's first selecting layer may attend unlike the
        rest: SmolLM2's layer 0 lost about 3 points with it on Mansfield Park: +3.00% against +0.17% from layer 1)."""
        if "remainder_from" in self.given:
            return [self.remainder_from]
        selecting = self._candidate(model, knobs, growth).selecting_layers(model.cfg)
        return [0] + [selecting[0] + 1] * (len(selecting) > 1)

    def _candidate(self, model, knobs: dict, growth: float) -> "InfiniGen":
        """The policy of a calibration candidate: the caller's knobs, the preset's for the rest, `knobs` on top."""
        over = dict(knobs)
        if "dense_layers" in over:
            over["dense_layers"] = tuple(over["dense_layers"])
        if "kv_budget" in over:
            over.update(max_fetch_ratio=None, budget_growth=growth)
        pol = dataclasses.replace(InfiniGen(**self.base), calibrate=False, dense_below=0, **over)
        if self.matrices is not None:
            pol.with_skew(self.matrices)
        return pol

    def _calibrate(self, model, tokenizer, progress) -> None:
        import hashlib
        import json
        import sys

        from ..paths import load_text
        from ..skew import key_fingerprint, remember, shipped_holding
        from . import calibrate as cal
        setup = self._calibration_setup(model)
        target = self.calibrate_target or CALIBRATE_TARGET
        bound = self.calibrate_bound or CALIBRATE_BOUND
        text = self.calibrate_text or CALIBRATE_TEXT
        ref = self.budget_ref
        if tokenizer is None:
            tokens = None
        else:
            tokens = cal.calibration_tokens(tokenizer, load_text(text), ref)
            if tokens.shape[1] < ref:
                raise UserError(f"calibration text {text!r} holds {tokens.shape[1]} tokens, fewer than budget_ref "
                                f"({ref}) the calibration runs over")
        if ref > model.cfg.max_position:
            raise UserError(f"budget_ref ({ref}) exceeds the model's {model.cfg.max_position} positions: "
                            "calibration runs over budget_ref tokens")
        skew = _SKEWS.get(model, {}).get(self.calib) if self._needs_skew(model) else None
        what = {"format": cal.FORMAT, "fingerprint": key_fingerprint(model), "target": target,
                "bound": bound, "ref": ref, "text": text, "setup": {k: v for k, v in setup.items() if k != "fixed"},
                "fixed": {k: str(v) for k, v in sorted(setup["fixed"].items())},
                "tokens": None if tokens is None else hashlib.sha256(tokens.numpy().tobytes()).hexdigest()}
        key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
        memo = _CHOICES.setdefault(model, {})
        # the settings' source: "shipped" (the package's artifact), "cached" (the cache's), "computed" (searched
        # in this process)
        choice, source = memo.get(key, (None, None))
        meta = getattr(skew, "meta", None)
        name = f"calibration-{key}"
        # the skew in use holds the choice, else the package's artifact for this model does (a cache written by an
        # earlier version holds other matrices): then the package's matrices and choice are used together
        twin = None
        if meta is not None and name not in meta and not getattr(skew, "computed_now", False):
            twin = shipped_holding(model, name)  # the key names the skew's calibration text too
        for found in (skew, twin):
            found_meta = getattr(found, "meta", None)
            if choice is not None or found_meta is None or name not in found_meta:
                continue
            try:
                choice = cal.Choice.from_dict(json.loads(found_meta[name]), key, set(CALIBRATED))
                self._candidate(model, choice.knobs, setup["growth"])  # knobs a policy accepts
                source = "shipped" if getattr(found, "shipped", False) else "cached"
                if found is twin:
                    _SKEWS.setdefault(model, {})[self.calib] = twin
            except (ValueError, TypeError, KeyError, UserError):
                choice = None  # foreign or broken metadata: search again, never trust it
        if choice is None:
            if tokens is None:
                raise UserError("InfiniGen's calibration needs the tokenizer: give prepare() the tokenizer "
                                "(or set the knob calibrate=false)")
            log = (lambda m: print(m, file=sys.stderr)) if progress else None
            if log:
                log(f"calibrating InfiniGen's settings on {text} ({ref} tokens; target {100 * target:g}%, "
                    f"bound {100 * bound:g}% of the KV)")
            prefill = max(1, ref // 8)
            try:
                choice = cal.search(model, tokens, prefill, lambda k: self._candidate(model, k, setup["growth"]),
                                    setup["structures"], setup["alphas"], setup["budget_free"], target, bound,
                                    setup["growth"], ref, key, text, log=log,
                                    remainder_starts=(lambda k: self._remainder_starts(model, k, setup["growth"]))
                                    if setup["remainder"] else None, progress=progress,
                                    own_query=setup["own_query"], budgets=tuple(setup["budgets"]))
            except ValueError as e:
                raise UserError(f"cannot calibrate InfiniGen under a bound of {100 * bound:g}% of the KV ({e}): "
                                "raise calibrate_bound, or keep fewer layers dense")
            source = "computed"
            if meta is not None:
                remember(skew, name, json.dumps(choice.to_dict()))
        memo[key] = (choice, source)
        self._apply(choice, setup, source)
        object.__setattr__(self, "calibrated_on", weakref.ref(model))
        print(f"InfiniGen calibrated ({source}): {self.calibration['summary']}", file=sys.stderr)
        if not choice.reached:
            print(f"warning: {self.calibration['warning']}", file=sys.stderr)

    def _apply(self, choice, setup: dict, source: str) -> None:
        """Set the chosen knobs on this policy (from the values before calibration) and record the choice."""
        for k, v in self.base.items():
            object.__setattr__(self, k, v)
        for k, v in choice.knobs.items():
            object.__setattr__(self, k, tuple(v) if k == "dense_layers" else v)
        if "kv_budget" in choice.knobs:
            object.__setattr__(self, "max_fetch_ratio", None)
            object.__setattr__(self, "budget_growth", setup["growth"])
        self.validate()
        varied = set(choice.knobs) | ({"max_fetch_ratio", "budget_growth"} if "kv_budget" in choice.knobs else set())
        chosen = {k: jsonable(getattr(self, k)) for k in CALIBRATED if k in varied}
        vs_full = choice.loss_vs_full()
        summary = (", ".join(f"{k} {v}" for k, v in chosen.items())
                   + f" -> {100 * vs_full:+.2f}% vs the full cache, {100 * choice.kv:.1f}% of the KV read on "
                   f"{choice.tokens} tokens of {choice.text} (target {100 * choice.target:g}%: "
                   f"{'reached' if choice.reached else 'not reached under the bound'}; bound {100 * choice.bound:g}%)")
        warning = None if choice.reached else (
            f"InfiniGen's calibration did not reach its target: {100 * vs_full:+.2f}% vs the full cache (target "
            f"{100 * choice.target:g}%) with the lowest loss under the bound of {100 * choice.bound:g}% of the KV ("
            + ", ".join(f"{k} {v}" for k, v in chosen.items()) + f"; {len(choice.trials)} settings tried); raise "
            "calibrate_bound or calibrate_target, or set the knobs by hand")
        record = {"chosen": chosen, "set": sorted(self.given), "reached": choice.reached, "warning": warning,
                  "vs_full": vs_full, "kv": choice.kv, "kv_caps": choice.kv_caps, "kv_caps_long": choice.kv_caps_long,
                  "target": choice.target, "bound": choice.bound, "text": choice.text, "tokens": choice.tokens,
                  "prefill": choice.prefill, "key": choice.key, "source": source, "summary": summary,
                  "trials": [{"knobs": t["knobs"], "vs_full": math.exp(t["nll"] - choice.reference_nll) - 1,
                              "kv": t["kv"]} for t in choice.trials]}
        object.__setattr__(self, "calibration", record)

    def _skew_matrices(self, model):
        if not self._needs_skew(model):
            return None
        m = self.matrices
        if m is None:
            m = _SKEWS.get(model, {}).get(self.calib)
            if m is None:
                self.prepare_skew(model)  # the cached artifact, or a clear error
                m = _SKEWS[model][self.calib]
        m = getattr(m, "matrices", m)
        cfg = model.cfg
        if tuple(m.shape) != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim):
            raise UserError(f"skew matrices of shape {tuple(m.shape)} do not fit this model")
        return m.to(device=model.device, dtype=torch.float64)

    def _layer_sparsity(self, model):
        """The calibrated attention sparsity per layer of the skew in use (None: uniform layer caps; an
        artifact of format 1, matrices given as a bare tensor, or skew off)."""
        m = self.matrices
        if m is None and self._needs_skew(model):
            m = _SKEWS.get(model, {}).get(self.calib)
        if m is None:
            m = getattr(model, "skew_folded", None)
        sp = getattr(m, "sparsity", None)
        return None if sp is None or len(sp) != model.cfg.num_layers else [float(x) for x in sp]

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
        sel = [j for j, i in enumerate(counted) if self.speculated(i)]
        if self.kv_budget is None:
            return {counted[j]: self.max_fetch_ratio for j in sel}
        share = self.budget_at(self.budget_ref if cached is None else cached)
        if n - len(sel) >= share * n:
            # the dense layers asked for alone read more than the bound: it cannot hold, so each selecting
            # layer reads at most kv_budget of its entries (the paper's per-layer reading of the cap)
            return {counted[j]: share for j in sel}
        sparsity = self._layer_sparsity(model)
        caps = layer_caps(n, sel, share, None if sparsity is None else [sparsity[i] for i in counted],
                          self.budget_power)
        return {counted[j]: c for j, c in caps.items()}

    def _cap(self, st: InfiniGenState, model, layer: int, cached: int) -> float:
        """Layer's cap at `cached` tokens; with a growth below 1 the caps of the last length asked are kept
        (every layer of a decoding step asks at the same length)."""
        if self.budget_growth == 1 or self.kv_budget is None:
            return st.caps[layer]
        if st.caps_for_length[0] != cached:
            st.caps_for_length = (cached, self.layer_caps(model, cached))
        return st.caps_for_length[1][layer]

    # ---- per-request state ----------------------------------------------------------------------
    def begin(self, model, session) -> InfiniGenState:
        cfg = model.cfg
        d = cfg.head_dim
        # a measured crossing was measured in fast memory: an offloaded store selects at every length
        measured = self.crossing["source"] not in ("set", "preset")
        st = InfiniGenState(
            A=self._skew_matrices(model), alpha=self.alpha_for(cfg),
            dense_below=0 if measured and session.store.offloaded else self.dense_below or 0,
            # a local layer of a model mixing local and global layers reads its window (`Session.selects`)
            spec_layers=set(self.selecting_layers(cfg)),
            cols=d if self.key_mode == "int4" else max(1, math.ceil(self.partial_ratio * d)),
            caps=self.layer_caps(model))
        if self.key_mode == "int4":
            st.layout = int4_layout(d, session.store.capacity, model.device)
            st.lazy_keys = st.dense_below > 0 and type(session.store) is KVStore
        else:
            # the model's dtype (the keys' own precision: at r = 1 the speculation is exact). In float32 the
            # partial columns are 30% of K, 15.6% of K+V: the paper's 8% budget assumes 16-bit models, and
            # storing them in bfloat16 would make float32 speculation inexact; the int4 default meets it.
            st.key_dtype = model.dtype
        offloaded = session.store.offloaded
        st.own_query = self.query == "own" or (self.query == "auto" and not offloaded)
        # the running sums cannot follow a pool's victims (an append overwrites a value they hold) nor a window.
        # Under "auto" on an offloaded tier the query is the speculated one, with which the remainder was measured
        # to cost accuracy on both models (results/accuracy.md): there it is used only when the caller set it
        rest = self.remainder and (st.own_query or self.query == "ahead" or "remainder" in self.given)
        st.with_rest = rest and cfg.sliding_window is None and session.store.allocator is None
        return st

    @staticmethod
    def speculation_bytes(state) -> int:
        """The per-request speculation state kept for the whole request: the partial or packed key cache
        (codes, scales, minima), the partial indices and the partial weights."""
        keys = sum(p.nbytes if isinstance(p, PackedKeys) else tensor_bytes(p) for p in state.spec_keys.values())
        return keys + tensor_bytes(state.idx) + tensor_bytes(state.proj)

    def fast_tier_bytes(self, state) -> dict:
        """The speculation state (`speculation_bytes`), the skew `A` (model-wide) and the transient
        queries and plans."""
        out = {"speculation": self.speculation_bytes(state),
               "remainder": tensor_bytes(state.value_sums) + tensor_bytes(state.value_counts)}
        out.update({k: tensor_bytes(getattr(state, k)) for k in ("A", "spec")})
        return {k: v for k, v in out.items() if v}

    def _adds_rest(self, st: InfiniGenState, layer: int) -> bool:
        """Whether `layer`'s selection adds what it leaves unread (`remainder`, `remainder_from`)."""
        return st.with_rest and layer >= self.remainder_from

    def speculated(self, layer: int) -> bool:
        return (layer >= 1 or self.exact_first) and layer not in self.dense_layers

    def selecting_layers(self, cfg) -> list[int]:
        """The layers this policy selects on a model of `cfg`: speculated ones that are not local window
        layers of a model mixing local and global layers (those read their window: `Session.selects`)."""
        return [i for i in range(cfg.num_layers) if self.speculated(i) and not cfg.local(i)]

    def memory_report(self, model, state: InfiniGenState, kv_bytes: int) -> dict:
        """The speculation state relative to the KV bytes of the layers it covers (`kv_bytes` is the full
        cache of every layer) and the skew matrices and partial weights relative to the weights."""
        spec = self.speculation_bytes(state)
        cfg = model.cfg
        covered = kv_bytes * len(state.spec_layers) / cfg.num_layers if kv_bytes else 0
        weights = weight_bytes(model)  # tied weights counted once
        skew = tensor_bytes(state.A)
        return {"speculation_bytes": spec, "speculation_vs_kv": spec / covered if covered else None,
                "partial_key_cache_bytes": spec - tensor_bytes(state.idx) - tensor_bytes(state.proj),
                "partial_weight_bytes": tensor_bytes(state.proj), "index_bytes": tensor_bytes(state.idx),
                "skew_bytes": skew, "skew_vs_weights": skew / weights, "int4_layout": state.layout}

    # ---- projections ------------------------------------------------------------------------------
    # Everything the speculation multiplies is computed in float64 and rounded to float32 once: the
    # vectorized (teacher-forced) and the row-by-row (decoding) paths then agree to the last bit whatever
    # the matmul shapes. The operands are small (a token's key, a step's query: [B, Hkv, G, d] against
    # d x d or d x cols), so float64 costs microseconds per layer next to the scoring.
    @staticmethod
    def _rotate(st: InfiniGenState, x: torch.Tensor, layer: int) -> torch.Tensor:
        """x [B, Hkv, ..., d] -> x A[layer, kv head] in float32."""
        x = x.to(torch.float64)
        if st.A is None:
            return x.float()
        # one bmm per KV head over every row: broadcasting A over [B, ..., G] would copy it per row
        # (measured at B 8, G 3, d 64: 0.2 ms against 1.3 ms per layer and step, on a loaded 2-core CPU;
        # float32 would save another 0.09 ms but could round differently for other row counts)
        b, h, d = x.shape[0], x.shape[1], x.shape[-1]
        y = torch.bmm(x.reshape(b, h, -1, d).transpose(0, 1).reshape(h, -1, d), st.A[layer])
        return y.view(h, b, -1, d).transpose(0, 1).reshape(x.shape).float()

    def _project(self, st: InfiniGenState, x: torch.Tensor, layer: int) -> torch.Tensor:
        """x [B, Hkv, ..., d] -> what speculation multiplies, float32: all skewed columns (int4), or the
        partial ones: x @ A[layer][:, idx] with the precomputed partial weights (one d x cols matmul
        instead of a d x d rotation and a gather). For the Llama family RoPE sits between W_Q and A, so
        the partial weights apply to the post-RoPE query: W_Q itself cannot be sliced exactly. A model with
        the skew folded into W_Q and W_K (`skew.skew_model`, OPT) has no A: its query columns are gathered.
        Slicing its W_Q~ instead would need a copy per request row (the index is per row and KV head):
        [B, H, hidden, cols] in the model's dtype, at OPT-6.7B and batch 8 some 80 MB per layer, 30% of
        a 2048-token KV cache, to save a projection that costs one hidden x d matmul per step."""
        if self.key_mode == "int4":
            return self._rotate(st, x, layer)
        w = st.proj.get(layer)
        if w is None:
            idx = st.idx[layer]
            idx = idx.view(*idx.shape[:2], *([1] * (x.dim() - 3)), idx.shape[-1])
            return x.gather(-1, idx.expand(*x.shape[:-1], idx.shape[-1])).float()
        y = x.reshape(*x.shape[:2], -1, x.shape[-1]).to(torch.float64) @ w.to(torch.float64)  # [B, Hkv] batches
        return y.view(*x.shape[:-1], w.shape[-1]).float()

    # ---- sparse only where it pays (dense_below) --------------------------------------------------
    # A row's cached length is its position: the real tokens before it, the same number in decoding (left
    # padding aside) and in teacher-forced scoring, so both read densely at the same rows. Each row is decided
    # alone (a row below the threshold keeps everything even when the rows beside it select): a row's
    # tokens never depend on what else is in the batch, and a mixed step only happens while the rows of a
    # batch straddle the threshold, at most as many steps as their prompts differ in length.
    def _lengths(self, session) -> tuple:
        """Per token of the current pass: the fewest and the most cached tokens over the batch's rows."""
        st, pos = session.state, session.positions
        if st.lengths[0] is not pos:  # a new pass (a step, a replay, a teacher-forced sequence)
            st.lengths = (pos, pos.amin(0).tolist(), pos.amax(0).tolist())
        return st.lengths[1], st.lengths[2]

    def _dense_pass(self, session) -> bool:
        """Every row of the current pass is below `dense_below`: nothing to speculate, every layer reads ALL."""
        below = session.state.dense_below
        return below > 0 and max(self._lengths(session)[1]) < below

    def _dense_rows(self, session, row: int) -> torch.Tensor | None:
        """Bool [B]: the batch's rows below `dense_below` at token `row` of the pass; None when there is none."""
        below = session.state.dense_below
        if below == 0 or self._lengths(session)[0][row] >= below:
            return None
        return session.positions[:, row] < below

    # ---- hooks ----------------------------------------------------------------------------------
    def continues_prefill(self) -> bool:
        # 4-bit speculation keys are built from the keys alone; the partial columns' vote reads the queries
        return self.key_mode == "int4"

    def on_prefill(self, layer, q, k, v, session):
        st = session.state
        if layer not in st.spec_layers:
            return
        b, h, t, d = q.shape
        hkv = k.shape[1]
        store = session.store
        st.ready.discard(layer)
        if self._adds_rest(st, layer) and not st.lazy_keys:  # over the keys' length: a continued prefill's q
            # holds only the rest (lazy_keys: summed from the store at the first step that selects)
            valid = store.valid[layer][:, :, :k.shape[2]]
            st.value_sums[layer] = (v.float() * valid[..., None]).sum(2)
            st.value_counts[layer] = valid.sum(-1)
        if st.lazy_keys:
            st.spec_keys.pop(layer, None)  # built from the store at the first step that selects
            return
        if self.key_mode == "int4":
            spec_keys = PackedKeys(b, hkv, store.capacity, d, group=INT4_GROUP, layout=st.layout, device=k.device)
            spec_keys.write(0, self._centre(st, layer, self._rotate(st, k, layer),
                                             store.valid[layer][:, :, :k.shape[2]]))
            st.spec_keys[layer] = spec_keys
            return
        w = store.valid[layer][:, :, :t, None].float()  # pad tokens of left-padded prompts do not vote
        qs = self._rotate(st, q.view(b, hkv, h // hkv, t, d), layer).abs()
        ks = self._rotate(st, k, layer)
        colsum = (qs * w[:, :, None]).sum((2, 3)) + (ks.abs() * w).sum(2)  # [B, Hkv, d]
        idx = colsum.topk(st.cols, dim=-1).indices.sort(-1).values
        st.idx[layer] = idx
        if st.A is not None:  # the partial weights: the skew's columns idx, per (row, KV head)
            a = st.A[layer].expand(b, hkv, d, d)
            # kept in the model's dtype, like W_Q (float32 would add cols/capacity of the KV bytes)
            st.proj[layer] = a.gather(-1, idx[:, :, None, :].expand(b, hkv, d, st.cols)).to(st.key_dtype)
        spec_keys = torch.zeros(b, hkv, store.capacity, st.cols, dtype=st.key_dtype, device=k.device)
        spec_keys[:, :, :t] = self._project(st, k, layer).to(st.key_dtype)
        st.spec_keys[layer] = spec_keys

    def on_hidden(self, layer, point, x, session):
        st, model = session.state, session.model
        if point == "embed":
            self._layer0_ahead(x, session)
            return
        target = layer + 1
        if (point != self.spec_input or target not in st.spec_layers or st.own_query
                or self._dense_pass(session)):
            return
        if point == "attn_out" and model.cfg.pre_norm:
            x = model.layers[target].attn_norm(x)  # layer i's own input norm of the residual
        q = model.query(target, x, session.positions)  # [B, H, T, d], post-RoPE
        b, h, t, d = q.shape
        hkv = model.cfg.num_kv_heads
        for old in [i for i in st.spec if i < layer]:  # their attention has run
            del st.spec[old]
        # kept as is and projected per row when scored: at prefill the partial weights do not exist yet
        st.spec[target] = q.view(b, hkv, h // hkv, t, d)
        if t == 1 and (target in st.spec_keys or st.lazy_keys):
            self._spec_keys(st, target, session)
            # decoding: the selection is known one layer ahead, so its transfer can start now;
            # layer `target`'s partial keys do not change before its own attention
            st.ready.add(target)

    def _layer0_ahead(self, h, session) -> None:
        """exact_first: layer 0's exact query is known once a decoding step's tokens are
        embedded (its input is the embedding, normed), so its selection is made then and placement fetches
        layer 0's rows while nothing else waits: every layer is then prefetched on an offloaded tier. The
        same query as the layer's own (the same projection of the same input), so the same selection."""
        st, model = session.state, session.model
        if (0 not in st.spec_layers or st.own_query or self._dense_pass(session)
                or not (0 in st.spec_keys or st.lazy_keys)):
            return
        block = model.layers[0]
        x = block.attn_norm(h) if model.cfg.pre_norm else h
        q = model.query(0, x, session.positions)  # [B, H, T, d], post-RoPE
        b, nh, t, d = q.shape
        hkv = model.cfg.num_kv_heads
        st.spec[0] = q.view(b, hkv, nh // hkv, t, d)
        if t == 1:
            self._spec_keys(st, 0, session)
            st.ready.add(0)

    def known_ahead(self, layer, session) -> bool:
        """Once this step's speculation for `layer` has run (placement fetches its rows meanwhile), or at
        once when the step reads densely (`dense_below`): the plan is ALL."""
        return layer in session.state.ready or self._dense_pass(session)

    def keep(self, layer, rows, session):
        st = session.state
        st.rest.pop(layer, None)
        if rows.in_store:
            if self._dense_pass(session):
                return ALL
            keep = self._decoding_row(layer, rows, session)
            if not isinstance(keep, SelectedRows):
                keep = keep[:, :, None]
        elif st.rows_in_blocks:
            keep = self._rows_in_blocks(layer, rows, session)
        else:
            keep = self._sequence_rows(layer, rows, session)
        lse = st.rest.pop(layer, None)
        if lse is not None and not rows.in_store:  # teacher-forced: the runtime sums the sequence's values
            st.rest[layer] = Remainder(lse)
        elif lse is not None and (layer in st.value_sums or st.lazy_keys):  # decoding: the sums before this
            # step's append; with lazy_keys summed from the store the first time, as the keys are packed
            if layer not in st.value_sums:
                _, v, valid, _ = session.store.past(layer)
                st.value_sums[layer] = (v.float() * valid[..., None]).sum(2)
                st.value_counts[layer] = valid.sum(-1)
            st.rest[layer] = Remainder(lse, st.value_sums[layer], st.value_counts[layer])
        return keep

    def _decoding_row(self, layer, rows, session) -> torch.Tensor | SelectedRows:
        st = session.state
        st.ready.discard(layer)
        dense = self._dense_rows(session, rows.first)
        # no batch row below dense_below: the answer may be the packed rows themselves
        keep = self._speculated_row(layer, rows, session, packs=rows.packs and dense is None)
        if dense is None:
            return keep
        if layer in st.rest:  # a row reading everything leaves nothing unread
            st.rest[layer] = st.rest[layer].masked_fill(dense[:, None, None, None], float("-inf"))
        return keep | dense[:, None, None]

    def unread(self, layer, session):
        """The unread entries' log-mass of the rows `keep` last answered at `layer` and, while decoding, the
        running value sums (teacher-forced scoring sums the sequence's values in the runtime)."""
        return session.state.rest.pop(layer, None)

    @staticmethod
    def _unread_lse(s: torch.Tensor, unread: torch.Tensor) -> torch.Tensor:
        """Scaled speculated scores s [B, Hkv, G, R, S] and the unread entries [B, Hkv, R, S] -> the log of
        their attention mass [B, Hkv, G, R] (-inf where none is unread)."""
        return torch.logsumexp(s.masked_fill(~unread[:, :, None], float("-inf")), -1)

    def _speculated_row(self, layer, rows, session, packs: bool = False) -> torch.Tensor | SelectedRows:
        st = session.state
        # the layer's own query at its attention (row `rows.first` of a view): layer 0 with exact_first when
        # its selection was not made at the embedding, every layer with `own_query`
        if (layer == 0 or st.own_query) and rows.query is not None:
            q = rows.query
            b, h, _, d = q.shape
            hkv = session.model.cfg.num_kv_heads
            st.spec[layer] = q.view(b, hkv, h // hkv, 1, d).expand(b, hkv, h // hkv, rows.first + 1, d)
        return self._select_row(layer, rows.first, session, packs)

    def on_append(self, layer, slots, k, v, session):
        st = session.state
        if layer in st.value_sums:
            st.value_sums[layer] += v[:, :, 0].float()
            st.value_counts[layer] += 1
        if layer not in st.spec_layers or layer not in st.spec_keys:  # not built yet (lazy_keys)
            return
        spec_keys = st.spec_keys[layer]
        if self.key_mode == "int4":
            spec_keys.scatter(slots, self._centre(st, layer, self._rotate(st, k, layer)))
            return
        rows = self._project(st, k, layer).to(st.key_dtype)  # [B, Hkv, 1, cols]
        idx = slots[:, :, None, None].expand(*slots.shape, 1, spec_keys.shape[-1])
        if spec_keys.element_size() == 2:  # 16-bit floats moved as int16: scatter_ on them is slow in torch 2.13
            spec_keys, rows = spec_keys.view(torch.int16), rows.view(torch.int16)
        spec_keys.scatter_(2, idx, rows)

    def _spec_keys(self, st: InfiniGenState, layer: int, session):
        """The keys speculation scores `layer` against; with `lazy_keys`, packed from the store's keys the
        first time (the same rotation and packing per token as a prefill's and an append's)."""
        keys = st.spec_keys.get(layer)
        if keys is None and st.lazy_keys:
            store = session.store
            k, _, valid, _ = store.past(layer)
            b, hkv, _, d = k.shape
            keys = PackedKeys(b, hkv, store.capacity, d, group=INT4_GROUP, layout=st.layout, device=k.device)
            keys.write(0, self._centre(st, layer, self._rotate(st, k, layer), valid))
            st.spec_keys[layer] = keys
        return keys

    def _centre(self, st: InfiniGenState, layer: int, keys: torch.Tensor, valid: torch.Tensor | None = None):
        """key_centre: rotated keys [B, Hkv, T, d] less the layer's mean key, first set from the `valid` ones
        [B, Hkv, T] when given; without key_centre the keys as they are."""
        if not self.key_centre:
            return keys
        if valid is not None:
            w = valid[..., None].float()
            st.key_mean[layer] = (keys * w).sum(2, keepdim=True) / w.sum(2, keepdim=True).clamp(min=1)
        return keys - st.key_mean[layer]

    def _shifted(self, st: InfiniGenState, layer: int, scores: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
        """Scores [B, Hkv, R, n] of queries qs [B, Hkv, R, d] against centred keys plus q . mean key: the
        scores of the keys themselves (what the remainder's mass needs)."""
        if not self.key_centre:
            return scores
        return scores + (qs * st.key_mean[layer]).sum(-1, keepdim=True)

    # ---- selection ------------------------------------------------------------------------------
    def _spec_rows(self, st: InfiniGenState, layer: int, rows: slice) -> torch.Tensor:
        """Projected speculative queries [B, Hkv, G, R, c] (float32) of decoding rows `rows`."""
        qs = st.spec.get(layer)
        if qs is None:
            raise RuntimeError(f"no speculation for layer {layer} (the hook of layer {layer - 1} did not run)")
        return self._project(st, qs[:, :, :, rows], layer)

    @staticmethod
    def _window(cfg, valid, pos, cur):
        w = cfg.sliding_window
        return valid if w is None else valid & (cur - pos < w)

    def _scores(self, st: InfiniGenState, layer: int, row: int, spec_keys, n: int) -> torch.Tensor:
        """Speculated scores [B, Hkv, G, n] (float32) of decoding row `row` against the first n slots of
        the partial or packed keys, the same calls on both paths (decoding and `_sequence_rows`), so they
        agree bit for bit. int4: torch's int4 kernel or the tiled scorer read the packed codes (no float
        copy of the context). partial: one matmul per row in the keys' 16-bit dtype; the G query heads
        are the matmul rows (broadcasting the keys over G copied them G times)."""
        qs = self._spec_rows(st, layer, slice(row, row + 1))[:, :, :, 0].contiguous()  # [B, Hkv, G, c]
        if isinstance(spec_keys, PackedKeys):
            return self._shifted(st, layer, spec_keys.scores(qs, n), qs)
        k = spec_keys[:, :, :n]
        return (qs.to(k.dtype) @ k.transpose(-1, -2)).float()

    def _select_row(self, layer: int, row: int, session, packs: bool = False) -> torch.Tensor | SelectedRows:
        """Selection [B, Hkv, S] over the store's slots for decoding row `row`; with `packs` (the runtime reads
        packed rows, every used slot valid) and the fused kernel built, budget "layer" makes the packed rows
        and the remainder's log-sum-exp in one C++ call (`fused_select.select_packed`: the same cut)."""
        st, store, model = session.state, session.store, session.model
        n = store.length[layer]
        spec_keys = self._spec_keys(st, layer, session)
        scores = self._scores(st, layer, row, spec_keys, n)  # [B, Hkv, G, S]
        cap = self._cap(st, model, layer, n)
        rest = self._adds_rest(st, layer)
        if packs and not store.padded and model.cfg.sliding_window is None and self._fuses_selection(scores):
            total = self._layer_total(cap, n, scores.shape[1], n)
            keep, rows, head, counts, lse = fused_select.select_packed(scores, model.scale, st.alpha, total,
                                                                       store.capacity, rest)
            if rest:
                st.rest[layer] = lse[..., None]
            return SelectedRows(keep, rows, head, counts)
        scores = scores[:, :, :, None]  # [B, Hkv, G, 1, S]
        valid = store.valid[layer][:, :, :n]
        cur = session.positions[:, row]
        valid = self._window(model.cfg, valid, store.pos[layer][:, :, :n], cur[:, None, None])
        # every row has n valid tokens unless a prompt was padded or a window hides some: then the caps
        # are known on the host and the selection needs no synchronization (see `_choose`)
        shared_length = n if not store.padded and model.cfg.sliding_window is None else None
        s = scores * model.scale
        keep = self._choose(s.clone() if rest else s, valid[:, :, None, :], st.alpha, shared_length, cap)
        if rest:  # `_choose` worked on a copy: s holds the scores
            st.rest[layer] = self._unread_lse(s, valid[:, :, None, :] & ~keep)
        return keep[:, :, 0]

    def _sequence_rows(self, layer, rows, session):
        """All decoding rows of `layer` at once (teacher-forced): the same selection as `_select_row`
        makes for each row, with the keys of every earlier position in the partial or packed key cache."""
        st, model = session.state, session.model
        q, k = rows.query, rows.keys
        p, t = rows.first, k.shape[2]
        b, hkv, _, d = k.shape
        dev = k.device
        if self._dense_pass(session):
            return ALL
        # rows before `first` have every batch row below dense_below: they keep everything, nothing is scored
        most = self._lengths(session)[1]
        first = next(r for r in range(p, t) if most[r] >= st.dense_below)
        if layer == 0 or st.own_query:  # the rows' own queries (rows before p are never scored)
            h = q.shape[1]
            st.spec[layer] = torch.cat([q[:, :, :1].expand(b, h, p, d), q], 2).view(b, hkv, h // hkv, t, d)
        if self.key_mode == "int4":
            spec_keys = PackedKeys(b, hkv, t, d, group=INT4_GROUP, layout=st.layout, device=dev)
            # centred on the keys decoding packs first: the prompt's, or (lazy_keys) those before the first row
            # that selects
            before = torch.arange(t, device=dev) < (first if st.lazy_keys else p)
            spec_keys.write(0, self._centre(st, layer, self._rotate(st, k, layer), before.expand(b, hkv, t)))
        else:
            spec_keys = self._project(st, k, layer).to(st.key_dtype)  # [B, Hkv, T, c]
        batched = isinstance(spec_keys, PackedKeys) and spec_keys.layout == "tinygemm"
        every, block = None, (first, first)
        # each score of the int4 kernel is its own dot product, the same bits whatever the other rows of the
        # call: score a block of rows in one call and cut per row (blocks of at most SCORE_BLOCK scores: at
        # 32K tokens all rows at once would be 15 GB, and past 2**31 scores the kernel faults)
        rows_per_block = max(1, SCORE_BLOCK // max(1, b * q.shape[1] * t))
        out = torch.zeros(b, hkv, t - p, t, dtype=torch.bool, device=dev)
        out[:, :, :first - p] = True  # the runtime keeps each row's past of these
        rest = None
        if self._adds_rest(st, layer):  # rows before `first` read everything: nothing unread
            rest = torch.full((b, hkv, q.shape[1] // hkv, t - p), float("-inf"), device=dev)
        for r in range(first, t):
            # row r sees the r cached tokens before it: the same shapes, so the same float32 numbers,
            # as `_select_row` when decoding (row by row: the selection's reductions depend on shapes)
            valid = self._window(model.cfg, torch.ones(b, hkv, 1, r, dtype=torch.bool, device=dev),
                                 torch.arange(r, device=dev), r)
            if batched and r >= block[1]:
                block = (r, min(t, r + rows_per_block))
                qs = self._spec_rows(st, layer, slice(*block))  # [B, Hkv, G, R, d]
                g = qs.shape[2]
                flat = qs.reshape(b, hkv, g * (block[1] - r), d).contiguous()
                every = self._shifted(st, layer, spec_keys.scores(flat, block[1]), flat)
                every = every.view(b, hkv, g, block[1] - r, block[1])
            if every is not None:
                scores = every[:, :, :, r - block[0], None, :r]
            else:
                scores = self._scores(st, layer, r, spec_keys, r)[:, :, :, None]  # [B, Hkv, G, 1, r]
            shared_length = r if model.cfg.sliding_window is None else None
            cap = self._cap(st, model, layer, r)
            s = scores * model.scale
            row = self._choose(s.clone() if rest is not None else s, valid, st.alpha, shared_length, cap)[:, :, 0]
            dense = self._dense_rows(session, r)
            if dense is not None:
                row |= dense[:, None, None]
            out[:, :, r - p, :r] = row
            if rest is not None:
                rest[:, :, :, r - p] = self._unread_lse(s, valid & ~row[:, :, None])[..., 0]
        if rest is not None:
            st.rest[layer] = rest
        return out

    def _fuses_selection(self, scores: torch.Tensor) -> bool:
        """Whether `fused_select.select_packed` makes this selection: budget "layer" slot by slot, scores on the
        CPU, the kernel built."""
        return (self.budget == "layer" and self.block <= 1 and scores.device.type == "cpu"
                and fused_select.packs_selection and fused_select.available())

    def _layer_total(self, ratio: float | None, shared_length: int, hkv: int, slots: int) -> int:
        """budget "layer"'s cap of a row that has `shared_length` valid tokens per KV head: the (KV head, slot)
        pairs it may read over the layer's `hkv` KV heads, at least `min_fetch` per KV head (`slots` slots)."""
        ratio = self.max_fetch_ratio if ratio is None else ratio
        floor = min(max(1, self.min_fetch), slots)
        # float32 arithmetic on a tensor, as `_choose` computes it where the lengths are data
        length = torch.tensor(shared_length).view(1, 1, 1)
        return int((ratio * (length * hkv)).floor().clamp(min=floor * hkv))

    def _rows_in_blocks(self, layer, rows, session, block: int = ROWS_PER_CHOICE):
        """`_sequence_rows` with the rows chosen `block` at a time (one `_choose` of each block, every row its
        own length and cap): the same selection up to float summation order over the block's longer rows,
        so not bit for bit the decoding path's, several times faster (calibration's scoring: `state.rows_in_blocks`).
        Where it does not apply (partial keys, `dense_below`, a query speculated ahead): `_sequence_rows`."""
        st, model = session.state, session.model
        q, k = rows.query, rows.keys
        if self.key_mode != "int4" or st.dense_below or q is None or not (layer == 0 or st.own_query):
            return self._sequence_rows(layer, rows, session)
        p, t = rows.first, k.shape[2]
        b, hkv, _, d = k.shape
        h = q.shape[1]
        g = h // hkv
        dev = k.device
        st.spec[layer] = torch.cat([q[:, :, :1].expand(b, h, p, d), q], 2).view(b, hkv, g, t, d)
        spec_keys = PackedKeys(b, hkv, t, d, group=INT4_GROUP, layout=st.layout, device=dev)
        spec_keys.write(0, self._rotate(st, k, layer))
        out = torch.zeros(b, hkv, t - p, t, dtype=torch.bool, device=dev)
        rest = torch.empty(b, hkv, g, t - p, device=dev) if self._adds_rest(st, layer) else None
        for r0 in range(p, t, block):
            r1 = min(t, r0 + block)
            n = r1 - 1  # the block's last row sees the most tokens
            qs = self._spec_rows(st, layer, slice(r0, r1))  # [B, Hkv, G, R, c]
            scores = spec_keys.scores(qs.reshape(b, hkv, g * (r1 - r0), d).contiguous(), n)
            s = scores.view(b, hkv, g, r1 - r0, n) * model.scale
            lengths = torch.arange(r0, r1, device=dev)
            valid = self._window(model.cfg, torch.arange(n, device=dev) < lengths[:, None], torch.arange(n, device=dev),
                                 lengths[:, None])[None, None]  # [1, 1, R, n]: row r sees the r tokens before it
            # each row's cap, [1, R]: `_choose` multiplies it by each row's length (float32, as a row's own call)
            caps = torch.tensor([[self._cap(st, model, layer, r) for r in range(r0, r1)]], dtype=torch.float32)
            keep = self._choose(s.clone() if rest is not None else s, valid, st.alpha, None, caps.to(dev))
            out[:, :, r0 - p:r1 - p, :n] = keep
            if rest is not None:
                rest[..., r0 - p:r1 - p] = self._unread_lse(s, valid & ~keep)
        if rest is not None:
            st.rest[layer] = rest
        return out

    def _choose(self, s: torch.Tensor, valid: torch.Tensor, alpha: float, shared_length: int | None = None,
                ratio: float | None = None) -> torch.Tensor:
        """Scores s [B, Hkv, G, R, S] (float32) of R rows over S slots, valid [B|1, Hkv|1, R, S] ->
        keep [B, Hkv, R, S]: per query head, the tokens above max - `alpha`, counted per `budget`:

          mean      (paper) every query head of the layer takes its top-n, n the mean of the heads'
                    counts, at most the cap; a KV head fetches the union of its query heads' picks
          per_head  the same with n the mean over the KV head's own query heads
          union     a KV head fetches every token any of its query heads selects; above the cap, the
                    tokens closest to their head's max
          layer     the union, with the cap pooled over the layer's KV heads (the transfer volume of a
                    layer): above it, the entries with the most speculated attention mass (summed over
                    the group's query heads) win, so peaked heads give up nothing to flat ones
        The cap is `ratio` (the layer's cap, `layer_caps`; None: `max_fetch_ratio`) of the cached tokens
        (per KV head; per layer for "layer"), at least `min_fetch` tokens per KV head. `shared_length`: every
        row's count of valid tokens, when the caller knows it is one number (no padding, no window).

        Host synchronizations per call (what a CUDA decoding step pays per speculated layer): "union" and
        "layer" with `shared_length` known: none (caps are host numbers, the cut is a top-k with a host k over
        every row, kept rows restored with `where`); on CPU, "layer" checks once whether any row is over its cap
        (a free check there, and it skips the cut). Otherwise (padding, a window; "mean" and "per_head",
        whose counts are data) 3-4: the rows to cut (nonzero), the largest count (top-k size) and whether
        the counts are all equal. The runtime's gather of the chosen slots adds 2 (`KVStore.slots`: the
        largest count and nonzero, a data-dependent size)."""
        # both paths call this with the same shapes per row (`_sequence_rows`), so float32 is exact enough
        relative = s.float()
        if shared_length is None:  # else every slot is valid
            relative = relative.masked_fill_(~valid[:, :, None], float("-inf"))
        relative -= relative.amax(-1, keepdim=True).clamp(min=torch.finfo(relative.dtype).min)  # to each head's max
        ratio = self.max_fetch_ratio if ratio is None else ratio
        floor = min(max(1, self.min_fetch), s.shape[-1])  # a floor over the slots reads them all anyway
        # host numbers when every row has `shared_length` tokens; the same float32 arithmetic as on the device
        # [B|1, Hkv|1, R] cached tokens
        length = valid.sum(-1) if shared_length is None else torch.tensor(shared_length).view(1, 1, 1)
        cap = (ratio * length).floor().clamp(min=floor).long()
        if self.budget in ("union", "layer"):
            # [B, Hkv, R, S]: the max over the group, slice by slice (a strided amax over dim 2 takes 20x
            # longer on a CPU)
            group_max = relative[:, :, 0].clone()
            for g in range(1, relative.shape[2]):
                torch.maximum(group_max, relative[:, :, g], out=group_max)
            keep = group_max > -alpha
            if self.budget == "union":
                n = int(cap) if shared_length is not None else cap.expand(group_max.shape[:-1])
                return self._top_n_per_row(keep, group_max, n)
            b, hkv, r, n = keep.shape
            if shared_length is None:
                total = (ratio * length.expand(b, hkv, r).sum(1)).floor().clamp(min=floor * hkv).long()  # [B, R]
            else:
                total = self._layer_total(ratio, shared_length, hkv, s.shape[-1])
            if self.block > 1:
                return self._choose_blocks(relative, keep, valid, total)
            over = keep.sum((1, 3)) > total
            if not keep.is_cuda and not over.any():  # free on a CPU (and skips the cut); on CUDA a synchronization
                return keep
            # speculated attention weights per query head, in place: `relative` is not read again, and a new
            # [B, Hkv, G, R, S] tensor per step costs page faults on a CPU (the same numbers either way)
            p = relative.exp_()
            p /= p.sum(-1, keepdim=True)
            mass = p.sum(2)  # [B, Hkv, R, S]
            flat = lambda x: x.permute(0, 2, 1, 3).reshape(b, r, hkv * n)  # noqa: E731 (KV head, slot) per row
            cut = self._top_n_per_row(flat(keep), flat(mass.masked_fill_(~keep, -1.0)), total, as_is=~over)
            return cut.view(b, r, hkv, n).permute(0, 2, 1, 3)
        above = relative > -alpha  # [B, Hkv, G, R, S]
        counts = above.sum(-1)  # [B, Hkv, G, R]
        if self.budget == "mean":  # paper: every head of the layer fetches the mean count
            n = counts.float().mean((1, 2), keepdim=True)
        else:  # per_head: each KV head its own count, the mean over its query heads
            n = counts.float().mean(2, keepdim=True)
        n = torch.minimum(torch.ceil(n - 1e-6).long(), cap[:, :, None].to(n.device)).expand_as(counts)
        # each query head its own top-n tokens: where n equals the head's count that is `above` itself
        return self._top_n_per_row(above, relative, n, as_is=counts == n).any(2)

    def _choose_blocks(self, relative, keep, valid, total):
        """budget "layer" in blocks of `block` consecutive slots per KV head: a block qualifies when any of
        its tokens does, the blocks with the most speculated mass win until their tokens reach the cap
        (`total` tokens per row over the layer's KV heads: total // block blocks), and a chosen block is
        read whole (its valid slots). Rows whose qualifying blocks hold at most `total` valid tokens keep them
        all (so an unlimited cap reads everything: partial blocks, padding and the last block included)."""
        b, hkv, r, n = keep.shape
        k = min(self.block, n)  # a block over the cached slots is all of them
        nb = -(-n // k)
        pad = nb * k - n
        p = relative.exp()
        mass = (p / p.sum(-1, keepdim=True)).sum(2)  # [B, Hkv, R, S]
        if pad:
            keep = torch.nn.functional.pad(keep, (0, pad))
            mass = torch.nn.functional.pad(mass, (0, pad))
        kb = keep.view(b, hkv, r, nb, k).any(-1)
        mb = mass.view(b, hkv, r, nb, k).sum(-1).masked_fill(~kb, -1.0)
        nblocks = max(1, total // k) if isinstance(total, int) else (total // k).clamp(min=1)
        flat = lambda x: x.permute(0, 2, 1, 3).reshape(b, r, hkv * nb)  # noqa: E731
        held = valid.expand(b, hkv, r, n)  # each block's valid tokens
        held = torch.nn.functional.pad(held, (0, pad)) if pad else held
        fits = (kb * held.reshape(b, hkv, r, nb, k).sum(-1)).sum((1, 3)) <= total  # [B, R]
        cut = self._top_n_per_row(flat(kb), flat(mb), nblocks, as_is=fits).view(b, r, hkv, nb).permute(0, 2, 1, 3)
        out = cut[..., None].expand(b, hkv, r, nb, k).reshape(b, hkv, r, nb * k)[..., :n]
        return out & valid  # a block past the valid tokens (padding, a window) reads only its valid slots

    @staticmethod
    def _top_n_per_row(keep: torch.Tensor, score: torch.Tensor, n: torch.Tensor,
                       as_is: torch.Tensor | None = None) -> torch.Tensor:
        """Per row (last dim), exactly the top-n entries of `score` (ties: lower slot first) where `keep`
        holds more, or fewer, than n; rows in `as_is` (or with at most n kept, when `as_is` is None)
        keep `keep`. n: a tensor per row, or one host number for every row (then no synchronization: every
        row is cut, a top-k with an unsorted k, and the rows kept as they are put back)."""
        if as_is is None:
            as_is = keep.sum(-1) <= n  # nothing to cut
        if isinstance(n, int):
            k = min(n, score.shape[-1])
            if k == 0:
                return keep & as_is[..., None]
            thr, take = _cut_in_one_pass(score, k)
            if take is None:  # more ties at the threshold than places left: the lower slots first
                above = score > thr
                tie = (score == thr) & (score > float("-inf"))
                take = above | (tie & (tie.cumsum(-1) <= (n - above.sum(-1, keepdim=True))))
            if not score.is_cuda and not bool(as_is.any()):  # every row is cut (a free check on a CPU)
                return take
            return torch.where(as_is[..., None], keep, take)
        todo = (~as_is).nonzero(as_tuple=True)
        if todo[0].numel() == 0:
            return keep
        row_scores, row_n = score[todo], n[todo]  # [N, S], [N]
        kmax = min(int(row_n.max()), row_scores.shape[-1])
        if bool((row_n >= kmax).all()):  # one n for every row (the common case): no need to sort the top
            thr = _kth_largest(row_scores, kmax)
        else:
            thr = row_scores.topk(kmax, dim=-1, sorted=True).values.gather(-1, (row_n.clamp(1, kmax) - 1)[:, None])
        above = row_scores > thr
        tie = (row_scores == thr) & (row_scores > float("-inf"))
        take = above | (tie & (tie.cumsum(-1) <= (row_n[:, None] - above.sum(-1, keepdim=True))))
        keep = keep.clone()
        keep[todo] = take
        return keep
