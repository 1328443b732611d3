"""The policy interface, as the methods in this package import it: it lives one floor down, in
`infinigen.policy`, so the runtime that calls its hooks imports nothing from the methods."""
from __future__ import annotations

from ..policy import (ALL, NOT_A_KNOB, All, FullCache, Policy, Remainder, Rows, jsonable, knob_fields, parse_layers,
                      tensor_bytes)

__all__ = ["Policy", "FullCache", "ALL", "All", "Remainder", "Rows", "tensor_bytes", "parse_layers", "jsonable",
           "knob_fields", "NOT_A_KNOB"]
