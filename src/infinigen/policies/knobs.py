"""The one `--knob NAME=VALUE` parser, for the CLI, lm-eval `model_args` and anything else that gets knobs
as text: each value is typed by the policy's dataclass field (NaN and inf refused), and an unknown knob
is an error naming the valid ones."""
from __future__ import annotations

import math
import types
import typing
from typing import Any, Literal, Union

from ..errors import UserError
from . import knob_types, make_policy, policy_class


def _type_name(tp) -> str:
    if tp is bool:
        return "true or false"
    if tp is int:
        return "a whole number"
    if tp is float:
        return "a finite number"
    if tp is str:
        return "text"
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if tp is tuple or typing.get_origin(tp) is tuple:
        return "a comma-separated list"
    return "a value"


def parse_value(text: str, tp) -> Any:
    """`text` as a value of type `tp`; ValueError with what was expected when it is not one."""
    t = text.strip()
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if type(None) in args and t.lower() in ("none", "null"):
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in sorted(inner, key=lambda a: a is str):  # text last: it accepts anything
            try:
                return parse_value(t, a)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(" or ".join(errors))
    if tp is bool:
        if t.lower() in ("true", "yes", "on", "1"):
            return True
        if t.lower() in ("false", "no", "off", "0"):
            return False
        raise ValueError("true or false")
    if tp is int:
        try:
            return int(t)
        except ValueError:
            raise ValueError("a whole number")
    if tp is float:
        try:
            v = float(t)
        except ValueError:
            raise ValueError("a number")
        if not math.isfinite(v):
            raise ValueError("a finite number")
        return v
    if tp is str:
        return t
    if origin is Literal:
        for a in args:
            if str(a) == t:
                return a
        raise ValueError(_type_name(tp))
    if tp is tuple or origin is tuple:
        elem = args[0] if args and (len(args) == 1 or args[-1] is Ellipsis) else Any
        return tuple(parse_value(s, elem) for s in t.split(",") if s.strip())
    # untyped (Any): a bool, None, a number or a comma-separated list of numbers, else the text
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    if t.lower() in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            v = cast(t)
        except ValueError:
            continue
        if not math.isfinite(v):
            raise ValueError("a finite number")
        return v
    return t


def _shown(text: str, limit: int = 40) -> str:
    """Text for a one-line message: as is, or its start and its length when it is long (a 5000-digit number)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _split(kv: str) -> tuple[str | None, str, str]:
    if "=" not in kv:
        raise UserError(f"--knob expects NAME=VALUE or POLICY.NAME=VALUE, got {_shown(kv)}")
    key, text = kv.split("=", 1)
    key = key.strip().replace("-", "_")
    target = None
    if "." in key:
        target, key = key.split(".", 1)
    return target, key, text


def _typed(policy: str, key: str, text: str, kv: str, types_: dict):
    try:
        return parse_value(text, types_[key])
    except ValueError as e:
        raise UserError(f"--knob {kv if len(kv) <= 40 else key}: {key} of policy {policy!r} takes {e}, "
                        f"got {_shown(text.strip())}")


def _make(kind: str, label: str, values: dict):
    try:
        return make_policy(kind, **values)
    except (TypeError, ValueError) as e:
        raise UserError(f"bad knob for policy {label!r}: {str(e).splitlines()[0]}")


def knob_dict(name: str, knobs: list[str] | None, base: dict | None = None) -> dict:
    """The `--knob` settings of the one policy `name`, typed and checked (the policy accepts them)."""
    types_ = knob_types(name)
    out = dict(base or {})
    for kv in knobs or []:
        target, key, text = _split(kv)
        if target not in (None, name):
            raise UserError(f"--knob {_shown(kv)}: this command runs policy {name!r} only")
        if key not in types_:
            raise UserError(f"policy {name!r} has no knob {key!r}; its knobs: {', '.join(types_) or 'none'}")
        out[key] = _typed(name, key, text, kv, types_)
    _make(name, name, out)
    return out


def make_policy_from_cli(name: str, knobs: list[str] | None = None, base: dict | None = None):
    """The policy `name` with `base` settings and `--knob` settings on top."""
    policy_class(name)  # an unknown name: the registry's message
    return _make(name, name, knob_dict(name, knobs, base))


def parse_policies(spec: str | list[str], knobs: list[str] | None = None) -> dict:
    """name -> Policy for `--policy a,b,c` (a name may carry a label: "h2o@small"). A knob `NAME=VALUE`
    goes to every listed policy that has NAME (an error when none has); `POLICY.NAME=VALUE` to that one."""
    names = [s.strip() for part in ([spec] if isinstance(spec, str) else spec) for s in part.split(",") if s.strip()]
    if not names:
        raise UserError("no policy given")
    kinds = {n: n.split("@")[0] for n in names}
    for k in kinds.values():
        policy_class(k)
    types_ = {n: knob_types(k) for n, k in kinds.items()}
    values: dict[str, dict] = {n: {} for n in names}
    for kv in knobs or []:
        target, key, text = _split(kv)
        if target is not None and target not in names and target not in kinds.values():
            raise UserError(f"--knob {_shown(kv)}: policy {target!r} is not among {', '.join(names)}")
        hit = [n for n in names if (target is None or target in (n, kinds[n])) and key in types_[n]]
        if not hit:
            raise UserError(f"--knob {_shown(kv)}: no listed policy has a knob {key!r}")
        for n in hit:
            values[n][key] = _typed(kinds[n], key, text, kv, types_[n])
    return {n: _make(kinds[n], n, values[n]) for n in names}
