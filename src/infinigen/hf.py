"""InfiniGen and the baselines on an unmodified `transformers` model.

    import infinigen.hf

    with infinigen.hf.enable(model, "infinigen", tokenizer=tok) as ig:
        out = model.generate(**inputs, max_new_tokens=64, do_sample=False)
    print(ig.cache.stats.overall())  # relative KV size of that generation

How it works, in three pieces that `transformers` 5.x offers as extension points:
  * `InfiniGenCache` (a `Cache` passed as `cache`; `past_key_values` before transformers 5.24) does not
    concatenate keys and values: it hands the new ones to the attention function and counts how many
    tokens it has seen.
  * the attention function "infinigen" (registered in `AttentionInterface`) runs our runtime's own
    attention on them, `Session.attend`: the dense prompt attention at the first forward, then token by
    token what `runtime.decode` runs, where the policy selects, observes and the KV store appends.
  * forward hooks on each decoder layer give the policy the per-layer hidden states it speculates from
    (`on_hidden(layer, "attn_in" | "attn_out", x)`), at the same points as in our runtime.
The policies call back into our runtime (`model.query`, `model.rotary`, ...), so `enable` builds a
`Transformer` over the `transformers` model's own weight tensors (shared, not copied).

Only Llama-family models and OPT are supported (the architectures of `infinigen.config`). Greedy
decoding and sampling work; beam search and `num_return_sequences > 1` do not (the KV store does
not reorder batch rows).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from pathlib import Path

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .config import ModelConfig
from .errors import UserError
from .loading import build, checkpoint_source
from .model import Transformer
from .placement import Placement
from .policies import Policy, make_policy

ATTN_NAME = "infinigen"
# the keyword a model's forward, its decoder layers and `generate` take the cache by: `past_key_values`
# until transformers 5.23, `cache` from 5.24 (which still accepts `past_key_values`, with a deprecation warning)
CACHE_KWARGS = ("cache", "past_key_values")


def _cache_kwarg(hf_model) -> str:
    """The name `hf_model`'s transformers version takes the cache by (see CACHE_KWARGS)."""
    return "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"


def _cache_from(kwargs: dict):
    """The cache in the keyword arguments of a forward or `generate` call, under either name (or None)."""
    return next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)


# ---- the runtime over the transformers weights ----------------------------------------------------
def runtime_for(hf_model) -> Transformer:
    """Our `Transformer` holding the very tensors of `hf_model` (built once per model, then reused)."""
    rt = getattr(hf_model, "_infinigen_runtime", None)
    if rt is None:
        cfg = ModelConfig.from_hf(hf_model.config)
        p = next(hf_model.parameters())
        # same dtype and device: `.to` returns the tensor itself, and `assign=True` keeps it
        rt = build(cfg, dict(hf_model.state_dict()), dtype=p.dtype, device=p.device)
        folder = Path(str(getattr(hf_model, "name_or_path", "") or ""))
        if str(folder) and (folder / "config.json").is_file():  # loaded from a folder: its calibration
            rt.source_fingerprint = checkpoint_source(folder)
        object.__setattr__(hf_model, "_infinigen_runtime", rt)  # not a submodule: keep it out of state_dict
    return rt


