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
    for heading in ("Table 1", "Figure 3", "Figure 5", "Figure 17", "Figure 13", "alpha of the maximum", "Recall"):
        assert heading in report
    import json
    rec = json.loads((tmp_path / "recall.json").read_text())
    assert rec["tokens"] == 96 and {"full", "in_ram", "offloaded"} <= set(rec) and rec["in_ram"]["layers"]
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


# ---- recall: the selection against the true top entries ------------------------------------------------
def _in_ram():
    from infinigen.placement import Placement
    return {"in_ram": Placement()}


def test_recall_of_an_unlimited_selection_is_one_and_its_mass_is_the_attentions(tiny):
    """Every entry read: recall 1, both sets cover the past's whole attention, which matches transformers'
    eager weights (1 - each row's weight on its own token, averaged over the KV head's query heads), in fast
    memory and offloaded; the perplexity is the full cache's."""
    hf, model, ids = tiny
    pol = make_policy("infinigen", preset="paper", dense_layers=(), exact_first=True, skew=False, alpha=1e9,
                      max_fetch_ratio=1.0)
    pol = pol.prepare(model, None)
    rec = an.selection_recall(model, ids, pol, prefill=32)
    with torch.no_grad():
        attn = hf(ids, output_attentions=True).attentions
    c = model.cfg
    g = c.num_heads // c.num_kv_heads
    for form in ("in_ram", "offloaded"):
        r = rec[form]
        assert r["perplexity"] == pytest.approx(rec["full"]["perplexity"], rel=1e-4)
        assert [(x["layer"], x["kv_head"]) for x in r["layers"]] == [(i, j) for i in range(3) for j in range(2)]
        for x in r["layers"]:
            assert x["rows"] == ids.shape[1] - 32
            assert x["recall"] == pytest.approx(1.0) and x["read_share"] == pytest.approx(1.0)
            own = attn[x["layer"]][0, x["kv_head"] * g:(x["kv_head"] + 1) * g].diagonal(dim1=-2, dim2=-1)[:, 32:]
            past = (1 - own).mean().item()
            for k in ("mass_read", "mass_top", "mass_past"):
                assert x[k] == pytest.approx(past, abs=1e-5), k
        # every layer's sets cover the whole past: none is counted under the floor
        assert r["by_layer"]["covered"] == [0, 1, 2] and r["by_layer"]["under"] == []


def test_recall_finds_a_reversed_ranking(make_tiny):
    """One query head per KV head: the oracle's top set is the reference's own (recall 1); the same count
    ranked backwards (the least attended entries) has low recall and covers less mass."""
    from infinigen.policies.oracle import Oracle

    class Reversed(Oracle):
        def _choose(self, s, past, s_cur, n_past):
            return super()._choose(-s, past, s_cur, n_past)

    _, model = make_tiny("llama", num_hidden_layers=2, num_key_value_heads=8)
    ids = torch.randint(3, 250, (1, 128), generator=torch.Generator().manual_seed(1))
    best = an.selection_recall(model, ids, make_policy("oracle", ratio=0.25), 32, forms=_in_ram())["in_ram"]
    worst = an.selection_recall(model, ids, Reversed(ratio=0.25), 32, forms=_in_ram())["in_ram"]
    assert len(best["layers"]) == 2 * 8
    for b, w in zip(best["layers"], worst["layers"]):
        assert b["read_share"] == pytest.approx(w["read_share"]) and 0.2 < b["read_share"] < 0.26
        assert b["recall"] == pytest.approx(1.0)
        assert b["mass_read"] == pytest.approx(b["mass_top"])
        assert w["recall"] < 0.1 and w["mass_read"] < 0.5 * w["mass_top"]
    assert best["by_layer"]["under"] == [] and worst["by_layer"]["under"] == [0, 1]
    assert worst["by_layer"]["lowest"]["recall"] < 0.1


