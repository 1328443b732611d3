"""Policy knobs: a frozen dataclass per policy, every value checked (an unknown name, NaN or infinity is a
UserError naming it), typed by its field, and shown as in effect in `settings()` and in the JSON results."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from infinigen.errors import UserError
from infinigen.policies import REGISTRY, knob_types, make_policy


def test_unknown_knob_is_an_error_naming_it():
    with pytest.raises(UserError, match="no knob 'alhpa'.*alpha"):
        make_policy("infinigen", alhpa=3)
    with pytest.raises(UserError, match="no knob 'matrices'"):  # a resource, not a knob
        make_policy("infinigen", matrices=torch.eye(2))
    assert make_policy("h2o", heavy=None).heavy is None  # None: the default


@pytest.mark.parametrize("name,knob", [("infinigen", "alpha"), ("h2o", "heavy_ratio"), ("streaming", "ratio"),
                                       ("oracle", "alpha"), ("oracle", "ratio"), ("infinigen", "max_fetch_ratio")])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_nan_and_inf_knobs_are_rejected(name, knob, value):
    with pytest.raises(UserError, match=knob):
        make_policy(name, **{knob: value})


def test_knob_types_follow_the_fields():
    t = knob_types("infinigen")
    assert t["alpha"] is float and t["min_fetch"] is int and t["skew"] is bool and t["budget"] is str
    assert t["dense_layers"] is tuple and "matrices" not in t
    assert knob_types("h2o") == {"heavy": int, "recent": int, "heavy_ratio": float, "recent_ratio": float}
    assert knob_types("full") == {}
    for name in REGISTRY:  # every policy is a frozen dataclass: knobs cannot change under a session
        pol = make_policy(name)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(pol, next(iter(knob_types(name)), "x"), 1)


def test_settings_show_the_values_in_effect(make_tiny):
    s = make_policy("infinigen").settings()  # calibrated per model in prepare(), from these values
    assert s["alpha"] == 9.0 and s["kv_budget"] == 0.13 and s["budget_growth"] == 0.5 and s["calibrate"] is True
    f = make_policy("infinigen", preset="flat").settings()  # one cap per layer, two dense layers
    assert f["alpha"] == 7.0 and f["max_fetch_ratio"] == 0.14 and f["dense_layers"] == [0, 1] and f["remainder"]
    assert f["kv_budget"] is None and f["exact_first"] is False and s["exact_first"] is True
    b = make_policy("infinigen", preset="budget").settings()  # one all-layer bound
    assert b["alpha"] == 9.0 and b["kv_budget"] == 0.13 and b["budget_growth"] == 0.5
    assert b["max_fetch_ratio"] is None and b["dense_layers"] == []
    json.dumps(s)  # JSON-able
    _, llama = make_tiny("llama")
    _, opt = make_tiny("opt")
    paper = make_policy("infinigen", preset="paper")
    assert paper.settings()["alpha"] == {"opt": 4.0, "llama": 5.0}  # depends on the architecture...
    assert paper.settings(llama)["alpha"] == 5.0 and paper.settings(opt)["alpha"] == 4.0  # ...resolved per model


def test_hf_enable_rejects_unknown_knobs():
    from transformers import LlamaConfig, LlamaForCausalLM

    import infinigen.hf
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    m = LlamaForCausalLM(cfg).eval()
    with pytest.raises(UserError, match="no knob 'heavy_ration'"):
        with infinigen.hf.enable(m, "h2o", heavy_ration=0.1):
            pass


def test_ppl_json_records_the_effective_settings(tiny_checkpoint, tmp_path, monkeypatch, capfd):
    from infinigen.cli import main
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))  # InfiniGen calibrates: not in the user's cache
    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 20)
    out = tmp_path / "r.json"
    code = main(["ppl", "--model", str(tiny_checkpoint), "--text", str(text), "--ctx", "64", "--prefill", "16",
                 "--policy", "infinigen", "--kv-offload", "disk", "--capacity", "48", "--json", str(out)])
    assert code == 0, capfd.readouterr().err
    r = json.loads(out.read_text())
    assert r["settings"]["alpha"] == 9.0 and r["kv_offload"] == "disk" and r["capacity"] == 48
    assert list((tmp_path / "cache" / "skew").glob("*.safetensors"))  # calibrated into the test's cache
