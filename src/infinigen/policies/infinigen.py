"""InfiniGen (paper section 4.3): speculate layer i's important tokens one layer ahead, fetch only those.

The policy in parts: this module holds the knobs (a frozen dataclass), the per-request state and the hooks the
runtime calls; policies/infinigen_settings.py the knobs' choices, defaults, presets and checks;
policies/speculation.py the skew matrices and the speculation keys and their scorer; policies/infinigen_select.py
the selection rules; policies/budgets.py the per-layer caps; policies/infinigen_calibration.py the per-model
calibration record `prepare` builds the policy from (policies/calibrate.py: its search).

Per request, at prefill, every selecting layer gets its speculation keys: the partial columns K~[:, idx] (the
paper: the top ceil(r*d) columns of |Q~| + |K~| over the prompt, Q~ = Q A, K~ = K A, A the skew) or, with
`key_mode="int4"`, every skewed column packed in 4 bits (40 B per token and KV head at d 64: 7.8% of float32
K+V), rewritten in `on_append`, so they follow pool evictions. At decoding, when layer i-1's hook fires, layer
i's query is speculated from the hidden state there (`spec_input`: the paper's attention input, or
LN_i(h_{i-1} + attn_out_{i-1}) with "attn_out") and scored against those keys; the tokens within `alpha` of
each head's maximum are selected and counted per `budget` ("layer": the cap pooled over the layer's KV heads,
spent on the most speculated attention mass), at most a cap. Layer i's attention then runs over those plus the
current token (the runtime does that). `InfiniGen.paper()` is exactly the paper's method.

How much is read is one all-layer bound, `kv_budget` (the share of the cached entries read over every layer,
dense layers counting 100%); the selecting layers' caps follow from it (`budgets.layer_caps`), and with
`budget_growth` q < 1 the tokens read grow as n ** q (`budget_at`: kv_budget at `budget_ref` cached tokens).
`exact_first` selects layer 0 too, with its exact query, known once a decoding step's tokens are embedded, so
placement prefetches layer 0's rows like every other layer's.

With `remainder` the attention mass of the entries a selection leaves unread is estimated from their speculated
scores (which cover every cached token) and the runtime adds that mass times their mean value (the sum of every
cached value per batch row and KV head, kept in fast memory, less what attention read). Nothing unread: the
dense result to the bit. Off under a pool limit and a sliding window; needs key_mode int4.

Which query selects (`query`): "ahead" speculates as the paper does, so the rows can be fetched while layer i-1
still runs; "own" selects with the layer's own query at its attention (nothing to overlap where the KV is in
fast memory, and it ranks the same keys better); "corrected" does both: the speculation one layer ahead says what
placement prefetches, the layer's own query selects at its attention and the store fetches on demand only the rows
the prefetch missed (`Placement.correct`; without it the speculated selection is read). "auto" (the default) takes
"own" in fast memory and on a store where reading ahead costs the host more than it hides (`ahead_pays`: the disk
tier in blocks on a CPU host, results/sessions_step/), else "corrected". Own and corrected read the same selection:
the same logits. Measured on the validation texts: results/accuracy_models/, results/recall/correction.md.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
import weakref
from dataclasses import dataclass, field

import torch

from ..cache import KVStore, SelectedRows
from ..errors import UserError
from ..kernels import fused_select
from ..kernels.int4 import PackedKeys
from ..memory import tensor_bytes, weight_bytes
from . import cuts, infinigen_select as select
from .base import ALL, NOT_A_KNOB, Policy, Remainder, knob_fields, parse_layers
from .crossing import crossing_for
from .infinigen_calibration import _CHOICES, announce, calibration_record  # noqa: F401
from .infinigen_state import InfiniGenCaps, InfiniGenState
from .infinigen_settings import (BUDGETS, CALIBRATE_BOUND, CALIBRATE_GROWTH, CALIBRATE_TARGET,  # noqa: F401
                                 CALIBRATE_TEXT, CALIBRATED, KEY_MODES, PRESETS, QUERIES, SPEC_INPUTS,
                                 InfiniGenExperimental, InfiniGenSettings, check_declared, check_rules)
from .speculation import (_SKEWS, INT4_GROUP, SpeculationKeys, fake_int4, int4_layout,  # noqa: F401
                          layer_sparsity, needs_skew, prepare_skew, skew_matrices)


_PREPARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class InfiniGen(Policy, InfiniGenCaps, InfiniGenExperimental, InfiniGenSettings):
    name = "infinigen"
    # the speculation made at the layer before decides (see `known_ahead`; layer 0 with exact_first: its query),
    # unless this session selects with each layer's own query (`query`): then nothing is known ahead
    needs_query = False

    # the knobs: InfiniGenSettings (the user's), InfiniGenExperimental (lab-only), in policies/infinigen_settings.py
    # explicit skew matrices (`with_skew`): a resource, not a knob
    matrices: object = field(default=None, init=False, repr=False, compare=False)
    # what calibration chose for a model (`infinigen_calibration.calibration_record`): `prepare` returns the policy
    # built from the caller's knobs and this record, whose `chosen` values apply where the caller left a knob unset
    calibration: dict | None = field(default=None, repr=False, compare=False, metadata=NOT_A_KNOB)
    # where `dense_below` came from ("measured", "cached", "not measured (...)") and what the measurement found
    # (policies/crossing.py): `prepare` builds the policy with it where the caller left `dense_below` unset;
    # None: from the knobs ("set", "preset" or "not prepared"). Recorded in `settings()`
    crossing: dict | None = field(default=None, repr=False, compare=False, metadata=NOT_A_KNOB)
    # the knobs as the caller gave them, those of CALIBRATED among them, and every knob's value before calibration
    requested: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    given: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)
    base: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    calibrate_set: bool = field(default=False, init=False, repr=False, compare=False)  # by the caller, not the preset

    def __post_init__(self):
        """The effective knob values, settled here only: the caller's, the preset's for the rest, then the
        records `prepare` built this policy from (calibration, crossing) where the caller left a knob unset."""
        if self.preset not in PRESETS:
            raise UserError(f"unknown InfiniGen preset {self.preset!r}; choose from {', '.join(PRESETS)}")
        requested = {f.name: getattr(self, f.name) for f in knob_fields(self)}
        object.__setattr__(self, "requested", requested)
        object.__setattr__(self, "given", frozenset(k for k in CALIBRATED if requested[k] is not None))
        object.__setattr__(self, "calibrate_set", self.calibrate is not None)
        self._apply_preset()
        object.__setattr__(self, "dense_layers", parse_layers(self.dense_layers))
        object.__setattr__(self, "base", {f.name: getattr(self, f.name) for f in knob_fields(self)})
        self._apply_records(requested["dense_below"])
        super().__post_init__()

    def _apply_preset(self) -> None:
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

    def _apply_records(self, dense_below_given) -> None:
        """The calibration's chosen values on the knobs the caller left unset (a record whose every knob the
        caller set, as `dataclasses.replace` does, no longer applies: dropped), and the crossing's `dense_below`
        where the caller left it unset."""
        if self.calibration is not None:
            free = {k: v for k, v in self.calibration["chosen"].items() if k not in self.given}
            if not free:
                object.__setattr__(self, "calibration", None)
            for k, v in free.items():
                object.__setattr__(self, k, tuple(v) if k == "dense_layers" else v)
        if dense_below_given is None and self.crossing is not None and "dense_below" in self.crossing:
            object.__setattr__(self, "dense_below", self.crossing["dense_below"])
        else:  # (a copy by `dataclasses.replace` carries the derived record: derived again)
            object.__setattr__(self, "crossing", {"source": "set"} if dense_below_given is not None else
                               {"source": "preset"} if "dense_below" in PRESETS[self.preset] else
                               {"source": "not prepared"})

    @classmethod
    def paper(cls, **overrides) -> "InfiniGen":
        """Exactly the paper's method (alpha 4 for OPT, 5 for Llama; r 0.3; 20% cap; layers 0, 1 dense)."""
        return cls(preset="paper", **overrides)

    def validate(self) -> None:
        check_declared(self)
        check_rules(self)


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


    def prepare(self, model, tokenizer=None, progress=False, longest: int | None = None,
                batch: int = 1) -> "InfiniGen":
        """This policy ready for `model`: the skew matrices (`prepare_skew`), then, with `calibrate`, the policy
        built from the caller's knobs and this model's calibration record (policies/infinigen_calibration.py:
        from the skew artifact's metadata when this search ran before on the same tokens, or the package ships
        it, else searched and stored there; one line printed with the choice), and `dense_below` from where
        selection pays on this machine where the knobs leave it to `prepare` (`crossing_for`). Returns that
        policy (self where nothing changes); self is left as it was. `progress`: True for a bar on stderr, or a
        callback `progress(desc, done, total, eta_seconds)` (`skew.Progress`). `longest`: the most tokens a
        session of this run caches (None: unknown), and `batch`: the rows a run decodes together (a server's
        requests: 1), see `crossing_for`."""
        self.prepare_skew(model, tokenizer, progress)
        prepared = _PREPARED.get(model)
        again = prepared is not None and prepared.get(id(self)) is self
        if again and self.crossing["source"] in ("measured", "cached"):
            return self  # prepared for this model before, its crossing measured: as it is
        record = self.calibration if again else None
        if self.calibrate and record is None:
            try:
                record = calibration_record(self, model, tokenizer, progress)
                self._rebuilt(record)  # the chosen values pass the knob checks
            except UserError as e:
                if self.calibrate_set:
                    raise
                # the preset asked for calibration, the caller did not: its own values, said in one line
                print(f"InfiniGen not calibrated ({e}); the {self.preset} preset's settings apply", file=sys.stderr)
                record = None
            else:
                announce(record)
        if record is self.calibration and self.crossing["source"] in ("set", "preset"):
            pol = self
        else:
            pol = self._rebuilt(record)
            if pol.crossing["source"] not in ("set", "preset"):
                pol = self._rebuilt(record, crossing_for(pol, model, progress, longest, batch, tokenizer))
        _PREPARED.setdefault(model, weakref.WeakValueDictionary())[id(pol)] = pol
        return pol

    def _rebuilt(self, calibration: dict | None, crossing: dict | None = None) -> "InfiniGen":
        """The policy of the caller's knobs (`requested`) built with these records, on this policy's skew."""
        pol = type(self)(**self.requested, calibration=calibration, crossing=crossing)
        return pol.with_skew(self.matrices) if self.matrices is not None else pol

    def begin(self, model, session) -> InfiniGenState:
        cfg = model.cfg
        d = cfg.head_dim
        # a measured crossing was measured in fast memory: an offloaded store selects at every length
        measured = self.crossing["source"] not in ("set", "preset")
        st = InfiniGenState(
            A=skew_matrices(self, model), alpha=self.alpha_for(cfg),
            dense_below=0 if measured and session.store.offloaded else self.dense_below_at(session.batch),
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
        corrects = offloaded and getattr(session.store, "corrects", False)
        query = self.query
        if query == "auto":  # the store says whether reading one layer ahead pays where the KV lies
            query = "corrected" if offloaded and session.store.ahead_pays else "own"
        st.ahead = query in ("ahead", "corrected")
        st.own_query = query == "own" or (query == "corrected" and (corrects or not offloaded))
        # the running sums cannot follow a pool's victims (an append overwrites a value they hold) nor a window.
        # Under "auto" on an offloaded tier the query is the speculated one, with which the remainder was measured
        # to cost accuracy on both models (results/accuracy/): there it is used only when the caller set it
        wanted = self.remainder and (st.own_query or self.query == "ahead" or "remainder" in self.given)
        st.with_remainder = wanted and cfg.sliding_window is None and session.store.allocator is None
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
        out.update({"A": tensor_bytes(state.A), "spec": tensor_bytes(state.spec) + tensor_bytes(state.spec_rows)})
        return {k: v for k, v in out.items() if v}

    def _adds_remainder(self, st: InfiniGenState, layer: int) -> bool:
        """Whether `layer`'s selection adds what it leaves unread (`remainder`, `remainder_from`)."""
        return st.with_remainder and layer >= self.remainder_from

    def selects(self, layer: int) -> bool:
        return (layer >= 1 or self.exact_first) and layer not in self.dense_layers

    def selecting_layers(self, cfg) -> list[int]:
        """The layers this policy selects on a model of `cfg`: speculated ones that are not local window
        layers of a model mixing local and global layers (those read their window: `Session.selects`)."""
        return [i for i in range(cfg.num_layers) if self.selects(i) and not cfg.local(i)]

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
        if st.lazy_keys and k.shape[2] >= st.dense_below:
            # the prompt reaches the crossing: decoding selects from its first step, so the keys are packed
            # here, as a prefill packs them, not inside that step
            st.lazy_keys = False
        if layer not in st.spec_layers:
            return
        store = session.store
        st.ready.discard(layer)
        if self._adds_remainder(st, layer) and not st.lazy_keys:  # over the keys' length: a continued prefill's q
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
        if (point != self.spec_input or target not in st.spec_layers or not self._speculates(session)
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
        if (0 not in st.spec_layers or not self._speculates(session) or select.dense_pass(session)
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

    def reads_all(self, session) -> bool:
        """Every row of the step below `dense_below`: every layer reads all (the full cache's step)."""
        return select.dense_pass(session)

    @staticmethod
    def _speculates(session) -> bool:
        """Whether this pass speculates one layer ahead: always with query "ahead" (teacher-forced scoring
        selects with the speculated queries then), while decoding only when the own query corrects it."""
        st = session.state
        return st.ahead and (not st.own_query or session.decoding)

    def reselects(self, layer, session) -> bool:
        return session.state.own_query and session.state.ahead

    def known_ahead(self, layer, session) -> bool:
        """Once this step's speculation for `layer` has run (placement fetches its rows meanwhile), or at
        once when the step reads densely (`dense_below`): the plan is ALL."""
        return layer in session.state.ready or select.dense_pass(session)

    def keep(self, layer, rows, session):
        st = session.state
        st.remainders.pop(layer, None)
        if rows.in_store:
            if select.dense_pass(session):
                return ALL
            packed = self._own_row_packed(layer, rows, session) if rows.packs else None
            if packed is not None:
                return packed
            keep = self._decoding_row(layer, rows, session)
            if not isinstance(keep, SelectedRows):
                keep = keep[:, :, None]
        elif st.rows_in_blocks:
            keep = select.rows_in_blocks(self, layer, rows, session)
        else:
            keep = select.sequence_rows(self, layer, rows, session)
        lse = st.remainders.pop(layer, None)
        if lse is not None and not rows.in_store:  # teacher-forced: the runtime sums the sequence's values
            st.remainders[layer] = Remainder(lse)
        elif lse is not None:
            self._decoding_remainder(st, layer, lse, session)
        return keep

    def _decoding_remainder(self, st: InfiniGenState, layer: int, lse: torch.Tensor, session) -> None:
        """A decoding row's remainder at `layer` from its unread log-mass lse [B, Hkv, G, 1] and the value sums
        before this step's append (with lazy_keys summed from the store the first time, as the keys are packed);
        none where the sums are not kept."""
        if layer not in st.value_sums:
            if not st.lazy_keys:
                return
            _, v, valid, _ = session.store.past(layer)
            st.value_sums[layer] = (v.float() * valid[..., None]).sum(2)
            st.value_counts[layer] = valid.sum(-1)
        st.remainders[layer] = Remainder(lse, st.value_sums[layer], st.value_counts[layer])

    def _lane(self, st: InfiniGenState, layer: int, spec_keys) -> tuple:
        """What holds for a layer's speculation keys, found once per keys object: (the keys, whether a row's query
        and key are rotated inside the native scorer and append (`SpeculationKeys.native`), whether decoding's fused
        own-query cut applies (`_own_row_packed`), the layer's rotation)."""
        native = self.speculation.native(spec_keys)
        lane = st.lanes[layer] = (spec_keys, native, native and self.budget == "layer" and self.block <= 1,
                                  self.speculation.rotation(st, layer))
        return lane

    def _own_row_packed(self, layer, rows, session) -> SelectedRows | None:
        """Decoding's common selecting row straight to its packed rows: the layer's own query (row 0 of the
        step), every used slot a valid candidate, no batch row below dense_below, budget "layer" and the 4-bit keys
        scored and cut in one native call (`PackedKeys.select_rotated`): what `_decoding_row` makes there through
        `infinigen_select.select_row`'s fused cut, the same call with the same arguments, in fewer Python steps.
        None where that does not apply (the caller takes `_decoding_row`)."""
        st = session.state
        if (rows.first != 0 or rows.query is None or not (layer == 0 or st.own_query) or self.rerank is not None
                or not fused_select.packs_selection or not fused_select.scores_with_selection
                or not fused_select.available()
                or select.dense_rows(session, 0) is not None):
            return None
        store, model = session.store, session.model
        spec_keys = self.speculation.keys(st, layer, session)
        lane = st.lanes.get(layer)
        if lane is None or lane[0] is not spec_keys:
            lane = self._lane(st, layer, spec_keys)
        if not lane[2] or store.padded or model.cfg.sliding_window is not None:
            return None
        st.ready.discard(layer)
        st.spec.pop(layer, None)
        q = rows.query
        b, h, _, d = q.shape
        hkv = model.cfg.num_kv_heads
        n = store.length[layer]
        adds = self._adds_remainder(st, layer)
        own = st.spec_rows[layer] = q.view(b, hkv, h // hkv, d)
        keep, packed, head, counts, lse = spec_keys.select_rotated(
            own, lane[3], n, **self._cut(st, model, layer, n, store.capacity, adds))
        if adds:
            self._decoding_remainder(st, layer, lse.unsqueeze(-1), session)
        return SelectedRows(keep, packed, head, counts)

    def _decoding_row(self, layer, rows, session) -> torch.Tensor | SelectedRows:
        st = session.state
        st.ready.discard(layer)
        dense = select.dense_rows(session, rows.first)
        # no batch row below dense_below: the answer may be the packed rows themselves
        keep = self._speculated_row(layer, rows, session, packs=rows.packs and dense is None)
        if dense is None:
            return keep
        if layer in st.remainders:  # a row reading everything leaves nothing unread
            st.remainders[layer] = st.remainders[layer].masked_fill(dense[:, None, None, None], float("-inf"))
        return keep | dense[:, None, None]

    def keys_beside(self, layer, session):
        return session.state.keys_beside.pop(layer, None)

    def remainder_at(self, layer, session):
        """The unread entries' log-mass of the rows `keep` last answered at `layer` and, while decoding, the
        running value sums (teacher-forced scoring sums the sequence's values in the runtime)."""
        return session.state.remainders.pop(layer, None)

    def _speculated_row(self, layer, rows, session, packs: bool = False) -> torch.Tensor | SelectedRows:
        st = session.state
        # the layer's own query at its attention (row `rows.first` of a view): layer 0 with exact_first when
        # its selection was not made at the embedding, every layer with `own_query`
        if (layer == 0 or st.own_query) and rows.query is not None:
            q = rows.query
            b, h, _, d = q.shape
            hkv = session.model.cfg.num_kv_heads
            if rows.first == 0:  # the row's query as one view [B, Hkv, G, d]
                st.spec.pop(layer, None)
                st.spec_rows[layer] = q.view(b, hkv, h // hkv, d)
                return select.select_row(self, layer, 0, session, packs)
            st.spec[layer] = q.view(b, hkv, h // hkv, 1, d).expand(b, hkv, h // hkv, rows.first + 1, d)
        elif layer > 0 and self.reselects(layer, session) and session.decoding:  # the speculated plan to prefetch
            margin = getattr(session.store, "prefetch_margin", None)
            st.widen = margin(layer) if margin is not None else 1.0
            try:
                return select.select_row(self, layer, rows.first, session, packs)
            finally:
                st.widen = 1.0
        return select.select_row(self, layer, rows.first, session, packs)

    def on_append(self, layer, slots, k, v, session):
        st = session.state
        if layer in st.value_sums:
            fused_select.add_values(st.value_sums[layer], st.value_counts[layer], v)
        if layer not in st.spec_layers or layer not in st.spec_keys:  # not built yet (lazy_keys)
            return
        lane = st.lanes.get(layer)
        if lane is not None and lane[1] and lane[0] is st.spec_keys[layer] and fused_select.available():
            lane[0].scatter_rotated(slots, k, lane[3])  # (`speculation.append`'s native case, its checks found once)
            return
        self.speculation.append(st, layer, slots, k)


    # ---- selection (policies/infinigen_select.py) -------------------------------------------------------
    def _choose(self, s: torch.Tensor, valid: torch.Tensor, alpha: float, shared_length: int | None = None,
                ratio: float | None = None) -> torch.Tensor:
        """`infinigen_select.choose` with this policy's budget, cap (`ratio`; None: `max_fetch_ratio`),
        `min_fetch`, `block` and `block_fetch`."""
        return select.choose(s, valid, alpha, self.budget, self.max_fetch_ratio if ratio is None else ratio,
                             self.min_fetch, self.block, shared_length, self.block_fetch)

    def _layer_total(self, ratio: float | None, shared_length: int, hkv: int, slots: int) -> int:
        """budget "layer"'s cap of a row that has `shared_length` valid tokens per KV head: the (KV head, slot)
        pairs it may read over the layer's `hkv` KV heads, at least `min_fetch` per KV head (`slots` slots)."""
        return cuts.layer_total(self.max_fetch_ratio if ratio is None else ratio, shared_length, hkv, slots,
                                  self.min_fetch)
