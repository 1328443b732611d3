"""Models for the benchmark: paper-size shapes with random weights, the transformers twin of a model,
and prompt tokens (real text keeps the attention pattern, hence InfiniGen's selection, realistic)."""
from __future__ import annotations

import hashlib

import torch

from ..errors import UserError

SYNTHETIC = {
    "opt-6.7b": ("opt", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, ffn_dim=16384,
                             word_embed_proj_dim=4096, vocab_size=50272, max_position_embeddings=2048)),
    "opt-13b": ("opt", dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, ffn_dim=20480,
                            word_embed_proj_dim=5120, vocab_size=50272, max_position_embeddings=2048)),
    "opt-30b": ("opt", dict(hidden_size=7168, num_hidden_layers=48, num_attention_heads=56, ffn_dim=28672,
                            word_embed_proj_dim=7168, vocab_size=50272, max_position_embeddings=2048)),
    "llama-2-7b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                 intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096)),
    "llama-2-13b": ("llama", dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40,
                                  num_key_value_heads=40, intermediate_size=13824, vocab_size=32000,
                                  max_position_embeddings=4096)),
    "llama-3-8b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                 intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                                 rope_theta=500000.0)),
    "smollm2-135m": ("llama", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                   intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                                   rope_theta=100000.0, tie_word_embeddings=True)),
}


def synthetic_models(name: str, dtype: torch.dtype, device: str, max_len: int, layers: int | None = None,
                     hf: bool = True):
    """(our model, transformers model sharing its weights, label) for a paper-size shape, random weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig

    from ..config import ModelConfig
    from ..loading import build
    if name not in SYNTHETIC:
        raise UserError(f"unknown --synthetic shape {name!r}; choose from {', '.join(SYNTHETIC)}")
    arch, kw = SYNTHETIC[name]
    kw = dict(kw)
    if layers:
        kw["num_hidden_layers"] = layers
    kw["max_position_embeddings"] = max(kw["max_position_embeddings"], max_len)  # random weights: any length
    cfg = (OPTConfig(**kw, do_layer_norm_before=True, dropout=0.0, attention_dropout=0.0) if arch == "opt"
           else LlamaConfig(**kw, rms_norm_eps=1e-5, attention_bias=False))
    torch.manual_seed(0)
    with torch.device(device):
        hf_model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
    ours = build(ModelConfig.from_hf(cfg), dict(hf_model.state_dict()), dtype=dtype, device=device)  # shared tensors
    label = f"{name} (synthetic random weights, {cfg.num_hidden_layers} layers)"
    return ours, (hf_model if hf else None), label


def hf_model_for(spec: str, dtype: torch.dtype, device: str):
    """The transformers model of a `load` spec ('default', a .gguf file or a checkpoint directory)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from ..loading import convert_gguf, default_gguf
    if spec in (None, "", "default"):
        path = convert_gguf(default_gguf(), progress=False)
    else:
        path = Path(spec).expanduser()
        if path.is_dir() and not (path / "config.json").exists():
            path = sorted(path.glob("*.gguf"))[0]
        if path.is_file():
            path = convert_gguf(path, progress=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def prompt_tokens(tokenizer, text: str | None, batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """[batch, length] token ids: consecutive pieces of `text` (real text keeps the attention pattern,
    hence InfiniGen's selection, realistic), or random ids when there is no text."""
    if text is None or tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(4, vocab, (batch, length), generator=g)
    ids = _tokenized(tokenizer, text)
    need = batch * length
    if len(ids) < need:
        ids = ids * (need // len(ids) + 1)  # the text is short: it repeats
    return torch.tensor(ids[:need]).view(batch, length)


_TOKEN_CACHE: dict = {}


def _tokenized(tokenizer, text: str) -> list[int]:
    key = (id(tokenizer), hashlib.sha1(text.encode()).hexdigest())
    if key not in _TOKEN_CACHE:
        _TOKEN_CACHE[key] = list(tokenizer(text)["input_ids"])
    return _TOKEN_CACHE[key]


# ---- memory ----------------------------------------------------------------------------------------
