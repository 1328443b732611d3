"""Issue 10 A: policies are frozen knobs with their state on the session, `prepare` gets what a policy
needs from the model, placement builds the store, and every entry point takes a placement."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from infinigen import runtime
from infinigen.errors import UserError
from infinigen.placement import Placement
from infinigen.policies import REGISTRY, knob_types, make_policy


# ---- knobs ------------------------------------------------------------------------------------------
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
    s = make_policy("infinigen").settings()
    assert s["alpha"] == 7.0 and s["max_fetch_ratio"] == 0.14 and s["dense_layers"] == [0, 1]
    assert s["kv_budget"] is None and s["exact_first"] is False
    b = make_policy("infinigen", preset="budget").settings()  # issue 12's candidate: one all-layer bound
    assert b["alpha"] == 9.0 and b["kv_budget"] == 0.13 and b["budget_growth"] == 0.5 and b["max_fetch_ratio"] is None and b["dense_layers"] == []
    json.dumps(s)  # JSON-able
    _, llama = make_tiny("llama")
    _, opt = make_tiny("opt")
    paper = make_policy("infinigen", preset="paper")
    assert paper.settings()["alpha"] == {"opt": 4.0, "llama": 5.0}  # depends on the architecture...
    assert paper.settings(llama)["alpha"] == 5.0 and paper.settings(opt)["alpha"] == 4.0  # ...resolved per model


def test_one_policy_object_serves_sessions_side_by_side(make_tiny):
    """State lives on the session: interleaving two sessions of one policy changes nothing."""
    _, model = make_tiny("llama")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 256, (1, 30), generator=g), torch.randint(0, 256, (1, 30), generator=g)
    shared = make_policy("h2o", heavy=4, recent=3)

    def alone(tokens):
        s = Placement().new_session(model, 1, 30, make_policy("h2o", heavy=4, recent=3))
        out = [runtime.prefill(model, tokens[:, :20], s)]
        out += [runtime.decode(model, tokens[:, t], s) for t in range(20, 29)]
        return torch.stack(out)

    sa, sb = Placement().new_session(model, 1, 30, shared), Placement().new_session(model, 1, 30, shared)
    out_a, out_b = [runtime.prefill(model, a[:, :20], sa)], [runtime.prefill(model, b[:, :20], sb)]
    for t in range(20, 29):
        out_a.append(runtime.decode(model, a[:, t], sa))
        out_b.append(runtime.decode(model, b[:, t], sb))
    assert torch.equal(torch.stack(out_a), alone(a)) and torch.equal(torch.stack(out_b), alone(b))


# ---- prepare ---------------------------------------------------------------------------------------
def test_infinigen_generates_on_a_fresh_install(tiny_checkpoint, tmp_path, monkeypatch):
    """No `infinigen skew` beforehand: `prepare` calibrates once and caches the artifact."""
    from infinigen import generate, load
    from infinigen.skew import find_cached_skew
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    model, tok, _ = load(tiny_checkpoint, progress=False)
    assert find_cached_skew(model) is None
    g = generate(model, tok, ["It is a truth"], max_new_tokens=4, policy=make_policy("infinigen"))
    assert len(g.tokens[0]) == 4 and find_cached_skew(model) is not None


def test_cli_generate_infinigen_on_a_fresh_install(tiny_checkpoint, tmp_path, monkeypatch, capfd):
    from infinigen.cli import main
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    code = main(["generate", "--model", str(tiny_checkpoint), "-p", "It is a truth", "-n", "4", "--policy", "infinigen"])
    assert code == 0, capfd.readouterr().err


def test_hf_enable_rejects_unknown_knobs():
    from transformers import LlamaConfig, LlamaForCausalLM

    import infinigen.hf
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    m = LlamaForCausalLM(cfg).eval()
    with pytest.raises(UserError, match="no knob 'heavy_ration'"):
        with infinigen.hf.enable(m, "h2o", heavy_ration=0.1):
            pass


# ---- placement ---------------------------------------------------------------------------------------
def test_placement_checks_its_values():
    for bad in (dict(kv_offload="tape"), dict(evict="random"), dict(capacity=0), dict(capacity=math.nan),
                dict(capacity=2.5), dict(pool_bytes=0), dict(protect_recent=-1), dict(disk_bulk_share=1.5),
                dict(disk_bulk_share=-0.1), dict(disk_bulk_share=True)):
        with pytest.raises(UserError):
            Placement(**bad)


def test_one_capacity_resolver(make_tiny):
    _, model = make_tiny("llama")
    assert Placement().pool_tokens(model, 2, 100) == 100
    assert Placement(capacity=40).pool_tokens(model, 2, 100) == 40
    assert Placement(capacity=0.8).pool_tokens(model, 2, 100) == 80  # a share of the sequence
    assert Placement(capacity=1000).pool_tokens(model, 2, 100) == 100
    per = 2 * model.cfg.num_layers * 2 * model.cfg.num_kv_heads * model.cfg.head_dim * 4
    assert Placement(pool_bytes=10 * per).pool_tokens(model, 2, 100) == 10
    assert Placement(capacity=8, pool_bytes=10 * per).pool_tokens(model, 2, 100) == 8
    store = Placement(capacity=40).new_store(model, 2, 100)
    assert store.capacity == 40 and store.allocator is not None  # a limit below the length evicts
    assert Placement().new_store(model, 2, 100).allocator is None


def test_cli_generate_kv_on_disk_gives_the_same_tokens(tiny_checkpoint, tmp_path, capfd):
    from infinigen.cli import main
    argv = ["generate", "--model", str(tiny_checkpoint), "-p", "It is a truth universally", "-n", "10",
            "--policy", "h2o", "--knob", "heavy=3", "--knob", "recent=2"]
    assert main(argv) == 0
    ref = capfd.readouterr().out
    assert main(argv + ["--kv-offload", "disk", "--pool-dir", str(tmp_path)]) == 0
    assert capfd.readouterr().out == ref
    assert list(tmp_path.iterdir()) == []  # the pool file is gone


@pytest.mark.parametrize("cmd", [["generate", "-p", "hi"], ["ppl", "--ctx", "64", "--prefill", "16"],
                                 ["needle"], ["fewshot"]])
def test_placement_options_on_every_command(tiny_checkpoint, cmd, capfd):
    from infinigen.cli import main
    code = main([*cmd, "--model", str(tiny_checkpoint), "--kv-offload", "tape"])
    err = capfd.readouterr().err
    assert code == 2 and "--kv-offload" in err and "Traceback" not in err


def test_ppl_json_records_the_effective_settings(tiny_checkpoint, tmp_path, capfd):
    from infinigen.cli import main
    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 20)
    out = tmp_path / "r.json"
    code = main(["ppl", "--model", str(tiny_checkpoint), "--text", str(text), "--ctx", "64", "--prefill", "16",
                 "--policy", "infinigen", "--kv-offload", "disk", "--capacity", "48", "--json", str(out)])
    assert code == 0, capfd.readouterr().err
    r = json.loads(out.read_text())
    assert r["settings"]["alpha"] == 7.0 and r["kv_offload"] == "disk" and r["capacity"] == 48


def test_hf_enable_takes_a_placement(tmp_path):
    """transformers' generate() with the KV pool on disk gives the in-memory tokens; the file goes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import infinigen.hf
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
                      pad_token_id=0)
    m = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(1, 96, (2, 12))
    outs = []
    for placement in (None, Placement("disk", pool_dir=str(tmp_path))):
        with infinigen.hf.enable(m, "h2o", placement=placement, heavy=3, recent=2), torch.no_grad():
            outs.append(m.generate(input_ids=ids, max_new_tokens=6, do_sample=False))
    assert torch.equal(outs[0], outs[1]) and list(tmp_path.iterdir()) == []
