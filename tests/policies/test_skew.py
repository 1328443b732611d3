"""Skewing (infinigen.skew): exact (dense logits unchanged), concentrating, cached as safetensors."""
from __future__ import annotations

import json

import pytest
import torch

from infinigen import runtime
from infinigen.errors import UserError
from infinigen.policies import make_policy
from infinigen.placement import Placement
from infinigen.skew import (Skew, column_share, compute_skew, find_cached_skew, load_or_compute_skew,
                            model_fingerprint, query_gram, resolve_text, skew_model)


def _ids(model, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (n,), generator=g)


def _unlimited(skew, **kw):
    return make_policy("infinigen", alpha=1e30, max_fetch_ratio=1.0, dense_layers=(), **kw).with_skew(skew)


def test_matrices_orthogonal_and_sorted(make_tiny):
    _, model = make_tiny("llama")
    s = compute_skew(model, _ids(model, 200))
    c = model.cfg
    assert s.matrices.shape == (c.num_layers, c.num_kv_heads, c.head_dim, c.head_dim)
    eye = torch.eye(c.head_dim).expand_as(s.matrices)
    torch.testing.assert_close(s.matrices.transpose(-1, -2) @ s.matrices, eye, atol=1e-5, rtol=0)
    assert (s.sigma2[..., :-1] >= s.sigma2[..., 1:] - 1e-3).all()  # columns ordered by singular value
    # A = V of the stacked group queries: the skewed columns' energies are the squared singular values
    gram, _ = query_gram(model, _ids(model, 200))
    skewed = torch.diagonal(s.matrices.double().transpose(-1, -2) @ gram @ s.matrices.double(), dim1=-2, dim2=-1)
    torch.testing.assert_close(skewed.float(), s.sigma2, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("kind", ["llama", "opt"])
def test_skew_leaves_dense_logits_unchanged(make_tiny, kind):
    """Skewed queries and keys with every entry read: the dense result (<= 1e-4, float32)."""
    _, model = make_tiny(kind)
    s = compute_skew(model, _ids(model, 200))
    tokens = _ids(model, 40, seed=1)[None]
    dense = runtime.teacher_forced(model, tokens, 12, Placement().new_session(model, 1, 40))
    for key_mode in ("partial", "int4"):
        pol = _unlimited(s, key_mode=key_mode)
        out = runtime.teacher_forced(model, tokens, 12, Placement().new_session(model, 1, 40, pol))
        assert (out - dense).abs().max() <= 1e-4
    # and the skewed scores equal the plain ones: (qA)(kA)^T = qk^T
    q = torch.randn(2, model.cfg.num_kv_heads, 5, model.cfg.head_dim)
    k = torch.randn(2, model.cfg.num_kv_heads, 7, model.cfg.head_dim)
    a = s.matrices[1][None]
    torch.testing.assert_close((q @ a) @ (k @ a).transpose(-1, -2), q @ k.transpose(-1, -2), atol=1e-4, rtol=1e-4)


def test_fold_into_opt_weights(make_tiny):
    """OPT: A folded into W_Q, W_K and biases per head; same logits, queries and keys come out skewed."""
    _, model = make_tiny("opt")
    s = compute_skew(model, _ids(model, 200))
    folded = skew_model(model, s)
    tokens = _ids(model, 30, seed=2)[None]
    a = runtime.prefill(model, tokens, Placement().new_session(model, 1, 30), all_logits=True)
    b = runtime.prefill(folded, tokens, Placement().new_session(folded, 1, 30), all_logits=True)
    assert (a - b).abs().max() <= 1e-4
    x = torch.randn(1, 6, model.cfg.hidden_size)
    pos = torch.arange(6)[None]
    q, k, _ = model.qkv(1, x, pos)
    qf, kf, _ = folded.qkv(1, x, pos)
    A = s.matrices[1][None, :, None]  # [1, H, 1, d, d]
    torch.testing.assert_close(qf, (q[:, :, :, None] @ A)[:, :, :, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kf, (k[:, :, :, None] @ A)[:, :, :, 0], atol=1e-5, rtol=1e-5)
    assert model.layers[1].attn.q_proj.bias is not None  # the fold covered the biases
    # the policy does not rotate a folded model again: same selections as rotating at run time
    toks = _ids(model, 40, seed=3)[None]
    runs = []
    for m, pol in ((model, make_policy("infinigen", dense_layers=(0,), alpha=1.0).with_skew(s)),
                   (folded, make_policy("infinigen", dense_layers=(0,), alpha=1.0))):
        sess = Placement().new_session(m, 1, 40, pol)
        runs.append((runtime.teacher_forced(m, toks, 10, sess), sess.stats.per_layer()))
    assert (runs[0][0] - runs[1][0]).abs().max() <= 1e-4 and runs[0][1] == pytest.approx(runs[1][1])
    with pytest.raises(ValueError):
        model_fingerprint(folded)


def test_fold_refuses_rope(make_tiny):
    _, model = make_tiny("llama")
    with pytest.raises(ValueError):
        skew_model(model, compute_skew(model, _ids(model, 50)))


def test_artifact_saved_reused_and_found(tiny_checkpoint, tiny_tokenizer, tmp_path, monkeypatch):
    from infinigen.loading import load
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    model, tok, _ = load(tiny_checkpoint, progress=False)
    text = tmp_path / "calib.txt"
    text.write_text("Emma Woodhouse, handsome, clever, and rich, with a comfortable home. " * 30)
    assert find_cached_skew(model) is None
    s1 = load_or_compute_skew(model, tok, str(text), tokens=100)
    assert s1.path.exists() and s1.path.suffix == ".safetensors" and s1.path.parent == tmp_path / "cache" / "skew"
    assert s1.meta["fingerprint"] == model_fingerprint(model) and s1.meta["calibration"] == str(text)
    assert int(s1.meta["tokens"]) == 100
    s2 = load_or_compute_skew(model, tok, str(text), tokens=100)
    assert s2.meta.get("reused") == "1" and torch.equal(s1.matrices, s2.matrices)
    s3 = load_or_compute_skew(model, tok, str(text), tokens=100, force=True)
    assert s3.meta.get("reused") is None
    torch.testing.assert_close(s3.matrices.abs(), s1.matrices.abs(), atol=1e-4, rtol=0)
    assert torch.equal(Skew.load(s1.path).matrices, s3.matrices)
    found = find_cached_skew(model)
    assert found is not None and torch.equal(found.matrices, s3.matrices)
    # a policy without matrices picks the cached artifact
    pol = make_policy("infinigen", dense_layers=(0,))
    sess = Placement().new_session(model, 1, 24, pol)
    runtime.teacher_forced(model, _ids(model, 24)[None], 8, sess)
    assert torch.equal(sess.state.A, found.matrices.double())
    # prepare() with a tokenizer calibrates what is missing (a fresh install), and caches it
    assert make_policy("infinigen", calib=str(text)).prepare(model, tok) is not None
    # another model: the fingerprint names the file, the weights' signature tells the changed copy apart:
    # nothing cached for it
    other, _, _ = load(tiny_checkpoint, progress=False)
    with torch.no_grad():
        other.layers[0].attn.q_proj.weight.mul_(1.5)
    assert find_cached_skew(other) is None
    with pytest.raises(UserError, match="skew"):
        sess = Placement().new_session(other, 1, 24, make_policy("infinigen", dense_layers=(0,)))
        runtime.teacher_forced(other, _ids(model, 24)[None], 8, sess)
    pol = pol.prepare(other, tok)  # the same policy object calibrates for the other model, on the default text
    assert find_cached_skew(other) is not None


def test_sparsity_recorded_saved_and_old_artifacts_load(tiny_checkpoint, tiny_tokenizer, tmp_path, monkeypatch):
    """The calibration records each layer's attention sparsity (the share of entries holding 90% of the
    mass, as computed from the dense attention), it survives a save and load; an artifact of format 1
    (no sparsity) still loads (uniform budgets) and `load_or_compute_skew` upgrades it."""
    from safetensors.torch import save_file

    from infinigen.loading import load
    from infinigen.policies.budgets import attention_sparsity
    from infinigen.skew import attention_rows_sparsity, skew_path
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    model, tok, _ = load(tiny_checkpoint, progress=False)
    text = tmp_path / "calib.txt"
    text.write_text("Catherine Morland, in her infancy, would not have been supposed a heroine. " * 30)
    s = load_or_compute_skew(model, tok, str(text), tokens=100)
    assert s.sparsity is not None and s.sparsity.shape == (model.cfg.num_layers,)
    assert bool(((s.sparsity > 0) & (s.sparsity <= 1)).all())
    assert torch.equal(Skew.load(s.path).sparsity, s.sparsity)
    # the sampled rows' sparsity is that of the full causal softmax
    q, k = torch.randn(1, 4, 40, 8), torch.randn(1, 2, 40, 8)
    sp = attention_rows_sparsity(q, k, 0.5, rows=200)  # every row of the later 3/4
    scores = (q.view(1, 2, 2, 40, 8) @ k[:, :, None].transpose(-1, -2)) * 0.5
    p = torch.softmax(scores.masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), float("-inf")), -1)
    torch.testing.assert_close(sp, attention_sparsity(p[:, :, :, 10:]))
    # format 1: no sparsity tensor
    old = tmp_path / "old.safetensors"
    save_file({"matrices": s.matrices, "sigma2": s.sigma2, "energy": s.energy}, str(old), metadata={"format": "1"})
    assert Skew.load(old).sparsity is None and torch.equal(Skew.load(old).matrices, s.matrices)
    path = skew_path(model, text, 100)
    path.write_bytes(old.read_bytes())
    again = load_or_compute_skew(model, tok, str(text), tokens=100)
    assert again.meta.get("reused") is None and again.sparsity is not None  # recomputed, with sparsity
    assert Skew.load(path).sparsity is not None


