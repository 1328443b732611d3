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
import functools
import json
import math
import sys
import weakref
from dataclasses import dataclass, field

import torch

from ..cache import KVStore, SelectedRows
from ..errors import UserError
from ..kernels.int4 import PackedKeys
from ..memory import tensor_bytes, weight_bytes
from . import infinigen_select as select
from .base import ALL, Policy, Remainder, jsonable, parse_layers
from .budgets import layer_caps
from .infinigen_settings import (BUDGETS, CALIBRATE_BOUND, CALIBRATE_GROWTH, CALIBRATE_TARGET,  # noqa: F401
                                 CALIBRATE_TEXT, CALIBRATED, KEY_MODES, PRESETS, QUERIES, SPEC_INPUTS, check_bounds,
                                 check_choices)
from .speculation import (_SKEWS, INT4_GROUP, SpeculationKeys, fake_int4, int4_layout,  # noqa: F401
                          layer_sparsity, needs_skew, prepare_skew, skew_matrices)


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
    # teacher-forced rows chosen a block at a time (`infinigen_select.rows_in_blocks`: calibration's scoring)
    rows_in_blocks: bool = False
    value_sums: dict = field(default_factory=dict)
    value_counts: dict = field(default_factory=dict)
    rest: dict = field(default_factory=dict)
    key_mean: dict = field(default_factory=dict)  # key_centre: layer -> [B, Hkv, 1, d] the packed keys' mean key

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
    budget: str | None = None  # "mean" (paper) | "per_head" | "union" | "layer" (see `infinigen_select.choose`)
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
        check_bounds(self)
        check_choices(self)


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

    # ---- skew matrices (policies/speculation.py) ------------------------------------------------------
    def with_skew(self, skew) -> "InfiniGen":
        """Use these skew matrices (an `infinigen.skew.Skew` or a tensor [L, Hkv, d, d]) on any model
        instead of calibrated ones; returns self."""
        object.__setattr__(self, "matrices", skew)
        return self

    def _needs_skew(self, model) -> bool:
        return needs_skew(self, model)

    def prepare_skew(self, model, tokenizer=None, progress=False) -> "InfiniGen":
        """Make the model's skew matrices ready (`speculation.prepare_skew`); returns self."""
        prepare_skew(self, model, tokenizer, progress)
        return self

    @functools.cached_property
    def speculation(self) -> SpeculationKeys:
        """How this policy's speculation keys are built and scored (`key_mode`, `key_centre`)."""
        return SpeculationKeys(self.key_mode, self.key_centre)


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
        sparsity = layer_sparsity(self, model)
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
            A=skew_matrices(self, model), alpha=self.alpha_for(cfg),
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

    # ---- hooks ----------------------------------------------------------------------------------
    def continues_prefill(self) -> bool:
        # 4-bit speculation keys are built from the keys alone; the partial columns' vote reads the queries
        return self.key_mode == "int4"

    def on_prefill(self, layer, q, k, v, session):
        st = session.state
        if layer not in st.spec_layers:
            return
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
        self.speculation.write_prompt(st, layer, q, k, store)


    def on_hidden(self, layer, point, x, session):
        st, model = session.state, session.model
        if point == "embed":
            self._layer0_ahead(x, session)
            return
        target = layer + 1
        if (point != self.spec_input or target not in st.spec_layers or st.own_query
                or select.dense_pass(session)):
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
            self.speculation.keys(st, target, session)
            # decoding: the selection is known one layer ahead, so its transfer can start now;
            # layer `target`'s partial keys do not change before its own attention
            st.ready.add(target)

    def _layer0_ahead(self, h, session) -> None:
        """exact_first: layer 0's exact query is known once a decoding step's tokens are
        embedded (its input is the embedding, normed), so its selection is made then and placement fetches
        layer 0's rows while nothing else waits: every layer is then prefetched on an offloaded tier. The
        same query as the layer's own (the same projection of the same input), so the same selection."""
        st, model = session.state, session.model
        if (0 not in st.spec_layers or st.own_query or select.dense_pass(session)
                or not (0 in st.spec_keys or st.lazy_keys)):
            return
        block = model.layers[0]
        x = block.attn_norm(h) if model.cfg.pre_norm else h
        q = model.query(0, x, session.positions)  # [B, H, T, d], post-RoPE
        b, nh, t, d = q.shape
        hkv = model.cfg.num_kv_heads
        st.spec[0] = q.view(b, hkv, nh // hkv, t, d)
        if t == 1:
            self.speculation.keys(st, 0, session)
            st.ready.add(0)

    def known_ahead(self, layer, session) -> bool:
        """Once this step's speculation for `layer` has run (placement fetches its rows meanwhile), or at
        once when the step reads densely (`dense_below`): the plan is ALL."""
        return layer in session.state.ready or select.dense_pass(session)

    def keep(self, layer, rows, session):
        st = session.state
        st.rest.pop(layer, None)
        if rows.in_store:
            if select.dense_pass(session):
                return ALL
            keep = self._decoding_row(layer, rows, session)
            if not isinstance(keep, SelectedRows):
                keep = keep[:, :, None]
        elif st.rows_in_blocks:
            keep = select.rows_in_blocks(self, layer, rows, session)
        else:
            keep = select.sequence_rows(self, layer, rows, session)
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
        dense = select.dense_rows(session, rows.first)
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

    def _speculated_row(self, layer, rows, session, packs: bool = False) -> torch.Tensor | SelectedRows:
        st = session.state
        # the layer's own query at its attention (row `rows.first` of a view): layer 0 with exact_first when
        # its selection was not made at the embedding, every layer with `own_query`
        if (layer == 0 or st.own_query) and rows.query is not None:
            q = rows.query
            b, h, _, d = q.shape
            hkv = session.model.cfg.num_kv_heads
            st.spec[layer] = q.view(b, hkv, h // hkv, 1, d).expand(b, hkv, h // hkv, rows.first + 1, d)
        return select.select_row(self, layer, rows.first, session, packs)

    def on_append(self, layer, slots, k, v, session):
        st = session.state
        if layer in st.value_sums:
            st.value_sums[layer] += v[:, :, 0].float()
            st.value_counts[layer] += 1
        if layer not in st.spec_layers or layer not in st.spec_keys:  # not built yet (lazy_keys)
            return
        self.speculation.append(st, layer, slots, k)


    # ---- selection (policies/infinigen_select.py) -------------------------------------------------------
    def _choose(self, s: torch.Tensor, valid: torch.Tensor, alpha: float, shared_length: int | None = None,
                ratio: float | None = None) -> torch.Tensor:
        """`infinigen_select.choose` with this policy's budget, cap (`ratio`; None: `max_fetch_ratio`),
        `min_fetch` and `block`."""
        return select.choose(s, valid, alpha, self.budget, self.max_fetch_ratio if ratio is None else ratio,
                             self.min_fetch, self.block, shared_length)

    def _layer_total(self, ratio: float | None, shared_length: int, hkv: int, slots: int) -> int:
        """budget "layer"'s cap of a row that has `shared_length` valid tokens per KV head: the (KV head, slot)
        pairs it may read over the layer's `hkv` KV heads, at least `min_fetch` per KV head (`slots` slots)."""
        return select.layer_total(self.max_fetch_ratio if ratio is None else ratio, shared_length, hkv, slots,
                                  self.min_fetch)
