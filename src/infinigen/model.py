"""The transformer runtime: Llama family (Llama, Mistral, Qwen2, SmolLM) and OPT.

One runtime serves generation, evaluation and benchmarks. Three entry points:
  prefill(tokens)         the prompt, dense causal attention, keys/values written to the store
  decode(tokens)          one token per row; a policy picks which cached entries each layer reads
  teacher_forced(tokens)  a whole sequence per layer, reproducing what `decode` with the policy would
                          compute at every position (for perplexity and log-likelihood scoring)
Prompts of different lengths are left-padded; `Session` carries the per-request state.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVStore
from .config import ModelConfig
from .policies.base import FullCache, Policy

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


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.o_bias)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.arch == "llama"
        if self.gated:
            self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu}[cfg.activation]

    def forward(self, x):
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        norm = (lambda: RMSNorm(cfg.hidden_size, cfg.norm_eps)) if cfg.arch == "llama" else (
            lambda: nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps))
        self.attn_norm = norm()
        self.attn = Attention(cfg)
        self.mlp_norm = norm()
        self.mlp = MLP(cfg)


class Rotary(nn.Module):
    """RoPE with the frequencies `transformers` computes for the config (default, llama3, yarn, ...)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        ref = LlamaRotaryEmbedding(config=cfg.hf_config)
        self.register_buffer("inv_freq", ref.inv_freq.float().clone(), persistent=False)
        self.scaling = float(ref.attention_scaling)
        self._last = None  # (positions, cos, sin): every layer of a step asks for the same positions

    def cos_sin(self, positions: torch.Tensor):
        last, inference = self._last, torch.is_inference_mode_enabled()
        if last is not None and last[3] == inference and last[0].shape == positions.shape \
                and last[0].device == positions.device and torch.equal(last[0], positions):
            return last[1], last[2]  # (inference tensors must not leak into autograd-mode calls)
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        self._last = (positions.clone(), cos, sin, inference)
        return cos, sin

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, d] at positions [B, T]."""
        cos, sin = self.cos_sin(positions)
        cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


@dataclass
class KVStats:
    """Relative KV size: the fraction of past entries each layer's attention read, per decoding step."""
    num_layers: int
    read: list = field(default_factory=list)
    steps: list = field(default_factory=list)

    def __post_init__(self):
        self.read = [0.0] * self.num_layers
        self.steps = [0] * self.num_layers
        self._pending = []  # (layer, selected, past): reduced in bulk, off the per-layer decode path

    def record(self, layer: int, selected: torch.Tensor, past: torch.Tensor) -> None:
        """selected [B, Hkv, R] entries read and past [B, 1|Hkv, R] tokens before each row."""
        self._pending.append((layer, selected, past.clone()))  # past may be a view of live positions
        if len(self._pending) >= 2048:
            self._flush()

    def _flush(self) -> None:
        """Fold pending records into `read`/`steps`, one stacked computation per shape."""
        pending, self._pending = self._pending, []
        groups: dict = {}
        for item in pending:
            groups.setdefault((item[1].shape, item[2].shape, item[1].device), []).append(item)
        for items in groups.values():
            sel = torch.stack([s for _, s, _ in items]).float()
            past = torch.stack([p for _, _, p in items]).float().clamp(min=1)
            fracs = (sel / past).mean(dim=(1, 2)).sum(-1).tolist()
            for (layer, s, _), f in zip(items, fracs):
                self.read[layer] += f
                self.steps[layer] += s.shape[-1]

    def per_layer(self) -> list[float]:
        self._flush()
        return [r / s if s else float("nan") for r, s in zip(self.read, self.steps)]

    def overall(self, layers=None) -> float:
        vals = [f for i, f in enumerate(self.per_layer()) if (layers is None or i in layers) and not math.isnan(f)]
        return sum(vals) / len(vals) if vals else float("nan")


