"""KV-cache methods, each a small frozen dataclass of knobs behind `Policy`, made by name with `make_policy`."""
from __future__ import annotations

import importlib
import types
import typing

from ..errors import UserError
from .base import FullCache, Policy, knob_fields

# name -> "module:Class"; modules are imported on first use so the CLI starts fast
REGISTRY = {
    "full": "base:FullCache",
    "infinigen": "infinigen:InfiniGen",
    "h2o": "h2o:H2O",
    "int4": "quant:Int4",
    "streaming": "streaming:StreamingLLM",
    "oracle": "oracle:Oracle",
}


def policy_class(name: str) -> type[Policy]:
    if name not in REGISTRY:
        raise UserError(f"unknown policy {name!r}; choose from {', '.join(REGISTRY)}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def knob_types(name: str) -> dict[str, type]:
    """The knobs of policy `name`: field name -> python type (float, int, bool, str or tuple), with
    `X | None` read as X (None means the default or preset value)."""
    cls = policy_class(name)
    hints = typing.get_type_hints(cls)
    out = {}
    for f in knob_fields(cls):
        t = hints[f.name]
        if typing.get_origin(t) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(t) if a is not type(None)]
            t = args[0] if len(args) == 1 else str
        out[f.name] = typing.get_origin(t) or t
    return out


def make_policy(name: str, **knobs) -> Policy:
    """A policy by name with these knobs (None: the default); an unknown knob name is an error."""
    cls = policy_class(name)
    valid = knob_types(name)
    unknown = [k for k in knobs if k not in valid]
    if unknown:
        have = ", ".join(valid) or "none"
        raise UserError(f"policy {name!r} has no knob {unknown[0]!r}; its knobs: {have}")
    try:
        return cls(**{k: v for k, v in knobs.items() if v is not None})
    except (TypeError, ValueError) as e:
        raise UserError(f"bad knob for policy {name!r}: {e}")


__all__ = ["Policy", "FullCache", "make_policy", "policy_class", "knob_types", "REGISTRY"]
