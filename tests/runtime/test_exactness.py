"""The runtime computes what `transformers` computes, with the same weights.

Prefill logits at every position and the logits of every decode step are compared with the reference
implementation (float32, its own KV cache) to max abs error <= 1e-4, on the `device` fixture's device (CPU by
default; INFINIGEN_TEST_DEVICE=cuda: both models on the GPU). Then generation-level facts:
a left-padded batch of mixed-length prompts gives each prompt's tokens as if it ran alone; sampling
with a seed is reproducible; top-k 1 is greedy; EOS ends a row and only that row.
"""
from __future__ import annotations

import pytest
import torch

from infinigen import runtime
from infinigen.generate import Sampling, generate_ids
from infinigen.placement import Placement

TOL = 1e-4


def assert_matches_transformers(hf, ours, prompt: torch.Tensor, steps: torch.Tensor, device="cpu") -> float:
    """Prefill `prompt` [B, P] and decode the tokens `steps` [B, N] one at a time in both
    implementations (both on `device`); every logit must agree. Returns the largest error seen."""
    hf, ours, prompt, steps = hf.to(device), ours.to(device), prompt.to(device), steps.to(device)
    b, p = prompt.shape
    sess = Placement().new_session(ours, b, p + steps.shape[1])
    with torch.no_grad():
        ref = hf(prompt, use_cache=True)
    got = runtime.prefill(ours, prompt, sess, all_logits=True)
    worst = (got - ref.logits).abs().max().item()
    assert worst <= TOL, f"prefill logits differ by {worst}"
    cache = ref.past_key_values
    for i in range(steps.shape[1]):
        with torch.no_grad():
            ref = hf(steps[:, i:i + 1], past_key_values=cache, use_cache=True)
        cache = ref.past_key_values
        got = runtime.decode(ours, steps[:, i], sess)
        err = (got - ref.logits[:, -1]).abs().max().item()
        assert err <= TOL, f"decode step {i} logits differ by {err}"
        worst = max(worst, err)
    return worst


def random_tokens(vocab: int, *shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


# ---- logits against transformers --------------------------------------------------------------------
def test_llama_gqa_matches_transformers(tiny_llama, device):
    hf, ours = tiny_llama
    assert ours.cfg.num_heads == 8 and ours.cfg.num_kv_heads == 2
    assert_matches_transformers(hf, ours, random_tokens(256, 2, 17), random_tokens(256, 2, 8, seed=2), device)


@pytest.mark.parametrize("kind,overrides", [
    ("qwen2", {}),                                              # q/k/v bias, no o bias
    ("mistral", {"sliding_window": 6}),                         # window shorter than the sequence
    ("opt", {}),                                                # pre-norm, learned positions
    ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),  # OPT-350m: post-norm, project in/out
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 8}),   # plain multi-head, tied head
], ids=["qwen2-bias", "mistral-window", "opt-prenorm", "opt-postnorm-proj", "llama-mha-tied"])
def test_family_matches_transformers(make_tiny, kind, overrides, device):
    hf, ours = make_tiny(kind, **overrides)
    if kind == "qwen2":
        assert ours.cfg.qkv_bias and not ours.cfg.o_bias
    if kind == "opt" and overrides:
        assert not ours.cfg.pre_norm and ours.project_in is not None
    assert_matches_transformers(hf, ours, random_tokens(256, 2, 13), random_tokens(256, 2, 8, seed=2), device)


def test_tiny_opt_fixture_matches_transformers(tiny_opt, device):
    hf, ours = tiny_opt
    assert_matches_transformers(hf, ours, random_tokens(256, 1, 9), random_tokens(256, 1, 4, seed=2), device)


def test_teacher_forced_full_cache_matches_transformers(tiny_llama, device):
    hf, ours = tiny_llama
    hf, ours, tokens = hf.to(device), ours.to(device), random_tokens(256, 2, 24).to(device)
    with torch.no_grad():
        ref = hf(tokens).logits
    got = runtime.teacher_forced(ours, tokens, 10, Placement().new_session(ours, 2, 24))
    assert (got - ref).abs().max().item() <= TOL


@pytest.mark.integration
def test_default_model_matches_transformers(default_model, default_hf_model):
    ours, tok = default_model
    text = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
            "must be in want of a wife. However little known the feelings or views of such a man may be")
    prompt = torch.tensor([tok(text)["input_ids"]])
    steps = torch.tensor([tok(" on his first entering a neighbourhood, this truth is")["input_ids"]])
    assert_matches_transformers(default_hf_model, ours, prompt, steps)


