"""The network: Llama family (Llama, Mistral, Qwen2, SmolLM), Gemma 3 and OPT.

Norms, rotary embedding, blocks, embedding and head, and the dense attention of a prompt. A block does
not know where keys and values are kept or which of them a row reads: its `attend(layer, q, k, v)` is
given by the runtime (`infinigen.runtime`: sessions, prefill, decode, teacher-forced), and its
`event(layer, point, x)` tells the runtime that a hidden state is ready.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .selection import first_key_read

PREFILL_CHUNK = 1024  # query rows per attention call: bounds the score matrix at long contexts


SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")  # torch >= 2.5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by (1 + weight), in float32, and only then casts back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def _norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    dim = dim or cfg.hidden_size
    if cfg.arch == "opt":
        return nn.LayerNorm(dim, eps=cfg.norm_eps)
    return GemmaRMSNorm(dim, cfg.norm_eps) if cfg.norm_style == "gemma" else RMSNorm(dim, cfg.norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        d, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.index, self.shape = index, (h, kv, d)
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.o_bias)
        self.qkv_proj = None  # q, k and v in one weight call where the loader joined them (`_joined`)

    def projections(self, x: torch.Tensor):
        """x's q, k and v projections [B,T,features]: one call of the joined weight where it stands for them."""
        h, kv, d = self.shape
        joined = _joined(self.qkv_proj, (self.q_proj, self.k_proj, self.v_proj))
        if joined is not None:
            return joined(x).split([h * d, kv * d, kv * d], -1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def qkv(self, x: torch.Tensor, rope: "Rope | None"):
        """Queries [B,H,T,d] (post-RoPE) and keys/values [B,Hkv,T,d] for attention input x [B,T,hidden]."""
        h, kv, d = self.shape
        b, t, _ = x.shape
        q, k, v = self.projections(x)
        q = q.view(b, t, h, d).transpose(1, 2)
        k = k.view(b, t, kv, d).transpose(1, 2)
        v = v.view(b, t, kv, d).transpose(1, 2)
        if rope is not None:  # one rotation for queries and keys together: fewer small ops per decode step
            q, k = rope.apply(torch.cat([q, k], dim=1)).split([h, kv], dim=1)
        return q, k, v

    def query(self, x: torch.Tensor, rope: "Rope | None") -> torch.Tensor:
        """Only the (post-RoPE) queries: what speculation needs one layer ahead."""
        h, _, d = self.shape
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, h, d).transpose(1, 2)
        return q if rope is None else rope.apply(q)


