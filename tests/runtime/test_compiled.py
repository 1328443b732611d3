"""The compiled decoding step (`infinigen.compiled`): the same logits as the eager step for every family
and policy, one compiled kernel per part for every layer, padded batches, several sessions in one step,
and the eager fallback when compiling fails (one warning, the same tokens)."""
from __future__ import annotations

import warnings

import pytest
import torch

from infinigen import compiled, runtime
from infinigen.placement import Placement
from infinigen.policies import make_policy
from support.models import build_gemma
from support.speculation import random_skew

P, T = 10, 22
SELECTED_AT_MOST = 0.4  # InfiniGen's share of the KV read on its selecting layer here


pytestmark = pytest.mark.usefixtures("private_inductor_cache")


def _tokens(model, b, seed=1):
    return torch.randint(3, model.cfg.vocab_size, (b, T), generator=torch.Generator().manual_seed(seed))


def _policy(name, model):
    if name == "infinigen":  # a floor of 2 tokens and a cap of 30%: layer 1 reads a minority (SELECTED_AT_MOST)
        return make_policy("infinigen", alpha=1.0, dense_layers=(0,), min_fetch=2,
                           max_fetch_ratio=0.3).with_skew(random_skew(model))
    if name == "h2o":
        return make_policy("h2o", heavy_ratio=0.2, recent_ratio=0.2)
    return make_policy(name)


def _run(model, policy, tokens, step_parts=None, kv_offload="none", listeners=(), sessions=None):
    """Teacher-fed decoding (the given tokens as each step's input): the logits of every step (the session is
    appended to `sessions` when given)."""
    model.step_parts = step_parts
    try:
        sess = Placement(kv_offload=kv_offload).new_session(model, tokens.shape[0], T, policy, listeners=listeners)
        if sessions is not None:
            sessions.append(sess)
        out = [runtime.prefill(model, tokens[:, :P], sess)]
        for t in range(P, T - 1):
            out.append(runtime.decode(model, tokens[:, t], sess))
        return torch.stack(out, 1)
    finally:
        model.step_parts = None


def _models():
    from support.models import build_tiny
    return {
        "llama": build_tiny("llama", attention_bias=True)[1],
        "gemma3": build_gemma()[1],
        "opt-postnorm": build_tiny("opt", do_layer_norm_before=False, word_embed_proj_dim=32)[1],
    }


MODELS = {}


def _model(kind):
    if not MODELS:
        MODELS.update(_models())
    return MODELS[kind]


@pytest.mark.parametrize("kind,policy,tier", [("llama", "full", "none"), ("llama", "infinigen", "none"),
                                              ("llama", "h2o", "none"), ("llama", "infinigen", "cpu"),
                                              ("gemma3", "full", "none"), ("opt-postnorm", "full", "none")])
def test_compiled_step_equals_eager(kind, policy, tier):
    model = _model(kind)
    tokens = _tokens(model, 2)
    sessions = []
    eager = _run(model, _policy(policy, model), tokens, kv_offload=tier, sessions=sessions)
    parts = compiled.StepParts()
    fast = _run(model, _policy(policy, model), tokens, parts, kv_offload=tier, sessions=sessions)
    assert parts.failed is None and parts.compiled == 3  # enter, between, leave: one kernel each for every layer
    torch.testing.assert_close(fast, eager, atol=2e-5, rtol=2e-5)
    assert torch.equal(fast.argmax(-1), eager.argmax(-1))
    if policy == "infinigen":  # the selection matters: the selecting layer reads a minority, the same in both
        shares = [sess.stats.per_layer()[1] for sess in sessions]
        assert shares[0] < SELECTED_AT_MOST and shares[1] == pytest.approx(shares[0])


def test_a_batch_is_padded_to_a_power_of_two():
    model = _model("llama")
    tokens = _tokens(model, 3, seed=2)
    parts = compiled.StepParts()
    fast = _run(model, _policy("full", model), tokens, parts)
    torch.testing.assert_close(fast, _run(model, _policy("full", model), tokens), atol=2e-5, rtol=2e-5)
    assert {key[-1][0][0] for key in parts._parts} == {4}  # 3 rows ran in the kernels compiled for 4


def test_several_sessions_in_one_compiled_step_equal_each_alone():
    model = _model("llama")
    a, b = _tokens(model, 1, seed=3), _tokens(model, 2, seed=4)
    alone = [_run(model, _policy("full", model), x) for x in (a, b)]
    model.step_parts = compiled.StepParts()
    try:
        sa, sb = (Placement().new_session(model, x.shape[0], T, _policy("full", model)) for x in (a, b))
        out = [[runtime.prefill(model, a[:, :P], sa)], [runtime.prefill(model, b[:, :P], sb)]]
        for t in range(P, T - 1):
            logits = runtime.decode(model, torch.cat([a[:, t], b[:, t]]), [sa, sb])
            out[0].append(logits[:1])
            out[1].append(logits[1:])
    finally:
        model.step_parts = None
    for got, want in zip(out, alone):
        torch.testing.assert_close(torch.stack(got, 1), want, atol=2e-5, rtol=2e-5)


