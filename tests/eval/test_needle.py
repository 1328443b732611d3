"""Needle retrieval: prompt construction, scoring, generation equal to the runtime's, CLI outputs."""
from __future__ import annotations

import json

import pytest

from infinigen import UserError, load
from infinigen.eval import needle as nd
from infinigen.eval.policyset import parse_policies
from infinigen.generate import generate_ids, stop_ids


@pytest.fixture
def long_checkpoint(make_tiny, tiny_tokenizer, tmp_path):
    """A tiny random Llama with the tiny tokenizer and a 2048-token context (the needle prompts need room)."""
    hf, _ = make_tiny("llama", vocab_size=len(tiny_tokenizer), max_position_embeddings=2048,
                      bos_token_id=tiny_tokenizer.bos_token_id, eos_token_id=tiny_tokenizer.eos_token_id,
                      pad_token_id=tiny_tokenizer.pad_token_id)
    hf.save_pretrained(tmp_path / "ckpt")
    tiny_tokenizer.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.fixture
def tiny(long_checkpoint):
    model, tok, _ = load(str(long_checkpoint), progress=False)
    return model, tok


@pytest.mark.parametrize("chat", [True, False])
def test_cases_have_exact_length_and_needle(tiny, chat):
    _, tok = tiny
    cases = nd.make_cases(tok, "passkey", [300, 400], [0.0, 0.5, 1.0], chat=chat, seed=3)
    assert len(cases) == 6
    keys = set()
    for c in cases:
        assert abs(len(c.ids) - c.length) <= 1  # key digits may tokenize one token differently
        text = tok.decode(c.ids)
        assert f"The pass key is {c.answer}." in text and text.rstrip().endswith("The pass key is")
        keys.add(c.answer)
        needle = tok.decode(c.ids[c.needle_at:c.needle_at + 12])
        assert "pass key" in needle
    assert len(keys) > 1
    d0, d1 = cases[0], cases[2]
    assert d0.needle_at < d1.needle_at  # depth 0 right after the instructions, depth 1 at the end
    # the filler haystack is split at sentence starts
    assert tok.decode(d1.ids[d1.needle_at - 3:d1.needle_at]).rstrip().endswith(".")


def test_scoring():
    assert nd.score("passkey", " 12345. The", "12345") == 1.0
    assert nd.score("passkey", " 1234 5", "12345") == 0.0
    assert nd.score("passkey", " none", "12345") == 0.0
    assert nd.score("niah", "eat a Sandwich in Dolores park", "x") == 1.0
    assert nd.score("niah", "eat a sandwich", "x") == 0.5


def test_haystacks(tmp_path):
    pg = nd.haystack_text("pg")
    essays = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(nd.paul_graham_dir().glob("*.txt"))]
    assert len(essays) >= 40 and pg.startswith(essays[0]) and pg.endswith(essays[-1])
    assert all(e in pg for e in essays) and len(pg) == sum(map(len, essays)) + 2 * (len(essays) - 1)
    austen = nd.haystack_text("austen")
    assert austen == nd.haystack_text("prideprejudice") and "PRIDE AND PREJUDICE" in austen[:100]
    assert "It is a truth universally acknowledged" in austen[:1000] and austen.count("Elizabeth") > 500
    own = tmp_path / "mine.txt"
    own.write_text("A haystack of my own.", encoding="utf-8")
    assert nd.haystack_text(str(own)) == "A haystack of my own."
    with pytest.raises(UserError, match="'no-such-novel' is neither a file nor a bundled corpus"):
        nd.haystack_text("no-such-novel")


def test_answers_equal_runtime_generation(tiny):
    """The shared-prefill batch gives each policy the answers `generate_ids` gives it."""
    model, tok = tiny
    cases = nd.make_cases(tok, "passkey", [260, 300], [0.2, 0.9], chat=True)
    pols = parse_policies("full,h2o,streaming", ["h2o.heavy=4", "h2o.recent=4", "streaming.window=6"])
    res = nd.run_cases(model, tok, cases, pols, max_new_tokens=6, batch_tokens=700)
    assert len(res) == 12
    eos = stop_ids(model, tok)
    for name, pol in pols.items():
        for c in cases:
            r = next(r for r in res if r.policy == name and r.length == c.length and r.depth == c.depth)
            knobs = [k for k in ["h2o.heavy=4", "h2o.recent=4", "streaming.window=6"] if k.startswith(name)]
            g = generate_ids(model, [c.ids], 6, policy=parse_policies(name, knobs)[name], eos=eos)
            assert r.output == tok.decode(g.tokens[0], skip_special_tokens=True), name
            assert r.answer == c.answer and r.score == nd.score("passkey", r.output, c.answer)
    full_kv = {r.kv for r in res if r.policy == "full"}
    assert full_kv == {1.0} and all(r.kv < 1 for r in res if r.policy == "h2o")
    table = nd.markdown_tables(res)
    assert "| passkey | h2o |" in table and "depth 20%" in table


def test_cli_needle(long_checkpoint, tmp_path, capsys):
    tiny_checkpoint = long_checkpoint
    from infinigen.cli import main
    rc = main(["needle", "--model", str(tiny_checkpoint), "--task", "passkey", "--policy", "full,streaming",
               "--knob", "window=8", "--lengths", "260,300", "--depths", "0,50%,1", "--out", str(tmp_path)])
    assert rc == 0
    assert "| passkey | streaming |" in capsys.readouterr().out
    data = json.loads((tmp_path / "needle.json").read_text())
    assert len(data["results"]) == 12
    png = (tmp_path / "needle_heatmap.png").read_bytes()
    assert png[:4] == b"\x89PNG"
    assert "needle_heatmap.png" in (tmp_path / "needle.md").read_text()
    assert main(["needle", "--model", str(tiny_checkpoint), "--lengths", "10"]) == 2
    assert main(["needle", "--model", str(tiny_checkpoint), "--lengths", "100"]) == 2  # no room for a haystack
    assert main(["needle", "--model", str(tiny_checkpoint), "--depths", "2"]) == 2
    assert main(["needle", "--model", str(tiny_checkpoint), "--task", "nope"]) == 2
    assert main(["needle", "--model", str(tiny_checkpoint), "--lengths", "4K", "--policy", "full"]) == 2


@pytest.mark.integration
def test_default_model_needle(default_model):
    model, tok = default_model
    res = nd.evaluate(model, tok, parse_policies("full,h2o"), tasks=("niah",), lengths=(1024,), depths=(0.5,))
    full = [r for r in res if r.policy == "full"]
    assert len(res) == 2 and sum(r.score for r in full) > 0  # the full cache finds the needle somewhere
    assert all(r.kv < 0.5 for r in res if r.policy == "h2o")
