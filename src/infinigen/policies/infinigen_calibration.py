"""InfiniGen's calibration for one model: the record of the settings a policy is built from.

`calibration_record(policy, model, tokenizer)` runs (or finds) the search of policies/calibrate.py for the knobs
the caller left to it (CALIBRATED) and returns a record: the knob values chosen (`chosen`), the knobs the caller
set, and what the choice measured. `InfiniGen.prepare` builds the policy it returns from the caller's knobs and
that record; the policy object it was called on is left as it was. The choice is remembered per model and search
key in this process, and stored in the skew artifact's metadata (the package ships it for its default model).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import weakref

from ..errors import UserError
from .base import jsonable
from .calibrate_fallback import FALLBACK_KNOBS, key_options
from .infinigen_settings import CALIBRATE_BOUND, CALIBRATE_GROWTH, CALIBRATE_TARGET, CALIBRATE_TEXT, CALIBRATED
from .speculation import _SKEWS, needs_skew

# Calibrated settings, per model and search key: the search runs once per process
_CHOICES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


# knobs added after choices were stored (the package's artifact among them), each with its default: a knob at
# its default is left out of a choice's key, so the choices stored before it existed keep their keys
KEYLESS_DEFAULTS = {"key_centre": False, "block_fetch": None, "rerank": None}


# setup entries left out of a search's key: `fixed` is keyed on its own; the keys' options change only a choice
# that missed its target, and a stored one that missed it without recording its fallbacks is searched again
# (`_stored_choice`), so the choices that reached theirs (the package's artifact among them) keep their keys
UNKEYED = ("fixed", "keys")


def search_setup(policy, model) -> dict:
    """What the search varies and what it keeps, for `model`: a function of the caller's knobs only."""
    from .calibrate import ALPHA_HIGH, ALPHA_LOW
    base, given = policy.base, policy.given
    structures = [{}]
    if not ({"exact_first", "dense_layers"} & given) and not model.cfg.local(0):
        # layer 0 selected with its exact query (every layer selects), or read densely (layer 1 speculated
        # from layer 0's output): which one costs less accuracy per entry read depends on the model
        structures = [{"exact_first": True, "dense_layers": []}, {"exact_first": False, "dense_layers": [0]}]
    elif not ({"exact_first", "dense_layers"} & given):
        # a local layer 0 reads its window whatever the policy: speculate every global layer
        structures = [{"exact_first": False, "dense_layers": []}]
    alphas = () if "alpha" in given else (ALPHA_HIGH, ALPHA_LOW)
    # a per-layer cap or a budget the caller gave is the bound; otherwise the search chooses kv_budget
    budget_free = not ({"kv_budget", "max_fetch_ratio"} & given)
    growth = base["budget_growth"] if "budget_growth" in given else CALIBRATE_GROWTH
    # (dense_below: the search measures selection at every length, whatever it is)
    # (knobs newer than the stored choices, at their defaults: left out, so those choices keep their keys)
    fixed = {k: v for k, v in base.items() if (k not in CALIBRATED or k in given) and k != "dense_below"
             and not (k in KEYLESS_DEFAULTS and v == KEYLESS_DEFAULTS[k])}
    # the remainder needs the int4 keys' scores (on the attention's scale)
    remainder = "remainder" not in given and base["key_mode"] == "int4"
    # where the target is out of reach: the other ways of counting the budget (per KV head), tried last
    budgets = [] if "budget" in given else [b for b in ("union", "per_head") if b != base["budget"]]
    # ... and before them, the options on the speculation keys (centred 4-bit keys)
    return dict(structures=structures, alphas=alphas, budget_free=budget_free, growth=growth, fixed=fixed,
                remainder=remainder, budgets=budgets, own_query=base["query"] != "ahead", keys=key_options(base))


def remainder_starts(policy, model, knobs: dict, growth: float) -> list[int]:
    """The layers from which calibration tries adding the remainder: the caller's `remainder_from`, else
    0 and the layer after the first selecting one (a model's first selecting layer may attend unlike the
    rest: SmolLM2's layer 0 lost about 3 points with it on Mansfield Park: +3.00% against +0.17% from layer 1)."""
    if "remainder_from" in policy.given:
        return [policy.base["remainder_from"]]
    selecting = candidate(policy, model, knobs, growth).selecting_layers(model.cfg)
    return [0] + [selecting[0] + 1] * (len(selecting) > 1)


