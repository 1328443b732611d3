"""`infinigen generate` and `infinigen info`, and how bad input is reported
(one line on stderr, exit code 2, no traceback, before any expensive work where possible)."""
from __future__ import annotations

import hashlib
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


def tree_digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


# ---- bad input ------------------------------------------------------------------------------------
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


# ---- working commands on a tiny checkpoint ---------------------------------------------------------
def test_info_on_a_checkpoint(cli, tiny_checkpoint):
    from transformers import AutoModelForCausalLM
    code, out, err = cli("info", "--model", tiny_checkpoint, "--dtype", "float32")  # the default is "auto"
    assert code == 0, err
    facts = dict(line.split(":", 1) for line in out.splitlines())
    facts = {k.strip(): v.strip() for k, v in facts.items()}
    assert facts["architecture"].startswith("llama")
    assert facts["layers"] == "2"
    assert facts["heads"] == "8 query, 2 KV (GQA 4:1), head_dim 8"
    n = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).num_parameters()
    assert facts["parameters"].startswith(f"{n:,} ")
    # 2 (k and v) x 2 layers x 2 KV heads x 8 dims x 2 bytes
    assert facts["KV cache per token"].startswith("128 B in float16, 256 B in float32")


def test_info_json_and_dtype(cli, tiny_checkpoint):
    code, out, _ = cli("info", "--model", tiny_checkpoint, "--json", "--dtype", "bfloat16")
    facts = json.loads(out)
    assert code == 0 and facts["dtype"] == "bfloat16" and facts["kv_bytes_per_token"]["bfloat16"] == 128
    assert facts["kv_heads"] == 2 and facts["heads"] == 8 and facts["head_dim"] == 8


def test_generate_streams_the_greedy_text(cli, tiny_checkpoint, tiny_tokenizer):
    from infinigen import generate, load
    before = tree_digest(tiny_checkpoint)
    code, out, err = cli("generate", "--model", tiny_checkpoint, "-p", "It is a truth", "-n", "12")
    assert code == 0, err
    model, tok, _ = load(tiny_checkpoint, dtype="auto")  # the CLI's default dtype
    expected = generate(model, tok, ["It is a truth"], max_new_tokens=12).texts[0]
    assert out == expected + "\n"
    assert "prompt tokens" in err and "tokens/s" in err
    assert tree_digest(tiny_checkpoint) == before  # nothing the user had was touched


def test_generate_batch_from_prompt_file(cli, tiny_checkpoint, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("It is a truth\n\nEmma Woodhouse, handsome\n")
    code, out, err = cli("generate", "--model", tiny_checkpoint, "--prompt-file", f, "-b", "2", "-n", "6",
                         "--chat", "--temperature", "0.7", "--seed", "1")
    assert code == 0, err
    assert "in 4 rows" in err
    assert "--- [3] ---" in out and "--- [4] ---" not in out
    again = cli("generate", "--model", tiny_checkpoint, "--prompt-file", f, "-b", "2", "-n", "6",
                "--chat", "--temperature", "0.7", "--seed", "1")
    assert again[1] == out  # seeded sampling is reproducible from the command line


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_generate_in_half_precision(cli, tiny_checkpoint, dtype):
    code, out, err = cli("generate", "--model", tiny_checkpoint, "-p", "It is", "-n", "4", "--dtype", dtype)
    assert code == 0, err


def test_generate_with_another_policy(cli, tiny_checkpoint):
    code, out, err = cli("generate", "--model", tiny_checkpoint, "-p", "It is a truth", "-n", "6",
                         "--policy", "streaming")
    assert code == 0, err
    assert "relative KV size" in err


# ---- the default model -------------------------------------------------------------------------------
@pytest.mark.integration
def test_generate_default_model(cli, default_model):
    code, out, err = cli("generate", "--chat", "--prompt", "What is the capital of France? Answer in one word.",
                         "--max-new-tokens", "8")
    assert code == 0, err
    assert "Paris" in out
    assert "SmolLM2-135M-Instruct" in err and "tokens/s" in err


@pytest.mark.integration
def test_info_default_model(cli, default_model):
    code, out, err = cli("info")
    assert code == 0, err
    assert "9 query, 3 KV (GQA 3:1), head_dim 64" in out and "layers:" in out
    assert "23,040 B in float16" in out  # 2 x 30 layers x 3 KV heads x 64 x 2 bytes