class NormedQKAttention(Attention):
    """Gemma 3's attention: each head's queries and keys are RMS-normed before RoPE (a subclass, so the
    Llama path pays nothing for it)."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.q_norm = _norm(cfg, cfg.head_dim)
        self.k_norm = _norm(cfg, cfg.head_dim)

    def qkv(self, x: torch.Tensor, rope: "Rope | None"):
        h, kv, d = self.shape
        b, t, _ = x.shape
        q, k, v = self.projections(x)
        q = self.q_norm(q.view(b, t, h, d)).transpose(1, 2)
        k = self.k_norm(k.view(b, t, kv, d)).transpose(1, 2)
        v = v.view(b, t, kv, d).transpose(1, 2)
        q, k = rope.apply(torch.cat([q, k], dim=1)).split([h, kv], dim=1)
        return q, k, v

    def query(self, x: torch.Tensor, rope: "Rope | None") -> torch.Tensor:
        h, _, d = self.shape
        b, t, _ = x.shape
        return rope.apply(self.q_norm(self.q_proj(x).view(b, t, h, d)).transpose(1, 2))


def _joined(joined, parts: tuple):
    """`joined`, one module computing `parts`' outputs concatenated (`quantized.join_projections`), where it may
    stand for them: it was made of these very modules, and none of them carries a hook (a probe or weight
    streaming must see its own module run). None: call the parts."""
    if joined is None or joined.joins != parts or any(p._forward_hooks or p._forward_pre_hooks for p in parts):
        return None
    return joined


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.arch == "llama"
        if self.gated:
            self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu, "gelu_pytorch_tanh": _gelu_tanh}[cfg.activation]
        self.gate_up_proj = None  # gate and up in one weight call where the loader joined them (`_joined`)

    def forward(self, x):
        if self.gated:
            joined = _joined(self.gate_up_proj, (self.gate_proj, self.up_proj))
            if joined is not None:
                gate, up = joined(x).chunk(2, -1)
                return self.down_proj(self.act(gate) * up)
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.index, self.pre_norm = index, cfg.pre_norm
        self.attn_norm = _norm(cfg)
        self.attn = (NormedQKAttention if cfg.qk_norm else Attention)(cfg, index)
        self.mlp_norm = _norm(cfg)
        self.mlp = MLP(cfg)

    def own_rope(self, rope):
        """This block's rotation among what `Transformer.rope` gave (one for every layer here)."""
        return rope

    def forward(self, h: torch.Tensor, rope: "Rope | None", attend, event) -> torch.Tensor:
        """One block over h [B, T, hidden]. `attend(layer, q, k, v)` is the attention itself (what the
        runtime owns: which cached entries each row reads); `event(layer, point, x)` hears of the
        attention input ("attn_in") and of the residual after attention ("attn_out")."""
        x, q, k, v = self.attention_input(h, self.own_rope(rope))
        event(self.index, "attn_in", x)
        h = self.attention_output(h, attend(self.index, q, k, v))
        event(self.index, "attn_out", h)
        return self.feed_forward(h)

    # The three dense parts of a block, split where the runtime's attention and events come in: functions of
    # tensors only, which `infinigen.compiled` compiles (a decoding step joins one layer's output to the next
    # layer's input in one region).
    def attention_input(self, h: torch.Tensor, rope):
        """(x, q, k, v): the attention input x (normed h, or h itself in OPT's post-norm) and its queries and
        keys/values (`Attention.qkv`); `rope` is this block's own (`own_rope`)."""
        x = self.attn_norm(h) if self.pre_norm else h
        q, k, v = self.attn.qkv(x, rope)
        return x, q, k, v

    def attention_output(self, h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The residual after attention, from the block's input h and the attention's output a [B,H,T,d]."""
        o = self.attn.o_proj(a.transpose(1, 2).flatten(2))
        return h + o if self.pre_norm else self.attn_norm(h + o)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP and its residual: the block's output."""
        if self.pre_norm:
            return h + self.mlp(self.mlp_norm(h))
        return self.mlp_norm(h + self.mlp(h))  # OPT-350m style post-norm


class SandwichBlock(Block):
    """Gemma 3's block: norms before and after attention and before and after the MLP, and its own
    rotary embedding and window by layer type (local or global)."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.attn_post_norm = _norm(cfg)
        self.mlp_post_norm = _norm(cfg)

    def own_rope(self, rope):
        return rope[self.index]

    def attention_output(self, h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return h + self.attn_post_norm(self.attn.o_proj(a.transpose(1, 2).flatten(2)))

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp_post_norm(self.mlp(self.mlp_norm(h)))


class Rotary(nn.Module):
    """RoPE with the frequencies `transformers` computes for the config (default, llama3, yarn, ...);
    `layer_type`: those of one layer type of a model with several (Gemma 3's local and global layers)."""

    def __init__(self, cfg: ModelConfig, layer_type: str | None = None):
        super().__init__()
        if layer_type is None:
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
            ref = LlamaRotaryEmbedding(config=cfg.hf_config)
            inv_freq, scaling = ref.inv_freq, ref.attention_scaling
        else:
            from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
            ref = Gemma3RotaryEmbedding(cfg.hf_config)
            inv_freq = getattr(ref, f"{layer_type}_inv_freq")
            scaling = getattr(ref, f"{layer_type}_attention_scaling")
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)
        self.scaling = float(scaling)
        self._last = None  # (positions, cos, sin): the layers of a step and speculation ask for the same positions

    def cos_sin(self, positions: torch.Tensor):
        last, inference = self._last, torch.is_inference_mode_enabled()
        # on CUDA the comparison would wait for the GPU (torch.equal answers on the host): a few small kernels
        # recompute the rotation instead, so a decoding step never synchronizes here
        if last is not None and not positions.is_cuda and last[3] == inference and last[0].shape == positions.shape \
                and last[0].device == positions.device and torch.equal(last[0], positions):
            return last[1], last[2]  # (inference tensors must not leak into autograd-mode calls)
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        if not positions.is_cuda:
            self._last = (positions.clone(), cos, sin, inference)
        return cos, sin

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> "Rope":
        """The rotation of tokens at positions [B, T], for tensors of `dtype`."""
        cos, sin = self.cos_sin(positions)
        cos, sin = cos[:, None], sin[:, None]
        return Rope(cos.to(dtype), sin.to(dtype), cos, sin)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, d] at positions [B, T]."""
        return self.at(positions, x.dtype).apply(x)


class LayerRotary(nn.Module):
    """One `Rotary` per layer type; `at` gives every layer its rotation (each type computed once)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layer_types = list(cfg.layer_rope)
        self.types = nn.ModuleDict({t: Rotary(cfg, t) for t in sorted(set(self.layer_types))})

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> list:
        by_type = {t: r.at(positions, dtype) for t, r in self.types.items()}
        return [by_type[t] for t in self.layer_types]


