"""Shared test fixtures. Other test modules rely on these names: keep them stable.

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

The device the model-level tests run on (tests/test_exactness.py, test_policies.py, test_offload.py,
test_int4_kernels.py, test_spec_packed.py):

  device            session-scoped torch.device from INFINIGEN_TEST_DEVICE (default "cpu", what CI runs);
                    INFINIGEN_TEST_DEVICE=cuda runs the same tests with the same assertions on the GPU, and
                    errors every test that asks for it where no CUDA device is visible. Tests move their
                    tiny models (nn.Module.to: in place) and token tensors there; on CPU that is no copy.

Tests that need the CLI run `infinigen.cli.main(argv)` in-process (returns the exit code) or the
console script in a subprocess.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SEED = 0
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Random init leaves biases at 0 and norm weights at 1, which would hide a missing or misnamed
    tensor; give every 1-d tensor random values and make the matrices large enough that logits are
    peaked (argmax ties would make greedy comparisons fragile)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                base = 1.0 if "norm" in name and "bias" not in name else 0.0
                p.copy_(base + 0.1 * noise)
            else:
                big = "lm_head" in name or "embed_tokens" in name  # peaked logits
                p.copy_(noise * (0.25 if big else 0.08))


def _hf_config(kind: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, OPTConfig, Qwen2Config
    if kind == "opt":
        base = dict(vocab_size=TINY["vocab_size"], hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=64,
                    do_layer_norm_before=True, dropout=0.0, attention_dropout=0.0, pad_token_id=1,
                    bos_token_id=2, eos_token_id=2)
        base.update(overrides)
        return OPTConfig(**base)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[kind]
    base = dict(TINY, num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-6,  # head_dim 64/8
                rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "mistral":
        base["sliding_window"] = 4096
    base.update(overrides)
    return cls(**base)


def build_tiny(kind: str = "llama", seed: int = SEED, **overrides):
    """(hf_model, our_model) for a tiny random config of `kind` (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    from infinigen.loading import from_transformers
    torch.manual_seed(seed)
    cfg = _hf_config(kind, **overrides)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    _perturb(hf, seed)
    return hf, from_transformers(hf)


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
_CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_CORPUS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife.",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition.",
    "The family of Dashwood had long been settled in Sussex. Their estate was large.",
    "No one who had ever seen Catherine Morland in her infancy would have supposed her born to be a heroine.",
    "the quick brown fox jumps over the lazy dog 0123456789 , . ; : ! ? ' \" ( ) - +",
]


def make_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on a few sentences, with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = _CHAT_TEMPLATE
    return fast


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
    _perturb(hf, SEED)
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
    path.write_text(" ".join(rng.choice(_CORPUS) for _ in range(400)), encoding="utf-8")
    return path


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


def one_line_error(code, err, *needles):
    """Bad input: exit code 2 and one line on stderr, `infinigen: error: ...` naming each needle."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("infinigen: error: ") and "Traceback" not in err
    for n in needles:
        assert n.lower() in lines[0].lower(), lines[0]
