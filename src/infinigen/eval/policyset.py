"""Several policies from one command line: `--policy full,infinigen,h2o --knob alpha=5 --knob h2o.heavy_ratio=0.05`.

A knob `NAME=VALUE` goes to every listed policy that has a field NAME (an error if none has it);
`POLICY.NAME=VALUE` goes to that policy only. Values are read as int, float, bool or text.
"""
from __future__ import annotations

from ..errors import UserError


def _value(text: str):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def knob_dict(name: str, knobs: list[str] | None, base: dict | None = None) -> dict:
    """`NAME=VALUE` settings of one policy as a dict (checked: the policy must have each knob and
    accept the values)."""
    from ..policies import knob_types, make_policy
    fields = set(knob_types(name))
    out = dict(base or {})
    for kv in knobs or []:
        if "=" not in kv:
            raise UserError(f"--knob expects NAME=VALUE, got {kv!r}")
        key, text = kv.split("=", 1)
        key = key.strip().replace("-", "_").removeprefix(f"{name}.")
        if key not in fields:
            raise UserError(f"policy {name!r} has no knob {key!r}")
        out[key] = _value(text)
    try:
        make_policy(name, **out)
    except (TypeError, ValueError) as e:
        raise UserError(f"bad knob for policy {name!r}: {e}")
    return out


def parse_policies(spec: str | list[str], knobs: list[str] | None = None) -> dict:
    """name -> Policy, in the order given (a name may carry a label: "h2o@small" is H2O labelled so)."""
    from ..policies import knob_types, make_policy
    names = [s.strip() for part in ([spec] if isinstance(spec, str) else spec) for s in part.split(",") if s.strip()]
    if not names:
        raise UserError("no policy given")
    kinds = {n: n.split("@")[0] for n in names}
    fields = {n: set(knob_types(k)) for n, k in kinds.items()}
    values: dict[str, dict] = {n: {} for n in names}
    for kv in knobs or []:
        if "=" not in kv:
            raise UserError(f"--knob expects NAME=VALUE or POLICY.NAME=VALUE, got {kv!r}")
        key, text = kv.split("=", 1)
        key = key.strip().replace("-", "_")
        target = None
        if "." in key:
            target, key = key.split(".", 1)
            if target not in names and target not in kinds.values():
                raise UserError(f"--knob {kv!r}: policy {target!r} is not among {', '.join(names)}")
        hit = [n for n in names if (target is None or target in (n, kinds[n])) and key in fields[n]]
        if not hit:
            raise UserError(f"--knob {kv!r}: no listed policy has a knob {key!r}")
        for n in hit:
            values[n][key] = _value(text)
    out = {}
    for n in names:
        try:
            out[n] = make_policy(kinds[n], **values[n])
        except (TypeError, ValueError) as e:
            raise UserError(f"bad knob for policy {n!r}: {e}")
    return out


def prepare(policies: dict, model, tokenizer, progress: bool = False) -> None:
    """`Policy.prepare` for each (InfiniGen: skew matrices from the cache, or calibrated once and cached)."""
    for p in policies.values():
        p.prepare(model, tokenizer, progress=progress)
