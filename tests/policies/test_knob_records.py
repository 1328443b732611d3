"""InfiniGen's knobs are declared in two typed records, the user's and the lab-only ones, each knob with one line
of doc and its bounds or choices, held at construction; the presets list only what they change from the defaults;
the `--knob` surface is every declared knob, as before."""
from __future__ import annotations

import dataclasses

import pytest

from infinigen.errors import UserError
from infinigen.policies import knob_types, make_policy
from infinigen.policies.infinigen import InfiniGen
from infinigen.policies.infinigen_settings import (DEFAULTS, PRESET_CHANGES, PRESETS, InfiniGenExperimental,
                                                   InfiniGenSettings)
from infinigen.policies.knobs import make_policy_from_cli

USER = [f.name for f in dataclasses.fields(InfiniGenSettings)]
LAB = [f.name for f in dataclasses.fields(InfiniGenExperimental)]


def test_every_knob_is_declared_once_with_a_line_of_doc():
    assert len(USER) <= 10 and not set(USER) & set(LAB)
    assert set(knob_types("infinigen")) == set(USER) | set(LAB)
    for f in dataclasses.fields(InfiniGenSettings) + dataclasses.fields(InfiniGenExperimental):
        doc = f.metadata["doc"]
        assert doc and "\n" not in doc and len(doc) <= 110, f.name


def test_the_presets_list_only_what_they_change():
    assert PRESET_CHANGES["default"] == {}
    for name, changes in PRESET_CHANGES.items():
        assert all(DEFAULTS.get(k, "unset") != v for k, v in changes.items()), name
        assert PRESETS[name] == DEFAULTS | changes


def _outside(f) -> list:
    """Values just outside a declared knob's bounds or choices."""
    d = f.metadata
    out = []
    if d["choices"]:
        out.append("not-a-choice")
    if d["low"] is not None:
        out.append(d["low"] if d["low_open"] else d["low"] - 1)
    if d["high"] is not None:
        out.append(d["high"] + 0.5)
    return out


@pytest.mark.parametrize("f", dataclasses.fields(InfiniGenSettings) + dataclasses.fields(InfiniGenExperimental),
                         ids=lambda f: f.name)
def test_a_value_outside_a_declared_bound_is_refused(f):
    values = _outside(f)
    for v in values:
        if isinstance(v, float) and f.type.startswith("int"):
            continue  # a whole-number knob refuses a fraction by its type already
        with pytest.raises(UserError):
            InfiniGen(**{f.name: v})


def test_the_edges_a_declaration_allows_are_accepted():
    pol = InfiniGen(kv_budget=1.0, budget_growth=1.0, alpha=1e-3, min_fetch=0, block=1, budget_ref=1, dense_below=0,
                    remainder_from=0, budget_power=0.0, dense_layers=(0,), calibrate_bound=1.0, partial_ratio=1.0)
    assert pol.kv_budget == 1.0 and pol.budget_ref == 1 and pol.dense_layers == (0,)


def test_the_knob_surface_is_as_before():
    """`--knob` takes each declared knob by name, the user's and the lab-only ones alike."""
    pol = make_policy_from_cli("infinigen", ["alpha=6", "key_centre=true", "budget_ref=1024", "query=own"])
    assert (pol.alpha, pol.key_centre, pol.budget_ref, pol.query) == (6.0, True, 1024, "own")
    assert make_policy("infinigen", kv_budget=0.2).settings()["kv_budget"] == 0.2
