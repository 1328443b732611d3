"""KV-cache methods, each a small class behind `Policy`, made by name with `make_policy`."""
from __future__ import annotations

import dataclasses
import importlib

from ..errors import UserError
from .base import FullCache, Policy

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


def make_policy(name: str, **knobs) -> Policy:
    """A policy by name; knobs that the policy does not have are ignored (None means its default)."""
    cls = policy_class(name)
    fields = {f.name for f in dataclasses.fields(cls)}
    policy = cls(**{k: v for k, v in knobs.items() if k in fields and v is not None})
    check = getattr(policy, "validate", None)
    if check:
        check()
    return policy


__all__ = ["Policy", "FullCache", "make_policy", "policy_class", "REGISTRY"]
