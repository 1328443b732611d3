"""Several policies from one command line: `--policy full,infinigen,h2o --knob alpha=5 --knob h2o.heavy_ratio=0.05`.

A knob `NAME=VALUE` goes to every listed policy that has a field NAME (an error if none has it);
`POLICY.NAME=VALUE` goes to that policy only. Values are typed by the policy's dataclass fields
(`infinigen.policies.knobs`).
"""
from __future__ import annotations

from ..policies.knobs import knob_dict, parse_policies  # noqa: F401 (re-exported: the one knob parser)


def prepare(policies: dict, model, tokenizer, progress: bool = False) -> dict:
    """`Policy.prepare` for each (InfiniGen: skew matrices from the cache, or calibrated once and cached): each
    entry of `policies` replaced by the prepared policy, and `policies` returned."""
    for name, p in policies.items():
        policies[name] = p.prepare(model, tokenizer, progress=progress)
    return policies
