"""Calibration's last stage: where no candidate of the search reached its target, the structural options are
tried one at a time on the best setting before the search gives up.

The search (policies/calibrate.py) varies the threshold, the budget, layer 0 and the remainder. Some models lose
the ranking for reasons none of those reach (results/recall/recall.md): 4-bit keys that spend their levels on what
every key of a layer shares (`key_centre`: pack each key less the layer's mean key), or one cap pooled over KV heads
that attend unlike each other (each KV head its own cap: budget "union" or "per_head"). Each option goes on top of
the best setting so far, so an option that lowered the loss stays under the ones after it, at the largest budget
under the bound; the stage stops at the first option that reaches the target. What each tried measured is
returned for the record and the warning.
"""
from __future__ import annotations

from typing import Callable

# knobs outside CALIBRATED that this stage may choose (a stored choice may hold them; the record shows them)
FALLBACK_KNOBS = ("key_centre",)


def key_options(base: dict) -> list[dict]:
    """The options on the speculation keys for a policy whose knobs before calibration are `base`: centred 4-bit
    keys where the keys are 4-bit and not centred already."""
    return [{"key_centre": True}] if base.get("key_mode") == "int4" and not base.get("key_centre") else []


def options_in_order(keys: tuple, budgets: tuple) -> list[dict]:
    """The order the stage tries them in: the keys' options first (they fix the ranking itself: recall 0.84 to
    0.93 on Gemma 3), then each way of counting the budget in `budgets`."""
    return [dict(k) for k in keys] + [{"budget": b} for b in budgets]


def try_structural(run: Callable, best: Callable, options: list[dict], at_largest_budget: Callable,
                   reaches: Callable) -> list[dict]:
    """Each option of `options` (knob dicts) on the knobs of `best()` (the best trial so far), at the budget
    `at_largest_budget(knobs)` gives (None: no budget fits the bound: the option is recorded as not run), scored
    by `run(knobs)` (a trial, recorded by the search); stops after the first trial that `reaches(trial)`. Returns
    per option tried: its knobs, the trial's nll and kv (None where it did not run) and whether it reached."""
    tried = []
    for option in options:
        knobs = at_largest_budget(dict(best().knobs, **option))
        if knobs is None:
            tried.append({"knobs": dict(option), "nll": None, "kv": None, "reached": False})
            continue
        trial = run(knobs)
        tried.append({"knobs": dict(option), "nll": trial.nll, "kv": trial.kv, "reached": bool(reaches(trial))})
        if tried[-1]["reached"]:
            break
    return tried
