"""Issue 2, item 3: loading Hugging Face checkpoint directories (Llama family and OPT), the default
GGUF model, and what goes wrong with bad files (as `UserError`, never a traceback)."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from infinigen import runtime
from infinigen import UserError, load
from infinigen.placement import Placement

from conftest import build_tiny, make_tokenizer


def save_checkpoint(hf, folder, **kw):
    hf.save_pretrained(folder, safe_serialization=True, **kw)
    make_tokenizer().save_pretrained(folder)
    return folder


def assert_same_logits(hf, ours, vocab: int, tol: float = 1e-4):
    tokens = torch.randint(3, vocab, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(tokens).logits
    got = runtime.prefill(ours, tokens, Placement().new_session(ours, 2, 11), all_logits=True)
    assert (got - ref).abs().max().item() <= tol


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_load_checkpoint_dir(tiny_checkpoint):
    from transformers import AutoModelForCausalLM
    before = digest(tiny_checkpoint)
    model, tok, name = load(tiny_checkpoint)
    assert name == tiny_checkpoint.name
    assert model.cfg.num_heads == 8 and model.cfg.num_kv_heads == 2 and model.cfg.tie_embeddings
    assert model.lm_head.weight is model.embed_tokens.weight
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    assert_same_logits(hf, model, len(tok))
    assert tok.decode(tok("It is a truth")["input_ids"]) == "It is a truth"
    assert tok.chat_template and tok.eos_token_id in model.cfg.eos_token_ids
    assert digest(tiny_checkpoint) == before  # loading writes nothing into the user's folder


@pytest.mark.parametrize("kind,overrides,save_kw", [
    ("llama", {"attention_bias": True}, {}),                       # untied head, q/k/v/o bias
    ("qwen2", {}, {"max_shard_size": "40KB"}),                     # q/k/v bias; several safetensors shards
    ("mistral", {"sliding_window": 6}, {}),
    ("opt", {}, {}),
    ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}, {}),
], ids=["llama-bias", "qwen2-sharded", "mistral", "opt", "opt-postnorm"])
def test_load_family_checkpoints(tmp_path, kind, overrides, save_kw):
    hf, _ = build_tiny(kind, **overrides)
    folder = save_checkpoint(hf, tmp_path / kind, **save_kw)
    if save_kw:
        assert len(list(folder.glob("*.safetensors"))) > 1
    model, tok, _ = load(folder)
    assert model.cfg.model_type == kind
    assert_same_logits(hf, model, 256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_load_in_half_precision(tiny_checkpoint, dtype):
    """Half precision is the float32 checkpoint rounded once, then the same computation in that dtype.
    Exactness gives: the weights bit for bit, and the logits of transformers running the checkpoint in the
    same dtype (same ops, same precision: bit-identical here; one ulp of the largest logit is left for a
    different summation order). Against float32 the logits differ only by the rounding of activations:
    measured 0.5 eps x max|logit| (bf16: 0.053 of 13.0; fp16: 0.0064), allowed 2 eps x max|logit|
    (the old bound, 10% of the largest logit, was 13 eps for bf16 and 100 eps for fp16)."""
    from transformers import AutoModelForCausalLM
    name = str(dtype).removeprefix("torch.")
    model, _, _ = load(tiny_checkpoint, dtype=name)
    ref, _, _ = load(tiny_checkpoint)
    assert model.dtype == dtype and all(p.dtype == dtype for p in model.parameters())
    ours, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n], theirs[n].to(dtype)) for n in ours)  # rounded once, nothing else
    tokens = torch.tensor([[5, 9, 30, 41, 7]])
    got = runtime.prefill(model, tokens, Placement().new_session(model, 1, 5))
    want = runtime.prefill(ref, tokens, Placement().new_session(ref, 1, 5))
    assert got.dtype == torch.float32  # logits come back in float32 whatever the weights
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=dtype).eval()
    with torch.no_grad():
        same = hf(tokens).logits[:, -1].float()
    eps, top = torch.finfo(dtype).eps, want.abs().max().item()
    assert (got - same).abs().max().item() <= eps * top
    assert (got - want).abs().max().item() <= 2 * eps * top


def test_from_transformers_takes_the_same_weights(tiny_opt):
    hf, ours = tiny_opt
    ref = hf.model.decoder.layers[1]
    assert torch.equal(ours.layers[1].attn.o_proj.weight, ref.self_attn.out_proj.weight)
    assert torch.equal(ours.layers[1].mlp.up_proj.bias, ref.fc1.bias)
    assert torch.equal(ours.embed_positions.weight, hf.model.decoder.embed_positions.weight)


@pytest.mark.parametrize("kwargs,needle", [
    ({"dtype": "float64"}, "dtype"),
    ({"device": "tpu"}, "device"),
    ({"device": "cuda"} if not torch.cuda.is_available() else {"dtype": "int8"},
     "cuda" if not torch.cuda.is_available() else "dtype"),
], ids=["dtype", "device", "cuda"])
def test_bad_load_options(tiny_checkpoint, kwargs, needle):
    with pytest.raises(UserError, match=needle):
        load(tiny_checkpoint, **kwargs)


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300, n_positions=64))
    folder = save_checkpoint(hf, tmp_path / "gpt2")
    with pytest.raises(UserError) as e:
        load(folder)
    msg = str(e.value)
    assert "gpt2" in msg and "llama" in msg and "opt" in msg and "\n" not in msg


def test_missing_tokenizer(tmp_path, tiny_checkpoint):
    folder = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, folder)
    for f in folder.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(UserError, match="tokenizer"):
        load(folder)


def test_config_without_model_type(tmp_path, tiny_checkpoint):
    folder = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["model_type"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError):
        load(folder)


# ---- the default model ---------------------------------------------------------------------------
@pytest.mark.integration
def test_default_model(default_model):
    model, tok = default_model
    cfg = model.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.max_position == 8192 and cfg.tie_embeddings
    assert tok.chat_template and tok.decode(tok("Hello world")["input_ids"]) == "Hello world"


@pytest.mark.integration
def test_default_model_by_gguf_path(default_model):
    """The same model by its .gguf path and by its folder (the converted cache is reused)."""
    from infinigen.loading import default_gguf
    ref, _ = default_model
    for spec in (default_gguf(), default_gguf().parent):
        model, tok, name = load(spec, progress=False)
        assert name.endswith(".gguf") or name == default_gguf().parent.name
        assert torch.equal(model.layers[7].attn.k_proj.weight, ref.layers[7].attn.k_proj.weight)
        del model
