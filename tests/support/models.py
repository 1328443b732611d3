"""Tiny random models and a tokenizer (float32, CPU, fixed seed), built the same way for every test.

Every weight is perturbed so that biases and norm weights are non-trivial and a wrong mapping shows up in the
logits. conftest.py's fixtures (tiny_llama, tiny_opt, make_tiny, tiny_checkpoint, ...) are built from these.
"""
from __future__ import annotations

import torch

SEED = 0
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256)


def perturb(model: torch.nn.Module, seed: int) -> None:
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


def hf_config(kind: str, **overrides):
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
    """(hf_model, our_model) for a tiny random config of `kind` (conftest.py says what each kind is)."""
    from transformers import AutoModelForCausalLM

    from infinigen.loading import from_transformers
    torch.manual_seed(seed)
    cfg = hf_config(kind, **overrides)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    perturb(hf, seed)
    return hf, from_transformers(hf)


# ---- a tiny Gemma 3 text model ---------------------------------------------------------------------
WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]


def build_gemma(seed: int = 0, **overrides):
    """(hf_model, our_model) for a tiny random Gemma 3 text model."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from infinigen.loading import from_transformers
    torch.manual_seed(seed)
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYER_TYPES),
                num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24,
                sliding_window=WINDOW, layer_types=LAYER_TYPES, max_position_embeddings=256,
                rope_local_base_freq=10000.0, rope_theta=1000.0, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    base.update(overrides)
    hf = AutoModelForCausalLM.from_config(Gemma3TextConfig(**base), attn_implementation="eager",
                                          dtype=torch.float32).eval()
    perturb(hf, seed)
    with torch.no_grad():  # Gemma's norms scale by (1 + weight): weights near 0, not near 1
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.sub_(1.0)
    return hf, from_transformers(hf)


# ---- plain `transformers` models (no conversion), for the `infinigen.hf` integration -------------------
def hf_llama(seed=0, **kw):
    """A plain random Llama (3 layers, 4 query heads over 2 KV heads, vocab 96), not perturbed."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0, **kw)
    return LlamaForCausalLM(cfg).eval()


def hf_opt(seed=0, pre_norm=True):
    """A plain random OPT (3 layers, 4 heads, vocab 96; post-norm like OPT-350m with pre_norm=False)."""
    from transformers import OPTConfig, OPTForCausalLM
    torch.manual_seed(seed)
    cfg = OPTConfig(vocab_size=96, hidden_size=64, ffn_dim=128, num_hidden_layers=3, num_attention_heads=4,
                    max_position_embeddings=256, do_layer_norm_before=pre_norm, word_embed_proj_dim=64,
                    bos_token_id=None, eos_token_id=None, pad_token_id=1)
    return OPTForCausalLM(cfg).eval()


# ---- a byte-level BPE tokenizer --------------------------------------------------------------------
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = [
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
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast



def attention_model(query_scale: float, num_hidden_layers: int = 4):
    """A tiny Llama whose attention is peaked (a large query scale) or flat (0), its MLPs damped: models with
    different attention statistics for calibration's tests."""
    _, model = build_tiny("llama", num_hidden_layers=num_hidden_layers)
    with torch.no_grad():
        for blk in model.layers:
            blk.attn.q_proj.weight.mul_(query_scale)
            blk.mlp.down_proj.weight.mul_(0.05)
    return model


def decoded_logits(model, tokens: torch.Tensor, prefill: int = 6) -> torch.Tensor:
    """The full cache's logits [B, T - prefill + 1, V]: the first `prefill` tokens prefilled, the rest decoded one
    step at a time."""
    from infinigen import runtime
    from infinigen.placement import Placement
    from infinigen.policies import make_policy
    sess = Placement().new_session(model, tokens.shape[0], tokens.shape[1] + 1, make_policy("full"))
    out = [runtime.prefill(model, tokens[:, :prefill], sess)]
    for t in range(prefill, tokens.shape[1]):
        out.append(runtime.decode(model, tokens[:, t], sess))
    return torch.stack(out, 1)