class _Hidden(runtime.Listener):
    """Records the hidden-state events of decoding steps: (layer, point, tensor)."""

    def __init__(self):
        self.events = []

    def on_hidden(self, layer, point, x, session):
        self.events.append((layer, point, x.detach().clone()))


# batch 2: the whole step (each layer's attention compiled); batch 3: the dense parts between eager attentions
@pytest.mark.parametrize("failing,batch", [("enter", 3), ("between", 3), ("leave", 3),
                                           ("enter", 2), ("attend_between", 2), ("attend_leave", 2)])
def test_a_failed_compile_warns_once_and_decodes_eagerly(monkeypatch, failing, batch):
    model = _model("llama")
    tokens = _tokens(model, batch, seed=5)
    eager_heard, heard = _Hidden(), _Hidden()
    eager = _run(model, _policy("full", model), tokens, listeners=[eager_heard])
    parts = compiled.StepParts()
    calls = []
    original = parts._part

    def part(name, blocks, tensors, *scale):
        calls.append(name)
        if name == failing:
            raise RuntimeError("C++ compile error: no compiler\nmore lines")
        return original(name, blocks, tensors, *scale)

    monkeypatch.setattr(parts, "_part", part)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fast = _run(model, _policy("full", model), tokens, parts, listeners=[heard])
    ours = [w for w in seen if "torch.compile failed" in str(w.message)]
    assert len(ours) == 1 and "\n" not in str(ours[0].message) and "no compiler" in str(ours[0].message)
    assert parts.failed and calls.count(failing) == 1  # never tried again
    torch.testing.assert_close(fast, eager, atol=2e-5, rtol=2e-5)
    # every hidden-state event a policy may speculate from, in eager order, in the step that failed too
    assert [e[:2] for e in heard.events] == [e[:2] for e in eager_heard.events]
    for (_, _, got), (_, _, want) in zip(heard.events, eager_heard.events):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_blocks_with_hooks_stay_eager():
    model = _model("llama")
    handle = model.layers[1].mlp.register_forward_hook(lambda *a: None)
    try:
        assert compiled.enable(model, "on") is None and model.step_parts is None
    finally:
        handle.remove()
    assert compiled.enable(model, "on") is not None
    compiled.disable(model)


def test_modes():
    assert compiled.resolve("off", "cpu", True) == "off"
    assert compiled.resolve("auto", "cpu", False) is not None  # a short generation: eager
    assert compiled.resolve("auto", "cuda", True) is not None  # CUDA only on request
    assert compiled.resolve("on", "cpu", False) == compiled.available()
    assert compiled.resolve("auto", "cpu", True) == compiled.available()
    with pytest.raises(ValueError, match="compile must be one of"):
        compiled.resolve("fast", "cpu", True)