def candidate(policy, model, knobs: dict, growth: float):
    """The policy of a calibration candidate: the caller's knobs, the preset's for the rest, `knobs` on top."""
    over = dict(knobs)
    if "dense_layers" in over:
        over["dense_layers"] = tuple(over["dense_layers"])
    if "kv_budget" in over:
        over.update(max_fetch_ratio=None, budget_growth=growth)
    pol = dataclasses.replace(type(policy)(**policy.base), calibrate=False, dense_below=0, **over)
    if policy.matrices is not None:
        pol.with_skew(policy.matrices)
    return pol


def calibration_record(policy, model, tokenizer, progress) -> dict:
    """The record of this model's calibrated settings for `policy` (see the module docstring): found in this
    process's memo or the skew artifact's metadata when this search ran before on the same tokens, else searched
    and stored there."""
    from ..paths import load_text
    from . import calibrate as cal
    setup = search_setup(policy, model)
    target = policy.calibrate_target or CALIBRATE_TARGET
    bound = policy.calibrate_bound or CALIBRATE_BOUND
    text = policy.calibrate_text or CALIBRATE_TEXT
    ref = policy.budget_ref
    if tokenizer is None:
        tokens = None
    else:
        tokens = cal.calibration_tokens(tokenizer, load_text(text), ref)
        if tokens.shape[1] < ref:
            raise UserError(f"calibration text {text!r} holds {tokens.shape[1]} tokens, fewer than budget_ref "
                            f"({ref}) the calibration runs over")
    if ref > model.cfg.max_position:
        raise UserError(f"budget_ref ({ref}) exceeds the model's {model.cfg.max_position} positions: "
                        "calibration runs over budget_ref tokens")
    skew = _SKEWS.get(model, {}).get(policy.calib) if needs_skew(policy, model) else None
    what = {"format": cal.FORMAT, "fingerprint": _fingerprint(model), "target": target,
            "bound": bound, "ref": ref, "text": text, "setup": {k: v for k, v in setup.items() if k not in UNKEYED},
            "fixed": {k: str(v) for k, v in sorted(setup["fixed"].items())},
            "tokens": None if tokens is None else hashlib.sha256(tokens.numpy().tobytes()).hexdigest()}
    key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
    memo = _CHOICES.setdefault(model, {})
    # the settings' source: "shipped" (the package's artifact), "cached" (the cache's), "computed" (searched
    # in this process)
    choice, source = memo.get(key, (None, None))
    if choice is None:
        choice, source = _stored_choice(policy, model, skew, key, setup)
    if choice is None:
        choice = _search(policy, model, tokens, key, setup, target, bound, text, progress)
        source = "computed"
        if getattr(skew, "meta", None) is not None:
            from ..skew import remember
            remember(skew, f"calibration-{key}", json.dumps(choice.to_dict()))
    memo[key] = (choice, source)
    return _record(policy, choice, setup, source)


def announce(record: dict) -> None:
    """The line `prepare` prints with a calibration's choice (and a warning where the target was not reached)."""
    print(f"InfiniGen calibrated ({record['source']}): {record['summary']}", file=sys.stderr)
    if not record["reached"]:
        print(f"warning: {record['warning']}", file=sys.stderr)


def _fingerprint(model) -> str:
    from ..skew import key_fingerprint
    return key_fingerprint(model)


def _stored_choice(policy, model, skew, key: str, setup: dict):
    """(choice, source) stored in the skew in use's metadata, else in the package's artifact for this model (a
    cache written by an earlier version holds other matrices: then the package's matrices and choice are used
    together); (None, None) when neither holds a choice a policy accepts."""
    from ..skew import shipped_holding
    from . import calibrate as cal
    meta = getattr(skew, "meta", None)
    name = f"calibration-{key}"
    twin = None
    if meta is not None and name not in meta and not getattr(skew, "computed_now", False):
        twin = shipped_holding(model, name)  # the key names the skew's calibration text too
    for found in (skew, twin):
        found_meta = getattr(found, "meta", None)
        if found_meta is None or name not in found_meta:
            continue
        try:
            stored = json.loads(found_meta[name])
            choice = cal.Choice.from_dict(stored, key, set(CALIBRATED + FALLBACK_KNOBS))
            if not choice.reached and (setup["keys"] or setup["budgets"]) and "fallbacks" not in stored:
                continue  # missed its target before the structural options were tried: search again
            candidate(policy, model, choice.knobs, setup["growth"])  # knobs a policy accepts
            if found is twin:
                _SKEWS.setdefault(model, {})[policy.calib] = twin
            return choice, "shipped" if getattr(found, "shipped", False) else "cached"
        except (ValueError, TypeError, KeyError, UserError):
            continue  # foreign or broken metadata: search again, never trust it
    return None, None


