"""A policy's per-request state lives on the session (one policy object serves any number of sessions), and
`prepare` gets what a policy needs from the model (InfiniGen calibrates its skew on a fresh install)."""
from __future__ import annotations

import torch

from infinigen import runtime
from infinigen.placement import Placement
from infinigen.policies import make_policy


def test_one_policy_object_serves_sessions_side_by_side(make_tiny):
    """State lives on the session: interleaving two sessions of one policy changes nothing."""
    _, model = make_tiny("llama")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 256, (1, 30), generator=g), torch.randint(0, 256, (1, 30), generator=g)
    shared = make_policy("h2o", heavy=4, recent=3)

    def alone(tokens):
        s = Placement().new_session(model, 1, 30, make_policy("h2o", heavy=4, recent=3))
        out = [runtime.prefill(model, tokens[:, :20], s)]
        out += [runtime.decode(model, tokens[:, t], s) for t in range(20, 29)]
        return torch.stack(out)

    sa, sb = Placement().new_session(model, 1, 30, shared), Placement().new_session(model, 1, 30, shared)
    out_a, out_b = [runtime.prefill(model, a[:, :20], sa)], [runtime.prefill(model, b[:, :20], sb)]
    for t in range(20, 29):
        out_a.append(runtime.decode(model, a[:, t], sa))
        out_b.append(runtime.decode(model, b[:, t], sb))
    assert torch.equal(torch.stack(out_a), alone(a)) and torch.equal(torch.stack(out_b), alone(b))


def test_infinigen_generates_on_a_fresh_install(tiny_checkpoint, tmp_path, monkeypatch):
    """No `infinigen skew` beforehand: `prepare` calibrates once and caches the artifact."""
    from infinigen import generate, load
    from infinigen.skew import find_cached_skew
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    model, tok, _ = load(tiny_checkpoint, progress=False)
    assert find_cached_skew(model) is None
    g = generate(model, tok, ["It is a truth"], max_new_tokens=4, policy=make_policy("infinigen"))
    assert len(g.tokens[0]) == 4 and find_cached_skew(model) is not None


def test_cli_generate_infinigen_on_a_fresh_install(tiny_checkpoint, tmp_path, monkeypatch, capfd):
    from infinigen.cli import main
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    code = main(["generate", "--model", str(tiny_checkpoint), "-p", "It is a truth", "-n", "4",
                 "--policy", "infinigen"])
    assert code == 0, capfd.readouterr().err