def make_rotary(cfg: ModelConfig) -> nn.Module:
    return Rotary(cfg) if cfg.layer_rope is None else LayerRotary(cfg)


class Rope(NamedTuple):
    """The rotary embedding of one pass's positions: cos and sin [B, 1, T, d] in the model's dtype,
    computed once for every layer (and in float32, for tensors of another dtype)."""
    cos: torch.Tensor
    sin: torch.Tensor
    cos32: torch.Tensor
    sin32: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos, self.sin
        if cos.dtype != x.dtype:
            cos, sin = self.cos32.to(x.dtype), self.sin32.to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def rows(self, start: int, stop: int) -> "Rope":
        """The rotation of this pass's rows start..stop-1 only."""
        return Rope(*(t[:, :, start:stop] for t in self))


def rope_rows(rope, start: int, stop: int):
    """`rope` (a Rope, a list of one per layer, or None) for a pass's rows start..stop-1."""
    if rope is None:
        return None
    if isinstance(rope, Rope):
        return rope.rows(start, stop)
    return [rope_rows(r, start, stop) for r in rope]


def _grouped_sdpa(q, k, v, g: int, **kw) -> torch.Tensor:
    """One SDPA call of q [B,H,T,d] over k, v [B,Hkv,S,d] whose G = H / Hkv query heads share a KV head: torch's
    `enable_gqa` where it has it (no copy: 9% faster at 8192 tokens on CPU), else each KV head repeated G times."""
    if g > 1 and SDPA_GQA:
        kw["enable_gqa"] = True
    elif g > 1:  # the GQA group's keys for every query head (a transient copy)
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q, k, v, **kw)


