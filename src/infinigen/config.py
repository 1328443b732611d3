"""The model description the runtime needs, read from a `transformers` config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import UserError

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
GEMMA3 = ("gemma3_text",)
SUPPORTED = LLAMA_FAMILY + GEMMA3 + ("opt",)


@dataclass
class ModelConfig:
    arch: str  # "llama" (Llama, Mistral, Qwen2, SmolLM, Gemma 3) or "opt"
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
    sliding_window: int | None = None  # the window of every layer (Mistral); None when layers differ
    # per layer: the window of its attention (None: it reads its whole past). Default: sliding_window
    layer_windows: list | None = None
    # per layer: which rotary embedding it uses (a key of the config's rope_parameters; None: the one)
    layer_rope: list | None = None
    # Gemma 3 (the Llama layout otherwise): RMSNorm scales by (1 + weight) in float32 ("gemma"), four
    # norms per block (after attention and after the MLP too), RMSNorm on each head's queries and keys
    # before RoPE, embeddings times sqrt(hidden), a softcap on the final logits
    norm_style: str = "llama"
    sandwich_norms: bool = False
    qk_norm: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None  # None: head_dim ** -0.5
    final_softcap: float | None = None
    # OPT only
    pre_norm: bool = True
    final_norm: bool = True
    embed_dim: int | None = None  # word_embed_proj_dim when it differs from hidden_size
    activation: str = "silu"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    model_type: str = "llama"
    hf_config: Any = None  # kept for RoPE parameters (llama3/yarn scaling) and tokenizers

    def __post_init__(self):
        if self.layer_windows is None:
            self.layer_windows = [self.sliding_window] * self.num_layers

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention: a row reads the entries fewer than this many
        positions before it (itself included); None: its whole past."""
        return self.layer_windows[layer]

    def local(self, layer: int) -> bool:
        """A local layer of a model that mixes local (windowed) and global layers (Gemma 3): its window
        already bounds what it reads, so the runtime reads the window densely and policies select only
        on the global layers."""
        return self.sliding_window is None and self.layer_windows[layer] is not None

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
            raise UserError(f"unsupported architecture {mt!r}; supported: {', '.join(SUPPORTED)} "
                            "(Llama family incl. SmolLM) and OPT")
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
        if mt in GEMMA3:
            return cls._from_gemma3(hf, eos)
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

    @classmethod
    def _from_gemma3(cls, hf, eos: list[int]) -> "ModelConfig":
        heads, kv = hf.num_attention_heads, hf.num_key_value_heads
        if heads % kv:
            raise UserError("num_attention_heads must be a multiple of num_key_value_heads")
        if getattr(hf, "attn_logit_softcapping", None) is not None:
            raise UserError("attn_logit_softcapping is not supported (Gemma 3 has none; Gemma 2 is not supported)")
        if getattr(hf, "use_bidirectional_attention", False):
            raise UserError("use_bidirectional_attention is not supported: the runtime decodes causally")
        types = list(hf.layer_types)
        if len(types) != hf.num_hidden_layers or set(types) - {"sliding_attention", "full_attention"}:
            raise UserError(f"layer_types must name sliding_attention or full_attention for each of the "
                            f"{hf.num_hidden_layers} layers")
        windows = [hf.sliding_window if t == "sliding_attention" else None for t in types]
        uniform = windows[0] if len(set(windows)) == 1 else None
        return cls(
            arch="llama", model_type=hf.model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers,
            num_heads=heads, num_kv_heads=kv, head_dim=hf.head_dim,
            max_position=hf.max_position_embeddings, norm_eps=hf.rms_norm_eps,
            qkv_bias=bool(hf.attention_bias), o_bias=bool(hf.attention_bias), mlp_bias=False,
            tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
            sliding_window=uniform, layer_windows=windows, layer_rope=types,
            norm_style="gemma", sandwich_norms=True, qk_norm=True, embed_scale=hf.hidden_size ** 0.5,
            attn_scale=hf.query_pre_attn_scalar ** -0.5, final_softcap=hf.final_logit_softcapping,
            activation=hf.hidden_activation, eos_token_ids=eos, bos_token_id=hf.bos_token_id, hf_config=hf,
        )
