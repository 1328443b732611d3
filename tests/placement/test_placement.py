"""Placement: its values are checked, one resolver sizes the KV pool, every entry point takes a placement
(generate, ppl, needle, fewshot, `infinigen.hf`), and the pool on disk gives the in-memory tokens."""
from __future__ import annotations

import math

import pytest
import torch

from infinigen.errors import ArgumentError, UserError
from infinigen.placement import Placement


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


@pytest.mark.parametrize("kwargs, argument", [
    ({"kv_offload": "ssd"}, "kv_offload"), ({"evict": "random"}, "evict"), ({"capacity": -3}, "capacity"),
    ({"capacity": 2.5}, "capacity"), ({"pool_bytes": 0}, "pool_bytes"), ({"protect_recent": -1}, "protect_recent"),
    ({"disk_bulk_share": 2.0}, "disk_bulk_share"),
])
def test_placement_errors_name_the_argument_not_a_flag(kwargs, argument):
    """A library error speaks of the argument the caller passed; only the CLI knows the flag."""
    with pytest.raises(ArgumentError) as e:
        Placement(**kwargs)
    assert e.value.argument == argument and str(e.value).startswith(f"{argument} ") and "--" not in str(e.value)
    # the CLI's form of the same error (tests/test_ppl.py runs it): "--capacity must be ..."