@pytest.mark.parametrize("cpp_fails", [False, True])
def test_the_cpp_wrapper_computes_the_eager_step_and_falls_back_to_the_python_wrapper(monkeypatch, cpp_fails):
    """`StepParts(cpp_wrapper=True)`: every part's wrapper generated as C++ (the whole step's attending parts too:
    their slot reaches the C++ wrapper as a tensor's size) gives the eager logits; where the C++ wrapper fails to
    compile, the part gets Inductor's Python wrapper, the same logits, no eager fallback and no warning."""
    model = _model("llama")
    tokens = _tokens(model, 2, seed=6)
    eager = _run(model, _policy("full", model), tokens)
    if cpp_fails:
        original = torch._inductor.compile

        def compile_without_cpp(graph, example, options=None):
            if options and options.get("cpp_wrapper"):
                raise RuntimeError("C++ wrapper: compile error\nmore lines")
            return original(graph, example, options)

        monkeypatch.setattr(torch._inductor, "compile", compile_without_cpp)
    parts = compiled.StepParts(cpp_wrapper=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fast = _run(model, _policy("full", model), tokens, parts)
    assert parts.failed is None and not [w for w in seen if "torch.compile failed" in str(w.message)]
    wrapper = "python" if cpp_fails else "cpp"
    assert parts.wrappers == dict.fromkeys(("enter", "attend_between", "attend_leave"), wrapper)
    assert (parts.cpp_failed is not None and "compile error" in parts.cpp_failed) == cpp_fails
    torch.testing.assert_close(fast, eager, atol=2e-5, rtol=2e-5)
    assert torch.equal(fast.argmax(-1), eager.argmax(-1))


def test_one_step_parts_serves_batches_of_other_layouts_with_their_own_kernels():
    """A part found for one input layout (its key and its compiled kernel remembered per layer) is not called with
    another: a later session of another batch size gets kernels compiled for its rows, and the eager logits."""
    model = _model("llama")
    parts = compiled.StepParts()
    for batch in (1, 2):
        tokens = _tokens(model, batch, seed=7)
        fast = _run(model, _policy("full", model), tokens, parts)
        assert parts.failed is None
        torch.testing.assert_close(fast, _run(model, _policy("full", model), tokens), atol=2e-5, rtol=2e-5)
    assert parts.compiled == 6  # enter, attend_between, attend_leave for 1 row, and again for 2


def _record_lookups(parts, monkeypatch) -> list:
    """The names of the parts `parts` looks up by their inputs (`_resolve`), appended as it does."""
    looked_up = []
    original = parts._resolve

    def resolve(name, blocks, tensors, *scale):
        looked_up.append(name)
        return original(name, blocks, tensors, *scale)

    monkeypatch.setattr(parts, "_resolve", resolve)
    return looked_up


def test_later_whole_steps_make_the_calls_the_first_found_without_finding_them_again(monkeypatch):
    """A whole step finds each layer's part by its inputs' layouts once; the steps after it, alike (the same store,
    layer 0's inputs of the same layouts), call the parts it found (`_WholePlan`) without looking them up, and give
    the eager logits. A session of another batch on the same StepParts finds its own parts (and its logits)."""
    model = _model("llama")
    parts = compiled.StepParts()
    looked_up = _record_lookups(parts, monkeypatch)
    layers = len(model.layers)
    for batch in (2, 1):
        tokens = _tokens(model, batch, seed=8)
        looked_up.clear()
        fast = _run(model, _policy("full", model), tokens, parts)
        assert parts.failed is None
        attending = [name for name in looked_up if name != "enter"]  # each step's enter part is looked up
        assert attending == ["attend_between"] * (layers - 1) + ["attend_leave"]  # in the first step only
        torch.testing.assert_close(fast, _run(model, _policy("full", model), tokens), atol=2e-5, rtol=2e-5)


def test_sessions_taking_turns_keep_their_whole_step_calls(monkeypatch):
    """Two sessions decoding in turns on one StepParts (the crossing's measurement alternates the full cache and the
    policy step by step) each keep their whole step's calls: after each one's first step no attending part is
    looked up again, and each gives its own eager logits."""
    model = _model("llama")
    parts = compiled.StepParts()
    looked_up = _record_lookups(parts, monkeypatch)
    tokens = [_tokens(model, 1, seed=10), _tokens(model, 1, seed=11)]
    model.step_parts = parts
    try:
        sessions = [Placement().new_session(model, 1, T, _policy("full", model)) for _ in tokens]
        for sess, tok in zip(sessions, tokens):
            runtime.prefill(model, tok[:, :P], sess)
        fast = [[], []]
        for t in range(P, T - 1):
            if t == P + 1:
                looked_up.clear()  # each session's first step found its parts
            for i, (sess, tok) in enumerate(zip(sessions, tokens)):
                fast[i].append(runtime.decode(model, tok[:, t], sess))
    finally:
        model.step_parts = None
    assert parts.failed is None
    assert [name for name in looked_up if name != "enter"] == []
    for i, tok in enumerate(tokens):
        eager = _run(model, _policy("full", model), tok)[:, 1:]
        torch.testing.assert_close(torch.stack(fast[i], 1), eager, atol=2e-5, rtol=2e-5)


def test_a_block_whose_weight_has_other_strides_gets_its_own_part():
    """The compiled code checks no input's layout (`compiled._OPTIONS`): a layer whose weight has other strides
    than the layer before's (here one norm weight a strided view) is another structure, compiled for its own
    layout, and the step gives the eager logits."""
    from support.models import build_tiny
    model = build_tiny("llama", num_hidden_layers=3)[1]  # layer 2's part is layer 1's unless the strides tell
    tokens = _tokens(model, 2, seed=9)
    eager = _run(model, _policy("full", model), tokens)
    norm = model.layers[2].attn_norm
    before = norm.weight
    strided = torch.zeros(2 * before.numel(), dtype=before.dtype)[::2]
    strided.copy_(before.detach().flip(0))  # other values too, so a part compiled for layer 0's layout shows
    try:
        norm.weight = torch.nn.Parameter(strided, requires_grad=False)
        eager_strided = _run(model, _policy("full", model), tokens)
        parts = compiled.StepParts()
        fast = _run(model, _policy("full", model), tokens, parts)
    finally:
        norm.weight = before
    assert parts.failed is None
    assert not torch.allclose(eager_strided, eager)
    torch.testing.assert_close(fast, eager_strided, atol=2e-5, rtol=2e-5)
