"""Loading Hugging Face checkpoint directories (Llama family and OPT), the default
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

from support.models import build_tiny, make_tokenizer


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


# ---- a GGUF file's quantized blocks, in transformers' row order --------------------------------------------
def _permute_for_llama_cpp(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's conversion permutes q/k rows per head into its RoPE layout (convert_hf_to_gguf's `permute`)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path, gguf):
    """A tiny random Llama written as llama.cpp writes one (Q4_1 projections, q/k rows permuted, a byte-level
    gpt2 vocabulary); every projection weight is -0.25 + k/32 with k in 0..15 and both ends in each block of
    32, so Q4_1 holds it exactly and any reader that gets the rows right gets the source weights back."""
    import numpy as np
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    vocab, heads, kv_heads = 300, 4, 2
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                      max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
                continue
            k = torch.randint(0, 16, p.shape)
            k.view(-1, 32)[:, 0], k.view(-1, 32)[:, 1] = 0, 15
            p.copy_(-0.25 + k / 32)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(128)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(16)
    w.add_vocab_size(vocab)
    chars = list(bytes_to_unicode().values())
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<unk>", "<s>", "</s>"] + chars + [f"x{i}" for i in range(vocab - 3 - len(chars))])
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    sd = hf.state_dict()

    def add(name, t, qtype=None):
        a = t.detach().numpy().astype(np.float32)
        if qtype is None:
            w.add_tensor(name, a)
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    for i in range(2):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        add(f"blk.{i}.attn_q.weight", _permute_for_llama_cpp(sd[p + "self_attn.q_proj.weight"], heads), "Q4_1")
        add(f"blk.{i}.attn_k.weight", _permute_for_llama_cpp(sd[p + "self_attn.k_proj.weight"], kv_heads), "Q4_1")
        for ours, theirs in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                             ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")):
            add(f"blk.{i}.{ours}.weight", sd[p + theirs + ".weight"], "Q4_1")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def test_gguf_q4_blocks_are_loaded_in_the_checkpoints_row_order(tmp_path, monkeypatch):
    """The file's Q4_1 blocks, kept as they are for the int4 kernel, are reordered as transformers' conversion
    reorders the rows (q/k un-permuted from llama.cpp's layout): each weight equals the source model's, and so
    do the logits (within the int4 kernel's rounding)."""
    gguf = pytest.importorskip("gguf")
    from infinigen.kernels.qlinear import int4_problem
    if int4_problem(64, 64, 32, "cpu") is not None:
        pytest.skip(f"no int4 kernel here: {int4_problem(64, 64, 32, 'cpu')}")
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    source = _write_tiny_gguf(tmp_path / "tiny.gguf", gguf)
    model, _, _ = load(tmp_path / "tiny.gguf", dtype="float32", weights="int4", progress=False)
    from_file = model.weights_info.from_file
    assert {f"layers.{i}.attn.{p}_proj" for i in range(2) for p in "qkvo"} <= from_file
    for i in range(2):
        for p in "qkvo":
            ours = getattr(model.layers[i].attn, f"{p}_proj").weight
            theirs = getattr(source.model.layers[i].self_attn, f"{p}_proj").weight
            assert torch.equal(ours.float(), theirs), (i, p)
    assert_same_logits(source, model, 300, tol=0.1)


def test_gguf_int4_weights_are_packed_once_and_read_back_equal(tmp_path, monkeypatch):
    """The kernel's packed int4 weights are cached beside the blocks: a second load reads them (no repacking)
    and holds the same tensors bit for bit; a file written for another torch (or damaged) is rebuilt."""
    gguf = pytest.importorskip("gguf")
    from infinigen import gguf_model
    from infinigen.kernels.qlinear import Int4Linear, int4_problem
    if int4_problem(64, 64, 32, "cpu") is not None:
        pytest.skip(f"no int4 kernel here: {int4_problem(64, 64, 32, 'cpu')}")
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    _write_tiny_gguf(tmp_path / "tiny.gguf", gguf)

    def packs(model):  # the weights read from the file (a joined projection is made of them after loading)
        return {n: (m.packed, m.scale_zero) for n, m in model.named_modules()
                if isinstance(m, Int4Linear) and not m.joins}
    first = packs(load(tmp_path / "tiny.gguf", dtype="bfloat16", weights="int4", progress=False)[0])
    assert len(first) == 14
    files = list((tmp_path / "cache").rglob("packed/int4-bfloat16.safetensors"))
    assert len(files) == 1
    repacked = []
    real = Int4Linear.from_gguf_blocks.__func__
    monkeypatch.setattr(Int4Linear, "from_gguf_blocks",
                        classmethod(lambda cls, *a, **kw: repacked.append(1) or real(cls, *a, **kw)))
    second = packs(load(tmp_path / "tiny.gguf", dtype="bfloat16", weights="int4", progress=False)[0])
    assert not repacked and second.keys() == first.keys()
    for name, (packed, sz) in first.items():
        assert torch.equal(second[name][0], packed) and torch.equal(second[name][1], sz), name
    monkeypatch.setattr(gguf_model, "_packed_key", lambda: {"format": "1", "torch": "another"})
    load(tmp_path / "tiny.gguf", dtype="bfloat16", weights="int4", progress=False)
    assert len(repacked) == 14  # a foreign file: every weight packed again (and the file replaced)
