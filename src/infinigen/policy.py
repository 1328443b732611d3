"""The one interface every KV-cache method implements.

A policy is two things kept apart:
  * its knobs: the fields of a frozen dataclass, checked in `__post_init__` (a bad value is a
    `UserError`), presets resolved there, so `settings()` shows the values in effect;
  * its per-request state: whatever `begin(model, session)` returns, kept on `session.state`.
The hooks read and write `session.state`, never the policy, so one policy object serves any number
of sessions, one after the other or side by side. Model-wide resources (InfiniGen's skew matrices)
are loaded or computed once by `prepare(model, tokenizer)`, which every entry point calls first.

A policy says what a layer reads once, in `keep(layer, rows, session)` (see `infinigen.selection`): a
bool mask [B, Hkv, R, S] over the candidate entries of R decoding rows, or `ALL`. The runtime asks it
while decoding (one row against the store's slots), one layer ahead for the prefetch when the policy
can answer without the layer's query (`needs_query`, `known_ahead`), and for every decoding row of a
sequence at once in teacher-forced scoring, unless the policy's state changes with every step
(`replays`): then teacher-forced scoring replays decoding row by row. Three class attributes say what a
selection depends on, and the attention path follows from them, never from which hooks a policy
overrides:

    needs_query     keep() reads the layer's own query (no plan one layer ahead)
    needs_weights   observe() wants the attention weights over what was read (no fused dense path)
    replays         the state changes with every decoding step (teacher-forced scoring replays decoding)

The runtime calls the hooks in this order for each layer of a decoding step:

    on_hidden(layer, "attn_in", x)      normed attention input of `layer` (speculation point of the paper)
    keep(layer, rows)                   which entries to read (asked earlier when known ahead)
    observe(layer, weights, rows, own)  attention weights over what was read (only with needs_weights)
    on_append(layer, slots, k, v)       the current token was stored in `slots`
    on_hidden(layer, "attn_out", h)     residual stream after `layer`'s attention

(and `on_hidden(-1, "embed", h)` once at the start of a decoding step). `on_prefill` runs once per
layer after the prompt. Selection is per KV head: every query head of a GQA group attends over the
same entries. Policies never move data: placement (`infinigen.placement`) does. Whatever only listens
(calibration, probes, recorders) is a `infinigen.runtime.Listener`, not a policy.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
import types
import typing
from dataclasses import dataclass
from typing import ClassVar

import torch

from .codecs import KVCodec
from .errors import UserError
from .memory import tensor_bytes
from .selection import ALL, All, Remainder, Rows


# Integer knobs end up in int64 tensors and index arithmetic (token counts, layer indices, positions):
# a value outside int64 is refused at construction rather than overflowing in the first decoding step.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _finite(owner: str, name: str, value) -> None:
    """UserError for NaN or infinity in a knob (a tuple's items too)."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    for v in items:
        if isinstance(v, float) and not math.isfinite(v):
            raise UserError(f"{owner} knob {name} must be a finite number, got {v}")


# metadata of a dataclass field of a policy that is not a knob (a record the policy is built from): it is given
# to the constructor, but `--knob`, `settings()` and the knob checks leave it out
NOT_A_KNOB = {"knob": False}


def knob_fields(cls_or_policy) -> list[dataclasses.Field]:
    """The knobs of a policy class (or object): its constructor's fields but those marked NOT_A_KNOB."""
    return [f for f in dataclasses.fields(cls_or_policy) if f.init and f.metadata.get("knob", True)]


@functools.cache
def _field_kinds(cls) -> dict[str, tuple[type | None, bool]]:
    """Knob name -> (int, float, bool or None for any other type; whether None is allowed), read from the
    dataclass's annotations; a tuple of ints counts as int (each item is checked)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in knob_fields(cls):
        tp, optional = hints[f.name], False
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            optional = len(args) < len(typing.get_args(tp))
            tp = args[0] if len(args) == 1 else None
        if typing.get_origin(tp) is tuple and typing.get_args(tp)[:1] == (int,):
            tp = int
        out[f.name] = (tp if tp in (int, float, bool) else None, optional)
    return out


def _typed_in_range(owner: str, name: str, kind: type | None, optional: bool, value) -> None:
    """UserError unless `value` is a value of the knob's type that the runtime can hold: a whole number
    in int64 (each item of a tuple of them), a number a float can hold, true or false."""
    if kind is None or (value is None and optional):
        return
    items = value if kind is int and isinstance(value, (tuple, list)) else (value,)
    for v in items:
        if kind is bool:
            if not isinstance(v, bool):
                raise UserError(f"{owner} knob {name} must be true or false, got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
            what = "a number" if kind is float else "a whole number"
            raise UserError(f"{owner} knob {name} must be {what}, got {v!r}")
        elif kind is int and not INT64_MIN <= v <= INT64_MAX:
            bound = f"at most {INT64_MAX}" if v > 0 else f"at least {INT64_MIN}"
            raise UserError(f"{owner} knob {name} must be {bound} (a 64-bit integer), got {_shown(v)}")
        elif kind is float and isinstance(v, int) and abs(v) > sys.float_info.max:
            raise UserError(f"{owner} knob {name} must be a finite number, got {_shown(v)}")


def _shown(v: int) -> str:
    """An integer for a one-line message: its digits, or their count when there are hundreds."""
    text = str(v)
    return text if len(text) <= 40 else f"a {len(text.lstrip('-'))}-digit number"


def parse_layers(v) -> tuple[int, ...]:
    """Layer indices from a tuple, a single int or text like "0,1" ("" is none)."""
    if isinstance(v, str):
        parts = [s for s in v.replace(" ", "").split(",") if s]
        try:
            return tuple(int(s) for s in parts)
        except ValueError:
            raise UserError(f"dense layers must be integers separated by commas, got {v!r}")
    if v is None:
        return ()
    if isinstance(v, int):
        return (v,)
    try:
        return tuple(int(i) for i in v)
    except (TypeError, ValueError):
        raise UserError(f"dense layers must be integers, got {v!r}")


def jsonable(x):
    """Knob values (tuples, tensors, paths...) as plain JSON values; anything else becomes its text."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return str(x)


@dataclass(frozen=True)
class Policy:
    name: ClassVar[str] = "full"
    # reads every cached entry at full precision: the dense reference that reports compare against
    exact: ClassVar[bool] = False
    # what the selection depends on (see the module docstring): the runtime's paths follow from these
    needs_query: ClassVar[bool] = True
    needs_weights: ClassVar[bool] = False
    replays: ClassVar[bool] = False

    def __post_init__(self):
        # generic checks, for every policy from its annotations, before its own `validate` compares values
        for name, (kind, optional) in _field_kinds(type(self)).items():
            value = getattr(self, name)
            _finite(self.name, name, value)
            _typed_in_range(self.name, name, kind, optional, value)
        self.validate()

    def validate(self) -> None:
        """Raise UserError for knob values out of range (called at construction)."""

    def settings(self, model=None) -> dict:
        """The knob values in effect, JSON-able (with `model`: also what depends on its architecture)."""
        return {f.name: jsonable(getattr(self, f.name)) for f in knob_fields(self)}

    def codec(self) -> KVCodec | None:
        """How keys and values are stored (None: as computed)."""
        return None

    def prepare(self, model, tokenizer=None, progress: bool = False, longest: int | None = None,
                batch: int = 1) -> "Policy":
        """Model-wide setup before the first session (InfiniGen: load or compute the skew matrices).
        `longest`: the most tokens a session of this run will cache, when the caller knows it (None: up to the
        model's context); `batch`: the rows a run decodes together in one session. Idempotent; returns self."""
        return self

    def begin(self, model, session) -> object:
        """The per-request state of a new session (kept as `session.state`)."""
        return None

    def continues_prefill(self) -> bool:
        """Whether this policy's state after a prefill that continues a cached prefix (its `on_prefill` sees
        the rest of the prompt's queries and the WHOLE prompt's keys and values) is what a prefill of the
        whole prompt gives: true when `on_prefill` reads no query (and of course when it does nothing).
        A server's prefix cache serves only such policies."""
        return type(self).on_prefill is Policy.on_prefill

    def on_prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, session) -> None:
        pass

    def on_hidden(self, layer: int, point: str, x: torch.Tensor, session) -> None:
        pass

    def keep(self, layer: int, rows: Rows, session) -> torch.Tensor | All:
        """Which candidate entries each of `rows` reads at `layer`: bool [B|1, Hkv|1, R, S] (broadcast by
        the runtime) or ALL. Asked only where `selects(layer)`. rows.in_store: decoding (R is 1, the
        candidates are the store's slots; rows.query is None when asked one layer ahead); else
        teacher-forced scoring, every decoding row of the sequence at once (never for a policy that
        `replays`). The runtime removes invalid entries and the sliding window afterwards, and always
        attends each row's own token. Where `rows.packs`, the answer may instead be the selection packed as
        `cache.SelectedRows` (the runtime then reads those rows as they are)."""
        return ALL

    def reads_all(self, session) -> bool:
        """Whether every layer of the current decoding step reads all of its entries, known before the step's
        first layer: `keep` would answer ALL at every layer, so the runtime need not ask it (a dense step runs
        as the full cache's). The default: `keep` is this base class's."""
        return type(self).keep is Policy.keep

    def known_ahead(self, layer: int, session) -> bool:
        """Whether `keep(layer)` can be answered now, before the layer's query exists (placement then fetches
        the rows one layer ahead, overlapped with compute; the layer reads exactly that answer)."""
        return not self.needs_query

    def reselects(self, layer: int, session) -> bool:
        """Whether the layer selects again with its own query at its attention although `keep` answered one
        layer ahead: the early answer was what placement prefetched, the layer reads its own selection and the
        store fetches on demand only the rows the prefetch missed."""
        return False

    def observe(self, layer: int, weights: torch.Tensor, rows: torch.Tensor, own: torch.Tensor, session) -> None:
        """The attention weights of a decoding step at `layer`, each summed over a KV head's query heads: weights
        [B, n] of the entries read, whose rows in the store's flat [B * Hkv * capacity] order are rows [B, n]
        (padding: weight 0), and own [B, Hkv] of each row's current token. Called when `needs_weights`."""

    def on_append(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, session) -> None:
        pass

    def remainder_at(self, layer: int, session) -> Remainder | None:
        """After `keep` at `layer`: the remainder, the estimated contribution of the entries its answer leaves
        unread (`infinigen.selection.Remainder`), which the runtime adds to the attention over the selection on
        every path; None (the default): attention is over the selection alone. Asked once per attention call,
        after the keep it answers for."""
        return None

    def keys_beside(self, layer: int, session) -> torch.Tensor | None:
        """After `keep` at `layer`: per (batch row, KV head, row) the keys read beyond the selection to make it
        (a re-rank's candidates; counted as half an entry each, a key without its value), or None (the default:
        the selection is all that was read from the store's keys). Asked once per attention call."""
        return None

    def selects(self, layer: int) -> bool:
        """Whether the policy selects entries at `layer` (False: it reads them all there, `keep` is not asked)."""
        return True

    def for_random_weights(self, model, fixed_ratio: float | None) -> "Policy":
        """This policy for a model with random weights (`infinigen bench --synthetic`), where choices made
        from the weights mean nothing: a policy that would make them fetches `fixed_ratio` instead.
        With model None, only checks that it can (a UserError otherwise), before a large model is built."""
        return self

    def memory_report(self, model, state, kv_bytes: int) -> dict | None:
        """What the policy's own state costs next to the weights and the KV cache (`infinigen bench`);
        None when it keeps nothing worth reporting."""
        return None

    def fast_tier_bytes(self, state) -> dict:
        """Bytes of the tensors a session's state keeps in the fast tier, by attribute (memory accounting)."""
        fields = vars(state) if hasattr(state, "__dict__") else {}
        out = {k: tensor_bytes(v) for k, v in fields.items() if k != "model"}
        return {k: v for k, v in out.items() if v}


@dataclass(frozen=True)
class FullCache(Policy):
    """Every cached entry, every step: the exact dense result."""
    name = "full"
    exact = True
    needs_query = False


__all__ = ["Policy", "FullCache", "ALL", "All", "Remainder", "Rows", "tensor_bytes", "parse_layers", "jsonable"]
