"""The fixtures every test folder shares (a folder's own conftest.py adds its own; functions the tests share
live in tests/support/). Test modules rely on these names: keep them stable.

Tiny random models (float32, CPU, fixed seed, every weight perturbed so that biases and norm weights
are non-trivial and a wrong mapping shows up in the logits):

  tiny_llama        (hf_model, our_model): LlamaConfig, 2 layers, hidden 64, 8 query heads sharing
                    2 KV heads (head_dim 8), vocab 256, context 256. Parametrized: "nobias" and
                    "qkvbias" (attention_bias=True: q/k/v/o biases), so a test using it runs twice.
  tiny_opt          (hf_model, our_model): OPTConfig, 2 layers, hidden 64, 4 heads, pre-norm.
  make_tiny         factory: make_tiny(kind, **config_overrides) -> (hf_model, our_model) for kind in
                    "llama", "qwen2", "mistral", "opt" (e.g. make_tiny("opt", do_layer_norm_before=False,
                    word_embed_proj_dim=32) for an OPT-350m-like post-norm model). Same seed, same sizes.
  tiny_checkpoint   session-scoped Path: a Hugging Face checkpoint directory (config.json,
                    model.safetensors, a small byte-level BPE tokenizer with a chat template) of a tiny
                    random Llama model (vocab ~500, context 128), saved with save_pretrained. Loadable with
                    `infinigen.load(path)` and `infinigen ... --model PATH`; read-only for tests (copy it
                    before corrupting it).
  tiny_tokenizer    session-scoped: the tokenizer saved in tiny_checkpoint.
  text_file         module-scoped Path: 400 words of the tiny tokenizer's corpus (fixed seed), for `--text`.

The default model (SmolLM2-135M-Instruct, Q4_1), loaded once per test session; use only in tests
marked `@pytest.mark.integration` (deselect them with `-m "not integration"`):

  default_model     (our_model, tokenizer) in float32 on CPU, the GGUF's weights dequantized (dense).
  default_hf_model  the `transformers` LlamaForCausalLM with the same (dequantized) weights, loaded from
                    the converted checkpoint that `infinigen.loading` caches; float32, sdpa attention (its default).

The device the model-level tests run on (runtime/test_exactness.py, runtime/test_int4_kernels.py,
policies/test_policies.py, policies/test_spec_packed.py, placement/test_offload.py):

  device            session-scoped torch.device from INFINIGEN_TEST_DEVICE (default "cpu", what CI runs);
                    INFINIGEN_TEST_DEVICE=cuda runs the same tests with the same assertions on the GPU, and
                    errors every test that asks for it where no CUDA device is visible. Tests move their
                    tiny models (nn.Module.to: in place) and token tensors there; on CPU that is no copy.

Tests that need the CLI run `infinigen.cli.main(argv)` in-process (the `cli` fixture: exit code, stdout,
stderr) or the console script in a subprocess.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from support.models import CORPUS, SEED, build_tiny, make_tokenizer, perturb

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def private_inductor_cache(tmp_path_factory, monkeypatch):
    """One Inductor cache for the session's compiling tests, never the user's (`pytestmark = usefixtures`)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "inductor"))


@pytest.fixture(params=[False, True], ids=["nobias", "qkvbias"])
def tiny_llama(request):
    return build_tiny("llama", attention_bias=request.param)


@pytest.fixture
def tiny_opt():
    return build_tiny("opt")


@pytest.fixture
def make_tiny():
    return build_tiny


# ---- the device of the model-level tests ----------------------------------------------------------
@pytest.fixture(scope="session")
def device() -> torch.device:
    dev = torch.device(os.environ.get("INFINIGEN_TEST_DEVICE", "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("INFINIGEN_TEST_DEVICE asks for CUDA, but torch sees no CUDA device")
    return dev


# ---- a saved checkpoint with a tokenizer ----------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig
    tok = make_tokenizer()
    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                      rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    perturb(hf, SEED)
    out = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """A short text of the tokenizer's corpus words (400 words, fixed seed): a `--text` that needs no corpus."""
    import random
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("text") / "story.txt"
    path.write_text(" ".join(rng.choice(CORPUS) for _ in range(400)), encoding="utf-8")
    return path


@pytest.fixture
def checkpoint_model(tiny_checkpoint):
    """(model, tokenizer) of the tiny checkpoint, loaded as `infinigen.load` loads a user's checkpoint."""
    from infinigen.loading import load
    model, tok, _ = load(str(tiny_checkpoint), progress=False)
    return model, tok


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


# ---- the default model ----------------------------------------------------------------------------
@pytest.fixture(scope="session")
def default_model():
    from infinigen.loading import load
    model, tokenizer, _ = load("default", dtype="float32", device="cpu", progress=False, weights="fp32")
    return model, tokenizer


@pytest.fixture(scope="session")
def default_hf_model(default_model):
    from transformers import AutoModelForCausalLM

    from infinigen.loading import _convert_gguf, default_gguf
    path = _convert_gguf(default_gguf(), progress=False)  # the cache the default_model fixture filled
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture
def cli(capfd):
    """run(*argv) -> (exit code, stdout, stderr), in-process; stderr is captured at the fd level so
    warnings printed by libraries count too."""
    from infinigen.cli import main

    def run(*argv):
        capfd.readouterr()
        code = main([str(a) for a in argv])
        out, err = capfd.readouterr()
        return code, out, err
    return run

