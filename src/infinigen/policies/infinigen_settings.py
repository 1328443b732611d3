"""InfiniGen's knobs as data: the choices each knob takes, the defaults, the presets (each lists only what it
changes from the defaults), what calibration chooses, and the checks every knob value passes.

Why each preset is what it is, with the measurements: results/presets.md.
"""
from __future__ import annotations

from ..errors import UserError

BUDGETS = ("mean", "per_head", "union", "layer")
SPEC_INPUTS = ("attn_in", "attn_out")
KEY_MODES = ("partial", "int4")
# which query selects a layer's entries (knob `query`): the one speculated a layer ahead (the paper: its rows can
# be fetched while the layer before runs), the layer's own (after its projection, scored against the same
# speculation keys: nothing is fetched ahead), or the own query where the KV is in fast memory (no transfer
# to overlap, so nothing is lost by waiting for it) and the speculated one where placement fetches from a slower tier
QUERIES = ("ahead", "own", "auto")

# The one default. `prepare` calibrates this model's alpha, kv_budget, layer 0 and the remainder on held-apart
# tokens (policies/calibrate.py); the values below are the starting point and what applies where no calibration
# can run (no tokenizer, a model shorter than budget_ref). Chosen over the presets by the validation texts on two
# families (results/accuracy_models.md): the tokens read grow as sqrt(length), so the 20% over a 2048-token run is
# 10% over 8192 and 5% over 32K; the search chose the largest budget under that bound on both families, alpha 7
# on SmolLM2 and 9 on Gemma 3, and the remainder (from layer 1 on SmolLM2), with each layer's own query where the
# KV is in fast memory ("auto"). `dense_below` is left to `prepare`: where selection pays on this machine,
# measured once (policies/crossing.py).
DEFAULTS = dict(alpha=9.0, partial_ratio=0.3, max_fetch_ratio=None, min_fetch=32,
                dense_layers=(), budget="layer", spec_input="attn_out", key_mode="int4", skew=True,
                kv_budget=0.13, budget_power=0.0, exact_first=True, budget_growth=0.5, budget_ref=2048,
                calibrate=True, remainder=True, remainder_from=1, query="auto")

# preset -> the knobs it changes from DEFAULTS
PRESET_CHANGES = {
    # the paper, sections 4.2-4.3: alpha 4 for OPT, 5 for Llama; r 0.3; a 20% cap per layer; layers 0, 1 dense
    "paper": dict(alpha={"opt": 4.0, "llama": 5.0}, max_fetch_ratio=0.2, min_fetch=0, dense_layers=(0, 1),
                  budget="mean", spec_input="attn_in", key_mode="partial", kv_budget=None, exact_first=False,
                  budget_growth=1.0, calibrate=False, remainder=False, remainder_from=0, query="ahead",
                  dense_below=0),
    "default": {},
    # the earlier default (`--knob preset=flat`): a flat 14% cap per selecting layer at every length, layers 0 and 1
    # dense, with what the selection leaves unread added (Emma +2.65% -> +0.76%, Mansfield Park +2.59% ->
    # +2.12% at 2048: results/accuracy.md). Under 20% of the KV at 2048 but not less at 8192 (results/accuracy.md)
    "flat": dict(alpha=7.0, max_fetch_ratio=0.14, dense_layers=(0, 1), kv_budget=None, exact_first=False,
                 budget_growth=1.0, calibrate=False, remainder_from=0, query="ahead", dense_below=0),
    # `--knob preset=budget`: one all-layer bound that shrinks with the context (the
    # remainder, with the speculated query, made it worse: +1.44% -> +3.14%)
    "budget": dict(calibrate=False, remainder=False, remainder_from=0, query="ahead", dense_below=0),
}
# preset -> every knob value it gives
PRESETS = {name: DEFAULTS | changes for name, changes in PRESET_CHANGES.items()}

# what `calibrate` chooses per model (policies/calibrate.py), unless the caller sets it
CALIBRATED = ("alpha", "kv_budget", "max_fetch_ratio", "budget_growth", "exact_first", "dense_layers", "remainder",
              "remainder_from", "budget")