# ---- the cache -------------------------------------------------------------------------------------
class _PassLayer(CacheLayerMixin):
    """One layer's bookkeeping: the KV store of the session holds the data; this counts tokens and hands
    the newest keys and values to the attention function untouched."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self):
        super().__init__()
        self.seen = 0
        self.pending = None  # the key tensor returned by the latest `update`, to recognise it in attention

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        self.pending = key_states
        return key_states, value_states

    def get_mask_sizes(self, query_length: int):
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self):
        raise NotImplementedError("InfiniGenCache cannot be reset: make a new one")

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("InfiniGenCache does not reorder or crop batch rows (no beam search, "
                                  "no num_return_sequences > 1, no assisted decoding)")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported


class InfiniGenCache(Cache):
    """A `cache` (`past_key_values`) whose KV store and policy are those of our runtime.

    max_len: tokens the store preallocates (prompt + new tokens); placement: where the KV pool lives and
    its limit (`infinigen.placement.Placement`; None: fast memory, unlimited).
    Use it inside `enable(model, ...)`, which installs the attention function and hooks it needs.
    """

    def __init__(self, hf_model, policy: Policy | str | None = None, max_len: int | None = None,
                 placement: Placement | None = None):
        self.rt = runtime_for(hf_model)
        super().__init__(layers=[_PassLayer() for _ in range(self.rt.cfg.num_layers)])
        self.policy = make_policy(policy) if isinstance(policy, str) else (policy or make_policy("full"))
        self.policy = self.policy.prepare(self.rt)
        self.max_len = max_len or self.rt.cfg.max_position
        self.placement = placement or Placement()
        self.session = None
        self.prompt_len = 0

    @property
    def stats(self):
        """KVStats of the session: relative KV size per layer and overall."""
        return self.session.stats if self.session is not None else None

    # called by the first decoder layer's pre-hook, once per forward
    def begin_forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None, mask) -> None:
        b, t = hidden.shape[:2]
        seen = self.layers[0].seen
        if position_ids is None:
            position_ids = torch.arange(seen, seen + t, device=hidden.device)[None]
        positions = position_ids.to(hidden.device).long().expand(b, t)
        if self.session is None:
            if seen:
                raise RuntimeError("InfiniGenCache: the first forward must start from an empty cache")
            if t > self.max_len:
                raise UserError(f"prompt of {t} tokens exceeds the cache's max_len {self.max_len}")
            self.session = self.placement.new_session(self.rt, b, self.max_len, self.policy, prompt_len=t)
            valid = _valid_from_mask(mask, b, t, hidden.device)
            self.prompt_len = t
            # what `runtime.prefill` computes: padded slots sit at position 0
            positions = torch.where(valid, positions, torch.zeros_like(positions))
            self.session.begin_prefill(positions, valid)
        else:
            if positions.shape[0] != self.session.batch:
                raise NotImplementedError("InfiniGenCache: the batch size changed between forward calls")
            # one token: as `runtime.decode`; several: decoded one by one in turn
            self.session.begin_step(positions)
            if t == 1:
                self.session.event(-1, "embed", hidden)

    def end_forward(self) -> None:
        self.session.end_step()

    def attend(self, layer: int, q, k, v) -> torch.Tensor:
        """q [B,H,T,d] post-RoPE (unscaled), k, v [B,Hkv,T,d] of the new tokens -> attention output [B,H,T,d]:
        exactly what our runtime's pass computes (the prompt densely, later tokens as decoded in turn)."""
        return self.session.attend(layer, q, k, v)


def _valid_from_mask(mask, b: int, t: int, device) -> torch.Tensor:
    """Real prompt tokens [B, T] from the 4D boolean mask `transformers` built (None: no padding).
    The last query row of a left-padded prompt sees every real token."""
    if mask is None or not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return torch.ones(b, t, dtype=torch.bool, device=device)
    last = mask[:, 0, -1, -t:]
    if last.dtype != torch.bool:  # an additive float mask: 0 where allowed
        last = last == 0
    return last.expand(b, t).clone()


# ---- the attention function ------------------------------------------------------------------------
def infinigen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """`AttentionInterface` function: our runtime's attention with the cache's policy, when the keys
    come from an `InfiniGenCache`; plain SDPA otherwise (e.g. a call without a cache)."""
    hooks: _Hooks | None = getattr(module, "_infinigen_hooks", None)
    cache = hooks.cache if hooks is not None else None
    layer = getattr(module, "layer_idx", None)
    if cache is None or layer is None or cache.session is None or cache.layers[layer].pending is not key:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    cache.layers[layer].pending = None
    if hooks.cfg.arch == "opt":
        query = query / module.scaling  # OPT scales queries in its projection; ours are unscaled
    out = cache.attend(layer, query, key, value)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make "infinigen" a valid `attn_implementation` (idempotent). Its mask is SDPA's, used only by
    the fallback path; the policy path builds its own masks."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(ATTN_NAME, infinigen_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


# ---- hooks -----------------------------------------------------------------------------------------
def _decoder_layers(hf_model) -> list[torch.nn.Module]:
    base = getattr(hf_model, "model", hf_model)
    base = getattr(base, "decoder", base)  # OPT
    layers = getattr(base, "layers", None)
    if layers is None:
        raise UserError(f"{type(hf_model).__name__}: cannot find its decoder layers")
    return list(layers)


