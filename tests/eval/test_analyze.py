"""The paper's analyses: each statistic against an independent computation, the report and the CLI."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infinigen.eval import analyze as an
from infinigen.policies import make_policy


def _orthogonal(model, seed=0):
    c = model.cfg
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(c.num_layers, c.num_kv_heads, c.head_dim, c.head_dim, generator=g))[0]


@pytest.fixture
def tiny(make_tiny):
    hf, model = make_tiny("llama", num_hidden_layers=3)
    ids = torch.randint(3, 250, (1, 96), generator=torch.Generator().manual_seed(0))
    return hf, model, ids


def test_block_similarity_matches_transformers_hidden_states(tiny):
    hf, model, ids = tiny
    rows = an.block_similarity(model, ids)
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states  # [embeddings, layer 0 out, ...] = block inputs
    assert [r["layer"] for r in rows] == [1, 2]
    for r in rows:
        i = r["layer"]
        ref = F.cosine_similarity(hs[i][0], hs[i - 1][0], dim=-1).mean().item()
        assert r["tblock_in"] == pytest.approx(ref, abs=1e-5)
        assert -1 <= r["attn_out"] <= 1 and -1 <= r["ffn_out"] <= 1


def test_prompt_statistics_match_eager_attention(tiny):
    hf, model, ids = tiny
    stats = an.prompt_statistics(model, ids, alphas=(1.0, 4.0), mass=0.9)
    with torch.no_grad():
        attn = hf(ids, output_attentions=True).attentions  # eager: [1, H, T, T] softmax weights
    for layer in range(model.cfg.num_layers):
        p = attn[layer][0]  # [H, T, T]
        cum = p.sort(-1, descending=True).values.cumsum(-1)
        need = (cum < 0.9).sum(-1) + 1
        got = stats.keys_for_mass[layer]
        assert (got - need).abs().max() <= 1  # rounding at the 0.9 boundary
        assert (got == need).float().mean() > 0.98
        logp = p.clamp_min(1e-30).log()  # scores up to a per-row constant
        above = (logp > logp.amax(-1, keepdim=True) - 4.0).sum(-1)
        assert (stats.above[layer][1] - above).abs().max() <= 1
        assert (stats.above[layer][0] <= stats.above[layer][1]).all()


def test_attention_probe(tiny):
    _, model, ids = tiny
    sims = an.attention_similarity(model, ids, {
        "full": make_policy("full"), "oracle-all": make_policy("oracle", tokens=10 ** 6),
        "streaming": make_policy("streaming", sinks=1, window=4),
        "infinigen": make_policy("infinigen", dense_layers=(0, 1), skew=False, alpha=0.5)}, prefill=32)
    rows = ids.shape[1] - 32
    for name in ("full", "oracle-all"):
        assert sims[name].shape == (3, rows)
        torch.testing.assert_close(sims[name], torch.ones(3, rows))
    s = sims["streaming"]
    assert (s <= 1 + 1e-6).all() and s.mean() < 0.99
    assert torch.allclose(sims["infinigen"][:2], torch.ones(2, rows)) and sims["infinigen"][2].mean() < 1


def test_run_writes_every_figure(tiny, tmp_path):
    _, model, ids = tiny
    st = an.Settings(tokens=96, prefill=32, alphas=(1, 4), ratios=(0.25, 1.0), count_alphas=(2, 5),
                     knobs={"preset": "paper"}, matrices=_orthogonal(model))
    ticks = []
    report = an.run(model, None, ids, tmp_path, an.ANALYSES, st, "tiny", "random", progress=lambda n=1: ticks.append(n))
    assert sum(ticks) == an.steps(an.ANALYSES, st)
    for png in ("table1_block_similarity", "fig3_attention_similarity", "fig5_keys_for_90pct", "tokens_above_alpha",
                "fig17_sensitivity", "fig13_skewing"):
        assert (tmp_path / f"{png}.png").read_bytes()[:4] == b"\x89PNG", png
        assert f"({png}.png)" in report
    for heading in ("Table 1", "Figure 3", "Figure 5", "Figure 17", "Figure 13", "alpha of the maximum"):
        assert heading in report
    assert (tmp_path / "analyze.md").read_text() == report
    # an unlimited alpha with every column reads all tokens: the full-cache perplexity (exactness)
    full = an._ppl(model, None, ids, make_policy("full"), 32).perplexity
    pt = an.sweep(model, None, ids, 32, {"dense_layers": (), "skew": False, "max_fetch_ratio": 1.0}, "alpha", [1e9],
                  "alpha")[0]
    assert pt.ppl == pytest.approx(full, rel=1e-4) and pt.kv == pytest.approx(1.0)


def test_cli_analyze(tiny_checkpoint, tmp_path, capsys):
    from infinigen.cli import main
    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 40)
    rc = main(["analyze", "--model", str(tiny_checkpoint), "--text", str(text), "--tokens", "64", "--prefill", "16",
               "--only", "table1,fig5,alpha,fig3", "--knob", "skew=false", "--out", str(tmp_path / "out")])
    assert rc == 0
    assert "Table 1" in capsys.readouterr().out
    assert (tmp_path / "out" / "fig3_attention_similarity.png").exists()
    assert main(["analyze", "--only", "fig99"]) == 2
    assert main(["analyze", "--model", str(tiny_checkpoint), "--text", str(text),
                 "--tokens", "64", "--prefill", "64"]) == 2
    assert main(["analyze", "--model", str(tiny_checkpoint), "--text", str(text), "--knob", "nope=1"]) == 2


@pytest.mark.integration
def test_default_model_table1(default_model):
    """The paper's observation holds on the default model: a block's input is far closer to the previous
    block's input than to the previous attention or FFN output."""
    model, tok = default_model
    from infinigen.eval.ppl import load_text
    ids = torch.tensor([tok(load_text("prideprejudice")[:6000], add_special_tokens=False)["input_ids"][:256]])
    rows = an.block_similarity(model, ids)
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("tblock_in", "attn_out", "ffn_out")}
    assert (mean["tblock_in"] > 0.8 and mean["tblock_in"] > mean["attn_out"] + 0.3
            and mean["tblock_in"] > mean["ffn_out"] + 0.3)