@dataclass
class Session:
    """One batch of requests in flight: the model, its KV store, the policy and the policy's state for
    these requests (`policy.begin`), and where in the sequence each row is."""
    model: "Transformer"
    store: KVStore
    policy: Policy
    stats: KVStats
    next_pos: torch.Tensor  # [B] position of the next token of each row
    state: object = None  # the policy's per-request state
    positions: torch.Tensor | None = None  # [B, T] positions of the tokens being processed
    row: int = 0  # which of those tokens the current `select` is for (teacher-forced replay)
    first_row: int = 0  # first decoding row in teacher-forced mode
    prompt_valid: torch.Tensor | None = None  # [B, T] real (unpadded) tokens of the prompt
    extra: dict = field(default_factory=dict)
    mode: str = ""  # "prefill" | "decode" | "teacher": placement prefetches KV rows only while decoding

    def event(self, layer: int, point: str, x: torch.Tensor) -> None:
        """A layer's hidden state at `point` ("attn_in", "attn_out"; layer -1 "embed" when a decoding step
        starts) is ready: the policy sees it (speculation), then placement may start moving what layer+1
        will read (the policy may have just decided it)."""
        self.policy.on_hidden(layer, point, x, self)
        self.store.ahead(layer, point, self)

    def start_prefill(self, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """A prompt with positions [B, T] and real (unpadded) tokens valid [B, T] is about to be written."""
        self.positions, self.row, self.mode = positions, positions.shape[1] - 1, "prefill"
        self.next_pos = positions[:, -1] + 1
        self.prompt_valid = valid

    def prefill_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """What a prefill does to a session at `layer`, given the prompt's queries and keys/values: write
        them to the store, then let the policy see them. Live prefills and replays alike go through here."""
        t = k.shape[2]
        self.store.write_prompt(layer, k, v, self.prompt_valid[:, :t], self.positions[:, :t])
        self.policy.on_prefill(layer, q, k, v, self)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        embed_dim = cfg.embed_dim or cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, embed_dim)
        if cfg.arch == "opt":
            self.embed_positions = nn.Embedding(cfg.max_position + 2, cfg.hidden_size)  # OPT offsets by 2
            self.project_in = nn.Linear(embed_dim, cfg.hidden_size, bias=False) if embed_dim != cfg.hidden_size else None
            self.project_out = nn.Linear(cfg.hidden_size, embed_dim, bias=False) if embed_dim != cfg.hidden_size else None
            self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps) if cfg.final_norm else None
        else:
            self.rotary = Rotary(cfg)
            self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.lm_head = nn.Linear(embed_dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.scale = cfg.head_dim ** -0.5

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    # ---- sessions -------------------------------------------------------------------------------
    def new_session(self, batch: int, policy: Policy | None, store: KVStore) -> Session:
        """A session of `batch` rows over `store` (built by `infinigen.placement.Placement.new_store`)."""
        policy = policy or FullCache()
        sess = Session(model=self, store=store, policy=policy, stats=KVStats(self.cfg.num_layers),
                       next_pos=torch.zeros(batch, dtype=torch.long, device=self.device))
        sess.state = policy.begin(self, sess)
        return sess

    # ---- pieces shared by every path -------------------------------------------------------------
    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens)
        if self.cfg.arch == "opt":
            if self.project_in is not None:
                h = self.project_in(h)
            h = h + self.embed_positions(positions + 2)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            h = self.norm(h)
        if self.cfg.arch == "opt" and self.project_out is not None:
            h = self.project_out(h)
        return self.lm_head(h).float()

    def qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor):
        """Queries [B,H,T,d] (post-RoPE) and keys/values [B,Hkv,T,d] of `layer` for attention input x."""
        cfg, attn = self.cfg, self.layers[layer].attn
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        if cfg.uses_rope:  # one rotation for queries and keys together: fewer small ops per decode step
            q, k = self.rotary.apply(torch.cat([q, k], dim=1), positions).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        return q, k, v

    def query(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Only the (post-RoPE) queries of `layer`: what speculation needs one layer ahead."""
        cfg, attn = self.cfg, self.layers[layer].attn
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        return self.rotary.apply(q, positions) if cfg.uses_rope else q

    def _run_layer(self, layer: int, h: torch.Tensor, positions: torch.Tensor, event, attend) -> torch.Tensor:
        """One block; `attend(layer, q, k, v)` is the only part that differs between the three paths.
        `event(layer, point, x)` hears of the attention input and of the residual after attention
        (`Session.event`; the server's engine fans it out to the sessions of a stacked batch)."""
        blk = self.layers[layer]
        if self.cfg.pre_norm:
            x = blk.attn_norm(h)
            event(layer, "attn_in", x)
            q, k, v = self.qkv(layer, x, positions)
            h = h + blk.attn.o_proj(attend(layer, q, k, v).transpose(1, 2).flatten(2))
            event(layer, "attn_out", h)
            return h + blk.mlp(blk.mlp_norm(h))
        # OPT-350m style post-norm
        event(layer, "attn_in", h)
        q, k, v = self.qkv(layer, h, positions)
        h = blk.attn_norm(h + blk.attn.o_proj(attend(layer, q, k, v).transpose(1, 2).flatten(2)))
        event(layer, "attn_out", h)
        return blk.mlp_norm(h + blk.mlp(h))

    def _window(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """Sliding-window mask (Mistral) for query positions [..., R, 1] against key positions [..., 1, S]."""
        w = self.cfg.sliding_window
        return None if w is None else (q_pos - k_pos) < w

    def _dense_attention(self, q, k, v, mask, causal: bool = False) -> torch.Tensor:
        """q [B,H,T,d] over k, v [B,Hkv,S,d] with bool mask [B,1|Hkv,T,S], in row chunks.
        causal=True promises that `mask` is the plain causal mask (T == S; it may then be None): one
        flash-attention call that skips the blocks above the diagonal and materializes no mask."""
        b, h, t, d = q.shape
        hkv = k.shape[1]
        g = h // hkv
        if causal and t == k.shape[2]:
            if g > 1 and not SDPA_GQA:  # the GQA group's keys for every query head (a transient copy)
                k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            kw = {"enable_gqa": True} if g > 1 and SDPA_GQA else {}  # no copy: 9% faster at 8192 tokens on CPU
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, **kw)
        qg = q.view(b, hkv, g, t, d)
        out = torch.empty_like(qg)
        for s in range(0, t, PREFILL_CHUNK):
            e = min(t, s + PREFILL_CHUNK)
            m = mask[:, :, s:e]
            # keys no row of the chunk may see (the causal future) are left out: half the work at long prompts
            n = e if k.shape[2] > e and not m[..., e:].any() else k.shape[2]
            m = m[..., :n]
            m = m[:, :, None].expand(b, m.shape[1], g, e - s, n).reshape(b, m.shape[1], g * (e - s), n)
            qc = qg[:, :, :, s:e].reshape(b, hkv, g * (e - s), d)
            o = F.scaled_dot_product_attention(qc, k[:, :, :n], v[:, :, :n], attn_mask=m, scale=self.scale)
            out[:, :, :, s:e] = o.view(b, hkv, g, e - s, d)
        return out.view(b, h, t, d)

    # ---- prefill --------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, sess: Session, pad_mask: torch.Tensor | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """tokens [B, T] left-padded (pad_mask True on real tokens). Returns logits of the last
        position [B, V], or of every position [B, T, V]."""
        valid = torch.ones_like(tokens, dtype=torch.bool) if pad_mask is None else pad_mask.bool()
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # padding sits at position 0
        sess.start_prefill(positions, valid)
        mask, causal = self.prompt_mask(valid, positions)
        attend = functools.partial(self._prompt_attention, sess=sess, mask=mask, causal=causal)
        h = self.embed(tokens, positions)
        for layer in range(self.cfg.num_layers):
            h = self._run_layer(layer, h, sess.positions, sess.event, attend)
        return self.head(h if all_logits else h[:, -1])

    def prompt_mask(self, valid: torch.Tensor, positions: torch.Tensor):
        """(mask [B,1,T,T] or None, causal) of a prompt with real tokens valid [B, T]: causal, padding
        hidden, padded rows see themselves. No padding and no sliding window in reach: the plain causal
        mask, not built (causal=True)."""
        t = valid.shape[1]
        if bool(valid.all()) and (self.cfg.sliding_window is None or t <= self.cfg.sliding_window):
            return None, True
        mask = torch.ones(t, t, dtype=torch.bool, device=valid.device).tril() & valid[:, None, :]
        window = self._window(positions[:, :, None], positions[:, None, :])
        if window is not None:
            mask = mask & window
        return (mask | torch.eye(t, dtype=torch.bool, device=valid.device))[:, None], False

    def _prompt_attention(self, layer: int, q, k, v, sess: Session, mask, causal: bool) -> torch.Tensor:
        """Dense attention of the prompt; its keys and values go to the session first."""
        sess.prefill_layer(layer, q, k, v)
        return self._dense_attention(q, k, v, mask, causal=causal)

    # ---- decode ---------------------------------------------------------------------------------
    def _step_attention(self, layer: int, q, k, v, sess: Session) -> torch.Tensor:
        """Attention of one token per row (q [B,H,1,d]) over the past entries the policy selects plus
        itself, then the token is stored. A plain dense step stores the token first and runs one fused
        attention over the store; otherwise the current token is kept apart, so nothing is copied."""
        store, pol = sess.store, sess.policy
        kp, vp, valid, pos = store.past(layer)
        cur = sess.positions[:, sess.row]  # [B]
        if self.cfg.sliding_window is not None:
            valid = valid & (cur[:, None, None] - pos < self.cfg.sliding_window)
        keep = pol.select(layer, q, sess)
        if keep is None:
            sess.stats.record(layer, valid.sum(-1, keepdim=True), cur[:, None, None])
            if store.attends_in_place() and type(pol).observe is Policy.observe and (
                    self.cfg.sliding_window is None or store.length[layer] < self.cfg.sliding_window):
                # no mask, no separate current token, no weights kept for the policy
                slots = store.append(layer, k, v, cur)
                kp, vp, _, _ = store.past(layer)
                b, h, _, d = q.shape
                out = F.scaled_dot_product_attention(q.view(b, kp.shape[1], h // kp.shape[1], d), kp, vp,
                                                     scale=self.scale)
                pol.on_append(layer, slots, k, v, sess)
                return out.view(b, h, 1, d)
            idx, mask = None, valid
            kp, vp = store.dense(layer)  # an offloaded store hands its fast-tier copy here
        else:
            keep, idx, mask, counts = store.slots(layer, keep, valid)  # an offloaded store planned them already
            kp, vp = store.gather(layer, idx)
            sess.stats.record(layer, counts[..., None], cur[:, None, None])
        out, probs = self._attend_one(q, kp, vp, mask, k, v)
        pol.observe(layer, probs, idx, sess)
        slots = store.append(layer, k, v, cur)
        if store.allocator is not None:
            store.allocator.on_read(layer, keep if keep is not None else valid)
        pol.on_append(layer, slots, k, v, sess)
        return out

    def _attend_one(self, q, kp, vp, mask, kc, vc):
        """Softmax over [past entries, current token]; probs [B,Hkv,G,n+1] are returned for policies."""
        b, h, _, d = q.shape
        hkv = kp.shape[1]
        qg = q.view(b, hkv, h // hkv, d)
        s_past = torch.matmul(qg, kp.transpose(-1, -2)).float() * self.scale
        s_past = torch.where(mask[:, :, None, :], s_past, float("-inf"))
        s_cur = (qg.float() * kc.float()).sum(-1, keepdim=True) * self.scale
        probs = torch.softmax(torch.cat([s_past, s_cur], dim=-1), dim=-1)
        out = torch.matmul(probs[..., :-1].to(vp.dtype), vp) + probs[..., -1:].to(vc.dtype) * vc
        return out.view(b, h, 1, d), probs

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, sess: Session) -> torch.Tensor:
        """One new token per row, tokens [B]. Returns logits [B, V]."""
        sess.positions, sess.row, sess.mode = sess.next_pos[:, None], 0, "decode"
        h = self.embed(tokens[:, None], sess.positions)
        sess.event(-1, "embed", h)  # placement: layer 0's rows can start moving now
        attend = functools.partial(self._step_attention, sess=sess)
        for layer in range(self.cfg.num_layers):
            h = self._run_layer(layer, h, sess.positions, sess.event, attend)
        sess.next_pos = sess.next_pos + 1
        return self.head(h[:, -1])

    # ---- teacher-forced ----------------------------------------------------------------------------
    @torch.inference_mode()
    def teacher_forced(self, tokens: torch.Tensor, prefill_len: int, sess: Session) -> torch.Tensor:
        """Logits [B, T, V] for a whole sequence: the first `prefill_len` tokens as a prompt, every later
        position as if decoded one token at a time with the session's policy (same selections, same
        numbers up to float summation order). Rows must be unpadded."""
        b, t = tokens.shape
        p = prefill_len
        positions = torch.arange(t, device=tokens.device).expand(b, t)
        sess.start_prefill(positions, torch.ones(b, t, dtype=torch.bool, device=tokens.device))
        sess.first_row, sess.mode = p, "teacher"
        sess.next_pos = torch.full((b,), t, dtype=torch.long, device=tokens.device)
        mask, causal = self.prompt_mask(torch.ones(1, p, dtype=torch.bool, device=tokens.device), positions[:1, :p])
        attend = functools.partial(self._teacher_attention, sess=sess, mask=mask, causal=causal)
        h = self.embed(tokens, positions)
        for layer in range(self.cfg.num_layers):
            h = self._run_layer(layer, h, sess.positions, sess.event, attend)
        return self.head(h)

    def _teacher_attention(self, layer: int, q, k, v, sess: Session, mask, causal: bool) -> torch.Tensor:
        """The prompt rows densely (as `prefill`), then every later row as `decode` would attend: all rows
        at once when the policy can say what each row reads (`select_rows`), else replayed row by row."""
        p, t = sess.first_row, q.shape[2]
        out = torch.empty_like(q)
        sess.row = p - 1
        out[:, :, :p] = self._prompt_attention(layer, q[:, :, :p], k[:, :, :p], v[:, :, :p], sess, mask, causal)
        if p == t:
            return out
        keep = NotImplemented
        if sess.store.allocator is None:  # a pool limit needs the replay: victims depend on every step
            keep = sess.policy.select_rows(layer, q[:, :, p:], k, sess)
        if keep is not NotImplemented:
            out[:, :, p:] = self._rows_attention(layer, q[:, :, p:], k, v, keep, sess)
            return out
        for r in range(p, t):  # stateful policy: replay decoding row by row
            sess.row = r
            out[:, :, r:r + 1] = self._step_attention(layer, q[:, :, r:r + 1], k[:, :, r:r + 1], v[:, :, r:r + 1], sess)
        return out

    def _rows_attention(self, layer, q, k, v, keep, sess: Session) -> torch.Tensor:
        """Decoding rows q [B,H,R,d] (positions first_row..) at once: each reads the past entries in
        `keep` [B,Hkv,R,T] (None: all) plus itself, keys and values as the store would hold them."""
        b, h, r, d = q.shape
        t = k.shape[2]
        p = sess.first_row
        dev = q.device
        rows = torch.arange(p, p + r, device=dev)[:, None]
        cols = torch.arange(t, device=dev)[None, :]
        past = cols < rows  # [R, T]
        if self.cfg.sliding_window is not None:
            past = past & self._window(rows, cols)
        keep = past[None, None] if keep is None else keep & past
        sess.stats.record(layer, keep.sum(-1).expand(b, k.shape[1], r), rows.T.expand(b, 1, r))
        codec = sess.store.codec
        kq, vq = codec.encode(k), codec.encode(v)
        diag = (cols == rows)[None, None]
        hkv, g = k.shape[1], h // k.shape[1]
        qg = q.view(b, hkv, g, r, d)
        out = torch.empty_like(qg)
        for s in range(0, r, PREFILL_CHUNK):
            e = min(r, s + PREFILL_CHUNK)
            qc = qg[:, :, :, s:e]
            scores = torch.matmul(qc, kq[:, :, None].transpose(-1, -2)).float() * self.scale  # [B,Hkv,G,c,T]
            own = (qc.float() * k[:, :, None, p + s:p + e].float()).sum(-1) * self.scale  # [B,Hkv,G,c]
            scores = scores.masked_fill(~keep[:, :, None, s:e], float("-inf"))
            dg = diag[:, :, None, s:e]
            scores = torch.where(dg, own[..., None], scores)
            probs = torch.softmax(scores, dim=-1)
            pd = (probs * dg).sum(-1, keepdim=True)
            o = torch.matmul(probs.masked_fill(dg, 0).to(vq.dtype), vq[:, :, None]) + pd.to(v.dtype) * v[:, :, None, p + s:p + e]
            out[:, :, :, s:e] = o
        return out.view(b, h, r, d)