# perplexity within 0.5% of the full cache's on the calibration tokens: half the 1% a user is promised, as a margin
# for text the calibration never saw (SmolLM2, own query with the remainder at the largest budget: Mansfield
# Park +0.17%, the three validation texts +0.09% to +0.71%; at 14% of the KV, chosen with a 1% target, Mansfield
# Park +0.80% and Pride and Prejudice +0.93%)
CALIBRATE_TARGET = 0.005
CALIBRATE_BOUND = 0.2  # at most 20% of the KV read over all layers at budget_ref tokens (10% at 4x: growth 0.5)
CALIBRATE_TEXT = "mansfieldpark"  # held apart: the skew calibrates on emma, evaluation reads the other three
CALIBRATE_GROWTH = 0.5  # the tokens read grow as n ** 0.5: the bound at 4x the length is half the share


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_bounds(p) -> None:
    """UserError for a share, count or bound of policy `p` out of its range."""
    if p.alpha is not None and not p.alpha > 0:
        raise UserError(f"alpha must be positive, got {p.alpha}")
    if not 0 < p.partial_ratio <= 1:
        raise UserError(f"partial ratio must be in (0, 1], got {p.partial_ratio}")
    if (p.kv_budget is None) == (p.max_fetch_ratio is None):
        raise UserError("give one of kv_budget (all layers) and max_fetch_ratio (per selecting layer)")
    if p.kv_budget is not None and not 0 < p.kv_budget <= 1:
        raise UserError(f"kv budget must be in (0, 1], got {p.kv_budget}")
    if p.max_fetch_ratio is not None and not 0 < p.max_fetch_ratio <= 1:
        raise UserError(f"max fetch ratio must be in (0, 1], got {p.max_fetch_ratio}")
    if not _number(p.budget_power) or p.budget_power < 0:
        raise UserError(f"budget power must be a number >= 0, got {p.budget_power!r}")
    if not _number(p.budget_growth) or not 0 < p.budget_growth <= 1:
        raise UserError(f"budget growth must be in (0, 1], got {p.budget_growth!r}")
    if not _whole(p.budget_ref) or p.budget_ref < 1:
        raise UserError(f"budget ref must be a whole number of tokens >= 1, got {p.budget_ref!r}")
    if p.budget_growth != 1 and p.kv_budget is None:
        raise UserError("budget growth applies to kv_budget (give kv_budget instead of max_fetch_ratio)")
    if not _whole(p.block) or p.block < 1:
        raise UserError(f"block must be a whole number of tokens >= 1, got {p.block!r}")
    if p.block > 1 and p.budget != "layer":
        raise UserError("block selection needs budget=layer")
    if not isinstance(p.exact_first, bool):
        raise UserError(f"exact_first must be true or false, got {p.exact_first!r}")
    if not _whole(p.min_fetch) or p.min_fetch < 0:
        raise UserError(f"min fetch must be a whole number of tokens >= 0, got {p.min_fetch}")


def check_choices(p) -> None:
    """UserError for a mode of policy `p` that is not one of its choices, or that another knob rules out."""
    if p.budget not in BUDGETS:
        raise UserError(f"budget must be one of {', '.join(BUDGETS)}, got {p.budget!r}")
    if p.spec_input not in SPEC_INPUTS:
        raise UserError(f"speculation input must be one of {', '.join(SPEC_INPUTS)}, got {p.spec_input!r}")
    if p.key_mode not in KEY_MODES:
        raise UserError(f"key mode must be one of {', '.join(KEY_MODES)}, got {p.key_mode!r}")
    if any(i < 0 for i in p.dense_layers):
        raise UserError("dense layers must be non-negative")
    if not isinstance(p.skew, bool):
        raise UserError(f"skew must be true or false, got {p.skew!r}")
    if p.dense_below is not None and (not _whole(p.dense_below) or p.dense_below < 0):
        raise UserError(f"dense below must be a whole number of cached tokens >= 0, got {p.dense_below!r}")
    if not _whole(p.remainder_from) or p.remainder_from < 0:
        raise UserError(f"remainder from must be a layer index >= 0, got {p.remainder_from!r}")
    if p.query not in QUERIES:
        raise UserError(f"query must be one of {', '.join(QUERIES)}, got {p.query!r}")
    if not isinstance(p.remainder, bool):
        raise UserError(f"remainder must be true or false, got {p.remainder!r}")
    if p.remainder and p.key_mode != "int4":
        raise UserError("remainder needs key_mode=int4: partial columns do not estimate the scores' scale")
    if not isinstance(p.key_centre, bool):
        raise UserError(f"key_centre must be true or false, got {p.key_centre!r}")
    if p.key_centre and p.key_mode != "int4":
        raise UserError("key_centre needs key_mode=int4 (it centres the packed 4-bit keys)")
    if not isinstance(p.calibrate, bool):
        raise UserError(f"calibrate must be true or false, got {p.calibrate!r}")
    if p.calibrate_target is not None and not 0 < p.calibrate_target < 1:
        raise UserError(f"calibrate target must be a relative perplexity in (0, 1), got {p.calibrate_target}")
    if p.calibrate_bound is not None and not 0 < p.calibrate_bound <= 1:
        raise UserError(f"calibrate bound must be a share of the KV in (0, 1], got {p.calibrate_bound}")