def test_corrupt_artifact_is_a_user_error(tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(UserError):
        Skew.load(bad)


def test_resolve_text(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("hello")
    assert resolve_text(str(f)) == f
    with pytest.raises(UserError):
        resolve_text(str(tmp_path / "missing.txt"))
    with pytest.raises(UserError):
        resolve_text("no-such-corpus")


def test_skew_cli(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    from infinigen.cli import main
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "t.txt"
    text.write_text("No one who had ever seen Catherine Morland in her infancy "
                    "would have supposed her born a heroine. " * 20)
    args = ["skew", "-m", str(tiny_checkpoint), "--calib", str(text), "--tokens", "120", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["reused"] is False and first["tokens"] == 120 and len(first["share_skewed"]) == 2
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["reused"] is True and second["path"] == first["path"]
    assert main(["skew", "-m", str(tiny_checkpoint), "--calib", str(text), "--tokens", "120"]) == 0
    assert "skewed" in capsys.readouterr().out
    assert main(["skew", "-m", str(tiny_checkpoint), "--calib", str(tmp_path / "nope.txt")]) == 2
    assert main(["skew", "-m", str(tiny_checkpoint), "--tokens", "0"]) == 2


# ---- the default model -------------------------------------------------------------------------------
@pytest.mark.integration
def test_default_model_skew(default_model, tmp_path, monkeypatch):
    """The shipped skew (Emma, 4096 tokens), on held-out text: dense logits unchanged; the top 30% of the
    skewed query columns hold clearly more squared norm."""
    from infinigen.skew import read_tokens
    model, tok = default_model
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    s = find_cached_skew(model)
    assert s.shipped and s.meta["fingerprint"] == model_fingerprint(model)
    held_out = read_tokens(tok, resolve_text("prideprejudice"), 512)
    gram, _ = query_gram(model, held_out)
    skewed, plain = column_share(gram, s.matrices), column_share(gram, None)
    print(f"\ntop 30% columns, share of squared norm (Pride and Prejudice, skew from Emma): "
          f"unskewed {plain.mean():.3f}, skewed {skewed.mean():.3f}")
    print("per layer unskewed:", [round(v, 3) for v in plain.tolist()])
    print("per layer skewed:  ", [round(v, 3) for v in skewed.tolist()])
    assert skewed.mean() > plain.mean() + 0.03
    assert (skewed > plain).float().mean() >= 0.9
    tokens = torch.tensor([held_out[:160]])
    dense = runtime.teacher_forced(model, tokens, 96, Placement().new_session(model, 1, 160))
    out = runtime.teacher_forced(model, tokens, 96, Placement().new_session(model, 1, 160, _unlimited(s)))
    assert (out - dense).abs().max() <= 1e-4


def test_one_calibration_per_model_file(tiny_checkpoint, tmp_path, monkeypatch):
    """The fingerprint names the model file, not its dtype or weight mode: float32, bfloat16 and int8 weights
    of one checkpoint find the one skew artifact that the float32 load made."""
    from infinigen.loading import load
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "calib.txt"
    text.write_text("Emma Woodhouse, handsome, clever, and rich, with a comfortable home. " * 30)
    f32, tok, _ = load(tiny_checkpoint, dtype="float32", weights="fp32", progress=False)
    bf16, _, _ = load(tiny_checkpoint, dtype="bfloat16", progress=False)
    int8, _, _ = load(tiny_checkpoint, dtype="float32", weights="int8", progress=False)
    assert model_fingerprint(f32) == model_fingerprint(bf16) == model_fingerprint(int8)
    made = load_or_compute_skew(f32, tok, str(text), tokens=100)
    assert made.meta["dtype"] == "float32" and made.meta["weights"] == "dense"
    for model in (bf16, int8):
        assert find_cached_skew(model).path == made.path
        again = load_or_compute_skew(model, tok, str(text), tokens=100)
        assert again.meta.get("reused") == "1" and torch.equal(again.matrices, made.matrices)
    assert [p.name for p in (tmp_path / "cache" / "skew").iterdir()] == [made.path.name]


def test_shipped_artifact_serves_only_its_model(tiny_checkpoint, make_tiny, tmp_path, monkeypatch):
    """An artifact in the package's data/calibration is found by the model's fingerprint with an empty cache,
    used without writing anything, and refused for another model, also when renamed to that model's
    fingerprint, and for the same file's model changed after loading."""
    import shutil

    from infinigen import skew as skew_module
    from infinigen.loading import load
    shipped = tmp_path / "shipped"
    monkeypatch.setattr(skew_module, "shipped_calibration_dir", lambda: shipped)
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "made"))
    text = tmp_path / "calib.txt"
    text.write_text("Emma Woodhouse, handsome, clever, and rich, with a comfortable home. " * 30)
    model, tok, _ = load(tiny_checkpoint, dtype="float32", weights="fp32", progress=False)
    made = load_or_compute_skew(model, tok, str(text), tokens=100)
    shipped.mkdir()
    shutil.copy(made.path, shipped / made.path.name)
    empty = tmp_path / "empty"
    monkeypatch.setenv("INFINIGEN_CACHE", str(empty))
    bf16, _, _ = load(tiny_checkpoint, dtype="bfloat16", progress=False)
    found = find_cached_skew(bf16)
    assert found.shipped and found.path == shipped / made.path.name
    again = load_or_compute_skew(bf16, tok, str(text), tokens=100)
    assert again.shipped and again.meta.get("reused") == "1" and not (empty / "skew").exists()
    _, other = make_tiny("llama")
    assert find_cached_skew(other) is None
    shutil.copy(made.path, shipped / made.path.name.replace(model_fingerprint(model), model_fingerprint(other)))
    assert find_cached_skew(other) is None
    with torch.no_grad():
        bf16.layers[0].attn.q_proj.weight.mul_(1.5)
    assert find_cached_skew(bf16) is None


def test_interrupted_save_leaves_no_file(make_tiny, tmp_path, monkeypatch):
    """Ctrl-C while an artifact is written (its bytes out, not yet renamed into place): no file stays."""
    import safetensors.torch
    _, model = make_tiny("llama")
    s = compute_skew(model, _ids(model, 50))
    write = safetensors.torch.save_file

    def interrupted(tensors, filename, metadata=None):
        write(tensors, filename, metadata=metadata)
        raise KeyboardInterrupt
    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.save(tmp_path / "skew" / "x.safetensors")
    assert list((tmp_path / "skew").iterdir()) == []


def test_transformers_model_of_the_same_folder_shares_the_calibration(tiny_checkpoint):
    """`infinigen.hf` on a transformers model loaded from a folder finds the calibration of that folder."""
    from transformers import AutoModelForCausalLM

    from infinigen.hf import runtime_for
    from infinigen.loading import load
    ours, _, _ = load(tiny_checkpoint, dtype="float32", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    assert model_fingerprint(runtime_for(hf)) == model_fingerprint(ours)