class _Hooks:
    """Forward hooks that give the active cache's policy the hidden states of our runtime's
    `on_hidden` points, and tell the cache where a forward starts and ends."""

    def __init__(self, hf_model, cfg: ModelConfig):
        self.cfg, self.cache, self.handles, self.resid = cfg, None, [], None
        layers = _decoder_layers(hf_model)
        self.num_layers = len(layers)
        for i, blk in enumerate(layers):
            attn = blk.self_attn
            attn._infinigen_hooks = self
            self.handles.append(blk.register_forward_pre_hook(functools.partial(self._block_in, i), with_kwargs=True))
            if i == len(layers) - 1:
                self.handles.append(blk.register_forward_hook(self._block_out))
            pre_norm = blk.input_layernorm if cfg.arch == "llama" else blk.self_attn_layer_norm
            if cfg.pre_norm:
                self.handles.append(pre_norm.register_forward_hook(functools.partial(self._attn_in, i)))
                self.handles.append(attn.register_forward_hook(functools.partial(self._attn_out_pre, i)))
            else:  # OPT post-norm: the attention input is the block input, the norm follows the residual
                self.handles.append(pre_norm.register_forward_hook(functools.partial(self._attn_out_post, i)))
        self.layers = layers

    def _policy(self):
        c = self.cache
        return None if c is None or c.session is None else c.session.policy

    def _hidden(self, i, point, x):
        """The layer event, as our runtime's blocks send it (`infinigen.model.Block.forward`)."""
        self.cache.session.event(i, point, x)

    def _block_in(self, i, module, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        if i == 0:
            cache = _cache_from(kwargs)
            self.cache = cache if isinstance(cache, InfiniGenCache) else None
            if self.cache is not None:
                self.cache.begin_forward(h, kwargs.get("position_ids"), kwargs.get("attention_mask"))
        self.resid = h
        if not self.cfg.pre_norm and self._policy() is not None:
            self._hidden(i, "attn_in", h)

    def _block_out(self, module, args, out):
        if self.cache is not None and self.cache.session is not None:
            self.cache.end_forward()

    def _attn_in(self, i, module, args, out):
        if self._policy() is not None:
            self._hidden(i, "attn_in", out)

    def _attn_out_pre(self, i, module, args, out):
        if self._policy() is not None:
            self._hidden(i, "attn_out", self.resid + out[0])

    def _attn_out_post(self, i, module, args, out):
        if self._policy() is not None:
            self._hidden(i, "attn_out", out)

    def remove(self):
        for h in self.handles:
            h.remove()
        for blk in self.layers:
            if getattr(blk.self_attn, "_infinigen_hooks", None) is self:
                del blk.self_attn._infinigen_hooks


# ---- the user-facing switch ------------------------------------------------------------------------
@dataclasses.dataclass
class Enabled:
    """What `enable` yields: the policy in use and the cache of the latest `generate` call."""
    model: object
    policy: Policy
    placement: Placement | None = None
    cache: InfiniGenCache | None = None

    def new_cache(self, max_len: int | None = None) -> InfiniGenCache:
        """A fresh cache for a manual `model(..., cache=cache)` loop (`past_key_values=` before 5.24);
        each cache is one request (the policy object is shared, its state is per cache)."""
        self.cache = InfiniGenCache(self.model, self.policy, max_len, self.placement)
        return self.cache


def _max_len(hf_model, args, kwargs) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    prompt = ids.shape[1] if ids is not None else 0
    gc = kwargs.get("generation_config") or hf_model.generation_config
    new = kwargs.get("max_new_tokens", gc.max_new_tokens)
    if new is None:
        new = kwargs.get("max_length", gc.max_length) - prompt
    return prompt + max(int(new), 1) + 1


@contextlib.contextmanager
def enable(hf_model, policy: Policy | str | None = None, tokenizer=None, placement: Placement | None = None,
           **knobs):
    """Within the block, `hf_model.generate()` (and `hf_model(..., cache=ig.new_cache(n))`)
    attend through our runtime with `policy` (a Policy, or a registry name plus knobs; an unknown knob
    is an error), its KV pool placed by `placement`. What the policy needs from the model is prepared
    first (`Policy.prepare`; InfiniGen: skew matrices from the cache of `infinigen skew`, or, with
    `tokenizer`, calibrated once on a bundled novel and cached)."""
    rt = runtime_for(hf_model)
    cfg = rt.cfg
    if isinstance(policy, str) or policy is None:
        policy = make_policy(policy or "full", **knobs)
    elif knobs:
        raise UserError(f"enable: knobs {', '.join(knobs)} given with a policy object (set them on the policy)")
    policy = policy.prepare(rt, tokenizer)
    register()
    handle = Enabled(hf_model, policy, placement)
    previous = hf_model.config._attn_implementation
    hooks = _Hooks(hf_model, cfg)
    original_generate = hf_model.generate
    cache_kwarg = _cache_kwarg(hf_model)
    had_own_generate = "generate" in vars(hf_model)

    @functools.wraps(original_generate)
    def generate(*args, **kwargs):
        if _cache_from(kwargs) is None:
            if kwargs.get("num_beams", 1) > 1 or kwargs.get("num_return_sequences", 1) > 1:
                raise NotImplementedError("infinigen.hf: beam search and num_return_sequences > 1 are not supported")
            kwargs[cache_kwarg] = handle.new_cache(_max_len(hf_model, args, kwargs))
        return original_generate(*args, **kwargs)

    try:
        hf_model.set_attn_implementation(ATTN_NAME)
        if hf_model.config._attn_implementation != ATTN_NAME:
            raise UserError(f"{type(hf_model).__name__} does not accept a custom attention function")
        hf_model.generate = generate
        yield handle
    finally:
        hooks.remove()
        if had_own_generate:
            hf_model.generate = original_generate
        else:
            vars(hf_model).pop("generate", None)
        hf_model.set_attn_implementation(previous)


__all__ = ["enable", "InfiniGenCache", "Enabled", "register", "runtime_for", "infinigen_attention"]