def test_recall_by_layer_pools_the_kv_heads_and_leaves_out_covered_layers():
    from infinigen.eval.recall import by_layer

    def row(layer, head, rows, recall, read, top, past=1.0):
        return {"layer": layer, "kv_head": head, "rows": rows, "recall": recall, "read_share": 0.2,
                "mass_read": read, "mass_top": top, "mass_past": past}
    rows = [row(0, 0, 30, 0.96, 0.8, 0.8), row(0, 1, 10, 0.76, 0.8, 0.8),  # pooled: (28.8 + 7.6) / 40 = 0.91
            row(1, 0, 10, 0.85, 0.7, 0.72), row(1, 1, 10, 0.87, 0.7, 0.72),  # 0.86: under
            row(2, 0, 10, 0.5, 0.995, 0.996), row(2, 1, 10, 0.6, 0.995, 0.996),  # both sets cover > 99%: left out
            row(3, 0, 10, 0.5, 0.5, 0.996, past=1.0)]  # only the top set covers it: counted
    out = by_layer(rows)
    assert [x["recall"] for x in out["layers"]] == pytest.approx([0.91, 0.86, 0.55, 0.5])
    assert out["under"] == [1, 3] and out["covered"] == [2]
    assert out["lowest"] == {"layer": 3, "recall": 0.5}
    assert by_layer([]) == {"layers": [], "lowest": None, "under": [], "covered": []}


def test_recall_forms_use_the_query_of_their_tier(tiny):
    """The default preset selects with each layer's own query in fast memory and speculates a layer ahead
    offloaded; with a cap both read about the same share and rank below the top set."""
    _, model, ids = tiny
    pol = make_policy("infinigen", calibrate=False, dense_below=0, skew=False, kv_budget=0.3, budget_growth=1.0)
    pol = pol.prepare(model, None)
    rec = an.selection_recall(model, ids, pol, prefill=32)
    assert rec["in_ram"]["query"] == "own" and rec["offloaded"]["query"] == "ahead"
    for form in ("in_ram", "offloaded"):
        m = rec[form]["mean"]
        assert 0 < m["recall"] < 1 and m["mass_read"] <= m["mass_top"] + 1e-6 and m["read_share"] < 0.6


def test_cli_recall_and_the_window_as_ppl_reads_it(tiny_checkpoint, tmp_path, monkeypatch):
    """`--only recall` writes recall.json beside analyze.md; the window is the one `infinigen ppl` reads: BOS
    first where the tokenizer starts every input with it, then tokens - 1 of the text."""
    import json

    import infinigen.eval.ppl as ppl
    from infinigen.cli import main
    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 40)
    out = tmp_path / "out"
    assert main(["analyze", "--model", str(tiny_checkpoint), "--text", str(text), "--tokens", "64", "--prefill", "16",
                 "--only", "recall", "--knob", "preset=default", "--knob", "calibrate=false", "--knob", "dense_below=0",
                 "--knob", "skew=false", "--out", str(out)]) == 0
    rec = json.loads((out / "recall.json").read_text())
    assert rec["tokens"] == 64 and rec["in_ram"]["layers"] and "Recall" in (out / "analyze.md").read_text()
    assert "lowest layer: recall" in (out / "analyze.md").read_text() and "under" in rec["in_ram"]["by_layer"]
    seen = []
    monkeypatch.setattr(an, "run", lambda model, tok, ids, *a, **k: seen.append((ids, tok)) or "")
    for bos in (None, 7):
        monkeypatch.setattr(ppl, "_leading_bos", lambda tok, bos=bos: bos)
        assert main(["analyze", "--model", str(tiny_checkpoint), "--text", str(text), "--tokens", "64",
                     "--prefill", "16", "--only", "table1", "--out", str(tmp_path / f"o{bos}")]) == 0
    (plain, tok), (with_bos, _) = seen
    body = tok(text.read_text(), add_special_tokens=False)["input_ids"]
    assert plain.shape == with_bos.shape == (1, 64)
    assert plain[0].tolist() == body[:64] and with_bos[0].tolist() == [7] + body[:63]
