"""`infinigen generate` and `infinigen info` on a tiny checkpoint and on the default model: the facts, the
streamed greedy text, batches from a prompt file, other dtypes and policies."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest


def tree_digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


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