def _search(policy, model, tokens, key: str, setup: dict, target: float, bound: float, text: str, progress):
    from . import calibrate as cal
    if tokens is None:
        raise UserError("InfiniGen's calibration needs the tokenizer: give prepare() the tokenizer "
                        "(or set the knob calibrate=false)")
    ref = policy.budget_ref
    log = (lambda m: print(m, file=sys.stderr)) if progress else None
    if log:
        log(f"calibrating InfiniGen's settings on {text} ({ref} tokens; target {100 * target:g}%, "
            f"bound {100 * bound:g}% of the KV)")
    growth = setup["growth"]
    try:
        return cal.search(model, tokens, max(1, ref // 8), lambda k: candidate(policy, model, k, growth),
                          setup["structures"], setup["alphas"], setup["budget_free"], target, bound, growth, ref,
                          key, text, log=log,
                          remainder_starts=(lambda k: remainder_starts(policy, model, k, growth))
                          if setup["remainder"] else None, progress=progress,
                          own_query=setup["own_query"], budgets=tuple(setup["budgets"]),
                          key_options=tuple(setup["keys"]))
    except ValueError as e:
        raise UserError(f"cannot calibrate InfiniGen under a bound of {100 * bound:g}% of the KV ({e}): "
                        "raise calibrate_bound, or keep fewer layers dense")


def chosen_values(policy, choice, growth: float) -> dict:
    """Every knob value of the policy the choice makes: the values before calibration, the chosen on top."""
    values = dict(policy.base)
    values.update({k: tuple(v) if k == "dense_layers" else v for k, v in choice.knobs.items()})
    if "kv_budget" in choice.knobs:
        values.update(max_fetch_ratio=None, budget_growth=growth)
    return values


def _record(policy, choice, setup: dict, source: str) -> dict:
    """The record of a choice: what `settings()["calibration"]` shows, `chosen` being what the policy applies."""
    values = chosen_values(policy, choice, setup["growth"])
    varied = set(choice.knobs) | ({"max_fetch_ratio", "budget_growth"} if "kv_budget" in choice.knobs else set())
    chosen = {k: jsonable(values[k]) for k in CALIBRATED + FALLBACK_KNOBS if k in varied}
    vs_full = choice.loss_vs_full()
    fallbacks = [{"knobs": f["knobs"], "vs_full": None if f["nll"] is None else
                  math.exp(f["nll"] - choice.reference_nll) - 1, "kv": f["kv"], "reached": f["reached"]}
                 for f in choice.fallbacks]
    summary = (", ".join(f"{k} {v}" for k, v in chosen.items())
               + f" -> {100 * vs_full:+.2f}% vs the full cache, {100 * choice.kv:.1f}% of the KV read on "
               f"{choice.tokens} tokens of {choice.text} (target {100 * choice.target:g}%: "
               f"{'reached' if choice.reached else 'not reached under the bound'}; bound {100 * choice.bound:g}%)")
    warning = None if choice.reached else (
        f"InfiniGen's calibration did not reach its target: {100 * vs_full:+.2f}% vs the full cache (target "
        f"{100 * choice.target:g}%) with the lowest loss under the bound of {100 * choice.bound:g}% of the KV ("
        + ", ".join(f"{k} {v}" for k, v in chosen.items()) + f"; {len(choice.trials)} settings tried"
        + (f"; then {_tried_text(fallbacks)}" if fallbacks else "") + "); raise calibrate_bound or "
        "calibrate_target, or set the knobs by hand")
    return {"chosen": chosen, "set": sorted(policy.given), "reached": choice.reached, "warning": warning,
            "vs_full": vs_full, "kv": choice.kv, "kv_caps": choice.kv_caps, "kv_caps_long": choice.kv_caps_long,
            "target": choice.target, "bound": choice.bound, "text": choice.text, "tokens": choice.tokens,
            "prefill": choice.prefill, "key": choice.key, "source": source, "summary": summary,
            "fallbacks": fallbacks,
            # rows: the calibration tokens each trial scored (fewer where it stopped, certain to miss the target;
            # None in a choice stored before trials stopped early)
            "trials": [{"knobs": t["knobs"], "vs_full": math.exp(t["nll"] - choice.reference_nll) - 1,
                        "kv": t["kv"], "rows": t.get("rows")} for t in choice.trials],
            "rows": choice.tokens - choice.prefill}


def _tried_text(fallbacks: list) -> str:
    """The structural options tried, for the warning: "key_centre True +1.20%, budget union +1.45%"."""
    return ", ".join(" ".join(f"{k} {v}" for k, v in f["knobs"].items())
                     + (" (no budget fits the bound)" if f["vs_full"] is None else f" {100 * f['vs_full']:+.2f}%")
                     for f in fallbacks)