class Transformer(nn.Module):
    """The network: embedding, blocks, head. What a pass does with a KV cache is `infinigen.runtime`'s."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        embed_dim = cfg.embed_dim or cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, embed_dim)
        if cfg.arch == "opt":
            self.embed_positions = nn.Embedding(cfg.max_position + 2, cfg.hidden_size)  # OPT offsets by 2
            projected = embed_dim != cfg.hidden_size
            self.project_in = nn.Linear(embed_dim, cfg.hidden_size, bias=False) if projected else None
            self.project_out = nn.Linear(cfg.hidden_size, embed_dim, bias=False) if projected else None
            self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps) if cfg.final_norm else None
        else:
            self.rotary = make_rotary(cfg)
            self.norm = _norm(cfg)
        block = SandwichBlock if cfg.sandwich_norms else Block
        self.layers = nn.ModuleList(block(cfg, i) for i in range(cfg.num_layers))
        self.lm_head = nn.Linear(embed_dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self.step_parts = None  # a decoding step's compiled block parts (`infinigen.compiled.enable`)

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens)
        if self.cfg.embed_scale is not None:  # rounded to the embedding's dtype first, as transformers does
            h = h * torch.tensor(self.cfg.embed_scale, dtype=h.dtype)
        if self.cfg.arch == "opt":
            if self.project_in is not None:
                h = self.project_in(h)
            h = h + self.embed_positions(positions + 2)
        return h

    def rope(self, positions: torch.Tensor):
        """The rotary embedding of positions [B, T] for every layer of a pass (None: the model has none;
        a list of one per layer when layer types rotate differently: `Block.own_rope` picks)."""
        return self.rotary.at(positions, self.dtype) if self.cfg.uses_rope else None

    def head(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            h = self.norm(h)
        if self.cfg.arch == "opt" and self.project_out is not None:
            h = self.project_out(h)
        logits = self.lm_head(h).float()
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor):
        """Queries [B,H,T,d] (post-RoPE) and keys/values [B,Hkv,T,d] of `layer` for attention input x."""
        block = self.layers[layer]
        return block.attn.qkv(x, block.own_rope(self.rope(positions)))

    def query(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Only the (post-RoPE) queries of `layer`: what speculation needs one layer ahead."""
        block = self.layers[layer]
        return block.attn.query(x, block.own_rope(self.rope(positions)))

    def window(self, q_pos: torch.Tensor, k_pos: torch.Tensor, layer: int) -> torch.Tensor | None:
        """Sliding-window mask of `layer` (Mistral, Gemma 3's local layers) for query positions [..., R, 1]
        against key positions [..., 1, S]; None: the layer has no window."""
        w = self.cfg.window(layer)
        return None if w is None else (q_pos - k_pos) < w

    def dense_attention(self, q, k, v, mask, causal: bool = False) -> torch.Tensor:
        """q [B,H,T,d] over k, v [B,Hkv,S,d] with bool mask [B,1|Hkv,T,S], in row chunks.
        causal=True promises that `mask` is the plain causal mask (T == S; it may then be None): one
        flash-attention call that skips the blocks above the diagonal and materializes no mask."""
        b, h, t, d = q.shape
        hkv = k.shape[1]
        g = h // hkv
        if causal and t == k.shape[2]:
            return _grouped_sdpa(q, k, v, g, is_causal=True, scale=self.scale)
        qg = q.view(b, hkv, g, t, d)
        out = torch.empty_like(qg)
        for s in range(0, t, PREFILL_CHUNK):
            e = min(t, s + PREFILL_CHUNK)
            m = mask[:, :, s:e]
            # keys no row of the chunk may see are left out: the causal future (half the work at long prompts)
            # and, under a sliding window, the past behind it (a 512-token window's layer at 32K tokens: the
            # chunk's rows read ~1.5K keys, not ~16K); a left-out key's weight is exactly 0 either way
            n = e if k.shape[2] > e and not m[..., e:].any() else k.shape[2]
            lo = first_key_read(m[..., :n], 0)  # rows always see themselves: never the default
            m = m[..., lo:n]
            m = m[:, :, None].expand(b, m.shape[1], g, e - s, n - lo).reshape(b, m.shape[1], g * (e - s), n - lo)
            qc = qg[:, :, :, s:e].reshape(b, hkv, g * (e - s), d)
            o = F.scaled_dot_product_attention(qc, k[:, :, lo:n], v[:, :, lo:n], attn_mask=m, scale=self.scale)
            out[:, :, :, s:e] = o.view(b, hkv, g, e - s, d)
        return out.view(b, h, t, d)

    def tiled_attention(self, q, k, v, start: int, tile: int, layer: int) -> torch.Tensor:
        """A prompt's attention whose every row is computed alike wherever the prompt was cut: q [B,H,T,d] are
        the rows at positions start..start+T-1 (start a multiple of `tile`), k, v [B,Hkv,start+T,d] the keys and
        values of positions 0..start+T-1, unpadded. The rows go in tiles of `tile` at multiples of `tile`, each
        one call over the keys it may see under a causal (and the layer's sliding-window) mask, so a tile's call
        has the same operands whether the prompt was prefilled whole or continued from a cached prefix at a
        multiple of `tile` (a flash call's blocking and a matmul's depend on the number of rows)."""
        if start % tile:
            raise ValueError(f"a tiled prefill starts at a multiple of its tile ({tile}), not at {start}")
        b, h, t, d = q.shape
        g = h // k.shape[1]
        w = self.cfg.window(layer)
        out = torch.empty_like(q)
        for s in range(0, t, tile):
            e = min(t, s + tile)
            lo = 0 if w is None else max(0, start + s - w + 1)  # the first key a row of the tile may see
            q_pos = torch.arange(start + s, start + e, device=q.device)[:, None]
            k_pos = torch.arange(lo, start + e, device=q.device)[None, :]
            mask = k_pos <= q_pos
            window = self.window(q_pos, k_pos, layer)
            if window is not None:
                mask &= window
            out[:, :, s:e] = _grouped_sdpa(q[:, :, s:e], k[:, :, lo:start + e], v[:, :, lo:start + e], g,
                                           attn_mask=mask, scale=self.scale)
        return out

    def prompt_mask(self, valid: torch.Tensor, positions: torch.Tensor, window: int | None):
        """(mask [B,1,T,T] or None, causal) of a prompt with real tokens valid [B, T] for layers with this
        sliding `window` (None: none): causal, padding hidden, padded rows see themselves. No padding and
        no window in reach: the plain causal mask, not built (causal=True)."""
        t = valid.shape[1]
        if bool(valid.all()) and (window is None or t <= window):
            return None, True
        mask = torch.ones(t, t, dtype=torch.bool, device=valid.device).tril() & valid[:, None, :]
        if window is not None:  # by row chunks: the position differences of all pairs at once are int64 [B, T, T]
            for s in range(0, t, PREFILL_CHUNK):  # (8 GB at 32K tokens)
                rows = positions[:, s:s + PREFILL_CHUNK, None]
                mask[:, s:s + PREFILL_CHUNK] &= (rows - positions[:, None, :]) < window
        mask |= torch.eye(t, dtype=torch.bool, device=valid.device)
        return mask[:, None], False
