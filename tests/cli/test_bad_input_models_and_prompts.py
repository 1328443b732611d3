"""`infinigen generate` given bad options, prompts, model files or checkpoints: one line on stderr, exit code 2,
no traceback, before any expensive work where possible (the console script as a real process too)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from support.cli import console
from support.cli import one_line_error as assert_one_line_error


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- options and prompts, then model files ------------------------------------------------------
BAD_OPTIONS = [
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--max-new-tokens", "-3"], "max-new-tokens"),
    (["--batch-size", "0"], "batch-size"),
    (["--temperature", "-0.5"], "temperature"),
    (["--top-k", "-1"], "top-k"),
    (["--top-p", "0"], "top-p"),
    (["--top-p", "1.5"], "top-p"),
    (["--seed", "-1"], "seed"),
    (["--max-new-tokens", "many"], "max-new-tokens"),  # not a number: click's message, same format
    (["--dtype", "float64"], "dtype"),
    (["--device", "tpu"], "device"),
    (["--policy", "nonsense"], "policy"),
    (["--knob", "alpha"], "knob"),
    (["--no-such-option"], "no-such-option"),
]


@pytest.mark.parametrize("extra,needle", BAD_OPTIONS, ids=[" ".join(e) for e, _ in BAD_OPTIONS])
def test_out_of_range_options(cli, tiny_checkpoint, extra, needle):
    code, out, err = cli("generate", "--model", tiny_checkpoint, "--prompt", "hello", *extra)
    assert_one_line_error(code, err, needle)
    assert out == ""


def test_unknown_policy_knob(cli, tiny_checkpoint):
    code, _, err = cli("generate", "--model", tiny_checkpoint, "-p", "hi", "--knob", "no_such_knob=3")
    assert_one_line_error(code, err, "no_such_knob")


@pytest.mark.parametrize("prompt", ["", "   \n "])
def test_empty_prompt(cli, tiny_checkpoint, prompt):
    assert_one_line_error(*cli("generate", "--model", tiny_checkpoint, "--prompt", prompt)[::2], "empty")


def test_no_prompt_and_two_prompts(cli, tiny_checkpoint, tmp_path):
    assert_one_line_error(*cli("generate", "--model", tiny_checkpoint)[::2], "prompt")
    f = tmp_path / "p.txt"
    f.write_text("hi\n")
    assert_one_line_error(*cli("generate", "--model", tiny_checkpoint, "-p", "x", "--prompt-file", f)[::2], "not both")


def test_prompt_file_missing_or_empty(cli, tiny_checkpoint, tmp_path):
    assert_one_line_error(*cli("generate", "--model", tiny_checkpoint, "--prompt-file", tmp_path / "nope.txt")[::2],
                          "prompt file not found")
    (tmp_path / "blank.txt").write_text("\n  \n")
    assert_one_line_error(*cli("generate", "--model", tiny_checkpoint, "--prompt-file", tmp_path / "blank.txt")[::2],
                          "no prompt")


def test_prompt_longer_than_context(cli, tiny_checkpoint):
    long_prompt = "It is a truth universally acknowledged. " * 40  # far more than the 128-token context
    assert_one_line_error(*cli("generate", "--model", tiny_checkpoint, "-p", long_prompt, "-n", "4")[::2], "context")
    # fits alone, but not with the tokens to generate
    assert_one_line_error(*cli("generate", "--model", tiny_checkpoint, "-p", "hello", "-n", "200")[::2], "context")


def test_missing_model_path(cli, tmp_path):
    assert_one_line_error(*cli("generate", "--model", tmp_path / "missing", "-p", "hi")[::2], "not found")
    assert_one_line_error(*cli("info", "--model", tmp_path / "missing")[::2], "not found")


def test_folder_that_is_no_model(cli, tmp_path):
    assert_one_line_error(*cli("info", "--model", tmp_path)[::2], "config.json")
    (tmp_path / "notes.txt").write_text("x")
    assert_one_line_error(*cli("info", "--model", tmp_path / "notes.txt")[::2], ".gguf")


def test_corrupt_safetensors(cli, tiny_checkpoint, tmp_path):
    ck = copy_checkpoint(tiny_checkpoint, tmp_path / "ck")
    (ck / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    assert_one_line_error(*cli("generate", "--model", ck, "-p", "hi")[::2], "corrupt or truncated")


def test_truncated_safetensors(cli, tiny_checkpoint, tmp_path):
    ck = copy_checkpoint(tiny_checkpoint, tmp_path / "ck")
    data = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_one_line_error(*cli("info", "--model", ck)[::2], "corrupt or truncated")


def test_checkpoint_missing_a_weight(cli, tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file
    ck = copy_checkpoint(tiny_checkpoint, tmp_path / "ck")
    state = load_file(ck / "model.safetensors")
    state.pop("model.layers.1.mlp.down_proj.weight")
    save_file(state, ck / "model.safetensors")
    assert_one_line_error(*cli("info", "--model", ck)[::2], "lacks", "down_proj")


def test_pickle_only_checkpoint_is_refused(cli, tiny_checkpoint, tmp_path):
    ck = copy_checkpoint(tiny_checkpoint, tmp_path / "ck")
    (ck / "model.safetensors").rename(ck / "pytorch_model.bin")
    assert_one_line_error(*cli("info", "--model", ck)[::2], "safetensors")


def test_unsupported_architecture(cli, tiny_checkpoint, tmp_path):
    ck = copy_checkpoint(tiny_checkpoint, tmp_path / "ck")
    (ck / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4}))
    assert_one_line_error(*cli("generate", "--model", ck, "-p", "hi")[::2], "gpt2", "supported", "llama", "opt")


def test_broken_config_json(cli, tiny_checkpoint, tmp_path):
    ck = copy_checkpoint(tiny_checkpoint, tmp_path / "ck")
    (ck / "config.json").write_text("{ not json")
    assert_one_line_error(*cli("info", "--model", ck)[::2], "config.json")


def test_gguf_that_is_not_gguf(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04 not a gguf file" * 10)
    assert_one_line_error(*cli("info", "--model", tmp_path / "model.gguf")[::2], "not a GGUF")


@pytest.mark.parametrize("keep", [1 << 20, 4 << 20], ids=["in-metadata", "in-tensors"])  # tensor data starts at 1.7 MiB
def test_truncated_gguf(cli, tmp_path, monkeypatch, keep):
    """The default model's GGUF cut short: inside its metadata, or inside its tensor data."""
    from infinigen.loading import default_gguf
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    with open(default_gguf(), "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(keep))
    assert_one_line_error(*cli("generate", "--model", tmp_path / "cut.gguf", "-p", "hi")[::2], "cut.gguf")
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


@pytest.mark.parametrize("argv", [["generate", "--model", "/no/such/model", "-p", "hi"],
                                  ["generate", "-p", "hi", "--top-p", "2"],
                                  ["generate", "-p", "hi", "--batch-size", "x"]], ids=["missing", "range", "type"])
def test_console_script_exit_code(argv):
    """The real process: exit status 2, one line, no traceback."""
    r = subprocess.run(console(*argv), capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert_one_line_error(r.returncode, r.stderr)
    assert r.stdout == ""