# ---- batching ------------------------------------------------------------------------------------------
def assert_batch_equals_alone(model, prompts: list[list[int]], new_tokens: int, pad_id: int = 0, eos=frozenset()):
    """Left-padded batch vs each prompt alone: same last-position logits and same greedy tokens."""
    from infinigen.generate import left_pad
    tokens, mask = left_pad(prompts, pad_id, model.device)
    sess = Placement().new_session(model, len(prompts), tokens.shape[1])
    batch_logits = runtime.prefill(model, tokens, sess, pad_mask=mask)
    for i, p in enumerate(prompts):
        one = torch.tensor([p], device=model.device)
        alone = runtime.prefill(model, one, Placement().new_session(model, 1, len(p)))
        assert (batch_logits[i] - alone[0]).abs().max().item() <= TOL
    batch = generate_ids(model, prompts, new_tokens, eos=eos, pad_id=pad_id)
    for i, p in enumerate(prompts):
        assert batch.tokens[i] == generate_ids(model, [p], new_tokens, eos=eos, pad_id=pad_id).tokens[0], f"row {i}"


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}), ("llama", {"attention_bias": True}), ("mistral", {"sliding_window": 6}),
    ("opt", {}), ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),
], ids=["llama", "llama-bias", "mistral-window", "opt", "opt-postnorm"])
def test_mixed_length_batch_equals_each_prompt_alone(make_tiny, kind, overrides, device):
    ours = make_tiny(kind, **overrides)[1].to(device)
    prompts = [random_tokens(256, n, seed=n).tolist() for n in (5, 14, 1, 9)]
    assert_batch_equals_alone(ours, prompts, new_tokens=10)


@pytest.mark.integration
def test_default_model_mixed_length_batch(default_model):
    ours, tok = default_model
    texts = ["What is the capital of France?", "Write one short sentence about the sea, please.",
             "List three prime numbers greater than ten, separated by commas."]
    from infinigen.generate import encode_prompts, stop_ids
    prompts = encode_prompts(tok, texts, chat=True)
    assert len({len(p) for p in prompts}) == 3
    assert_batch_equals_alone(ours, prompts, new_tokens=8, pad_id=tok.pad_token_id, eos=stop_ids(ours, tok))


# ---- sampling and stopping ----------------------------------------------------------------------------
PROMPTS = [list(range(10, 17)), list(range(40, 44))]


def test_sampling_with_a_seed_is_reproducible(tiny_llama, device):
    ours = tiny_llama[1].to(device)

    def s(seed):
        return Sampling(temperature=1.0, top_k=50, top_p=0.95, seed=seed)
    a = generate_ids(ours, PROMPTS, 16, s(7)).tokens
    assert a == generate_ids(ours, PROMPTS, 16, s(7)).tokens
    assert a != generate_ids(ours, PROMPTS, 16, s(8)).tokens
    assert a != generate_ids(ours, PROMPTS, 16).tokens  # it really samples


def test_top_k_one_is_greedy(tiny_opt, device):
    ours = tiny_opt[1].to(device)
    greedy = generate_ids(ours, PROMPTS, 12).tokens
    assert generate_ids(ours, PROMPTS, 12, Sampling(temperature=1.5, top_k=1, seed=3)).tokens == greedy


def test_tiny_top_p_is_greedy(tiny_opt, device):
    ours = tiny_opt[1].to(device)
    greedy = generate_ids(ours, PROMPTS, 12).tokens
    assert generate_ids(ours, PROMPTS, 12, Sampling(temperature=1.0, top_p=1e-6, seed=3)).tokens == greedy


def test_eos_stops_only_its_row(make_tiny, device):
    ours = make_tiny("llama")[1].to(device)
    full = generate_ids(ours, PROMPTS, 12).tokens
    eos = full[0][3]
    cut = full[0].index(eos)
    assert eos not in full[1], "pick prompts whose rows differ"
    g = generate_ids(ours, PROMPTS, 12, eos={eos})
    assert g.tokens[0] == full[0][:cut + 1]  # the EOS token is kept, nothing after it
    assert g.tokens[1] == full[1]  # the other row runs to max_new_tokens
    g = generate_ids(ours, [PROMPTS[0]], 12, eos={eos})
    assert g.tokens[0] == full[0][:cut + 1] and g.decode_steps == cut  # decoding stopped early


def test_max_new_tokens_is_respected(tiny_opt, device):
    ours = tiny_opt[1].to(device)
    g = generate_ids(ours, PROMPTS, 5)
    assert [len(t) for t in g.tokens] == [5, 5] and g.decode_steps == 4
