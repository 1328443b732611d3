"""The model description the runtime needs, read from a `transformers` config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import UserError

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
SUPPORTED = LLAMA_FAMILY + ("opt",)


@dataclass
class ModelConfig:
    arch: str  # "llama" (Llama, Mistral, Qwen2, SmolLM) or "opt"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = True
    sliding_window: int | None = None
    # OPT only
    pre_norm: bool = True
    final_norm: bool = True
    embed_dim: int | None = None  # word_embed_proj_dim when it differs from hidden_size
    activation: str = "silu"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    model_type: str = "llama"
    hf_config: Any = None  # kept for RoPE parameters (llama3/yarn scaling) and tokenizers

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def uses_rope(self) -> bool:
        return self.arch == "llama"

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        mt = getattr(hf, "model_type", None)
        if mt not in SUPPORTED:
            raise UserError(f"unsupported architecture {mt!r}; supported: {', '.join(SUPPORTED)} (Llama family incl. SmolLM) and OPT")
        eos = hf.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if mt == "opt":
            if hf.hidden_size % hf.num_attention_heads:
                raise UserError("hidden_size must be divisible by num_attention_heads")
            return cls(
                arch="opt", model_type=mt, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
                intermediate_size=hf.ffn_dim, num_layers=hf.num_hidden_layers,
                num_heads=hf.num_attention_heads, num_kv_heads=hf.num_attention_heads,
                head_dim=hf.hidden_size // hf.num_attention_heads,
                max_position=hf.max_position_embeddings, norm_eps=1e-5,
                qkv_bias=hf.enable_bias, o_bias=hf.enable_bias, mlp_bias=hf.enable_bias,
                tie_embeddings=getattr(hf, "tie_word_embeddings", True),
                pre_norm=hf.do_layer_norm_before,
                final_norm=hf.do_layer_norm_before and not getattr(hf, "_remove_final_layer_norm", False),
                embed_dim=hf.word_embed_proj_dim, activation=hf.activation_function,
                eos_token_ids=eos, bos_token_id=hf.bos_token_id, hf_config=hf,
            )
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        kv = getattr(hf, "num_key_value_heads", None) or heads
        if heads % kv:
            raise UserError("num_attention_heads must be a multiple of num_key_value_heads")
        window = getattr(hf, "sliding_window", None)
        if mt == "qwen2" and not getattr(hf, "use_sliding_window", False):
            window = None
        return cls(
            arch="llama", model_type=mt, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers,
            num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
            max_position=hf.max_position_embeddings, norm_eps=hf.rms_norm_eps,
            qkv_bias=mt == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            o_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            sliding_window=window, activation=hf.hidden_act,
            eos_token_ids=eos, bos_token_id=hf.bos_token_id, hf_config=hf,
        )
