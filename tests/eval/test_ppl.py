"""`infinigen ppl` and `infinigen.eval.ppl`: teacher-forced perplexity with any policy."""
from __future__ import annotations

import json
import math

import pytest
import torch

from infinigen import runtime
from infinigen.cli import main
from infinigen.eval import perplexity, resolve_text, token_windows
from infinigen.policies import make_policy
from infinigen.placement import Placement

CTX, PREFILL = 64, 16


def _run(args, tmp_path, capsys):
    out = tmp_path / "r.json"
    dtype = [] if "--dtype" in args else ["--dtype", "float32"]  # the library's default (the CLI's is "auto")
    rc = main(["ppl", *args, *dtype, "--json", str(out)])
    captured = capsys.readouterr()
    return rc, (json.loads(out.read_text()) if rc == 0 else None), captured


def test_full_cache_perplexity_matches_dense_scoring(tiny_checkpoint, text_file, tmp_path, capsys):
    rc, r, cap = _run(["--model", str(tiny_checkpoint), "--text", str(text_file), "--ctx", str(CTX),
                       "--prefill", str(PREFILL), "--chunk", "16"], tmp_path, capsys)
    assert rc == 0, cap.err
    assert "perplexity:" in cap.out and "relative KV size: 100.00%" in cap.out
    # independent: dense logits of the window, NLL of tokens PREFILL.. from the previous position
    from infinigen.loading import load
    model, tok, _ = load(str(tiny_checkpoint), progress=False)
    ids = token_windows(tok, text_file.read_text(), CTX)
    sess = Placement().new_session(model, 1, CTX)
    logits = runtime.prefill(model, ids, sess, all_logits=True)[0]
    nll = torch.nn.functional.cross_entropy(logits[PREFILL - 1:-1], ids[0, PREFILL:], reduction="none").double()
    assert r["tokens"] == CTX - PREFILL == nll.numel()
    assert r["perplexity"] == pytest.approx(math.exp(nll.mean().item()), rel=1e-5)
    assert [c["tokens"] for c in r["chunks"]] == [16, 16, 16]
    for c, part in zip(r["chunks"], nll.split(16)):
        assert c["perplexity"] == pytest.approx(math.exp(part.mean().item()), rel=1e-5)
    assert r["kv_all"] == pytest.approx(1.0) and r["kv_speculated"] == pytest.approx(1.0)
    assert r["policy"] == "full" and r["ctx"] == CTX and r["prefill"] == PREFILL


@pytest.mark.parametrize("args,kv,same", [
    (["--policy", "h2o", "--knob", "heavy_ratio=0.25", "--knob", "recent_ratio=0.25"], (0.3, 0.6),
     ("h2o", dict(heavy_ratio=0.25, recent_ratio=0.25), {})),
    (["--policy", "h2o", "--knob", "heavy=4", "--knob", "recent=4"], (0.1, 0.5), ("h2o", dict(heavy=4, recent=4), {})),
    (["--policy", "streaming", "--knob", "sinks=2", "--knob", "window=6"], (0.1, 0.5),
     ("streaming", dict(sinks=2, window=6), {})),
    (["--policy", "oracle", "--knob", "ratio=0.25"], (0.15, 0.3), ("oracle", dict(ratio=0.25), {})),
    (["--policy", "oracle", "--knob", "alpha=0.2"], (0.15, 0.45), ("oracle", dict(alpha=0.2), {})),  # alpha 2 reads all
    (["--policy", "int4"], (1.0, 1.0), ("int4", {}, {})),
    (["--policy", "int4", "--knob", "bits=16"], (1.0, 1.0), ("full", {}, {})),  # no quantization: the full cache
    (["--policy", "full", "--capacity", "0.8", "--eviction", "lru"], (0.9, 0.999),
     ("full", {}, dict(capacity=0.8, evict="lru"))),
    (["--policy", "full", "--capacity", "40", "--eviction", "lru", "--protect-recent", "12"], (0.7, 0.99),
     ("full", {}, dict(capacity=40, evict="lru", protect_recent=12))),
    (["--policy", "full", "--capacity", "40", "--eviction", "fifo"], (0.7, 0.99),
     ("full", {}, dict(capacity=40, evict="fifo"))),
])
def test_policies_and_pool_through_the_cli(tiny_checkpoint, text_file, tmp_path, capsys, args, kv, same):
    rc, r, cap = _run(["--model", str(tiny_checkpoint), "--text", str(text_file), "--ctx", str(CTX),
                       "--prefill", str(PREFILL), "--windows", "2", *args], tmp_path, capsys)
    assert rc == 0, cap.err
    assert r["windows"] == 2 and len(r["window_perplexities"]) == 2
    # equal-length windows pool to the geometric mean of their perplexities
    assert r["perplexity"] == pytest.approx(math.sqrt(r["window_perplexities"][0] * r["window_perplexities"][1]))
    assert kv[0] <= r["kv_all"] <= kv[1]
    if "--capacity" in args:
        assert r["eviction"] == args[args.index("--eviction") + 1] and r["capacity"] in (51, 40)
    # the options reached the policy and the pool: the library with those knobs gives the same numbers
    from infinigen.loading import load
    model, tok, _ = load(str(tiny_checkpoint), progress=False)
    name, knobs, pool = same
    lib = perplexity(model, tok, text_file, make_policy(name, **knobs), ctx=CTX, prefill=PREFILL, windows=2,
                     placement=Placement(**pool))
    assert r["perplexity"] == pytest.approx(lib.perplexity, rel=1e-9)
    assert r["window_perplexities"] == pytest.approx(lib.window_perplexities, rel=1e-9)
    assert r["kv_all"] == pytest.approx(lib.kv_all, rel=1e-9)
    full = perplexity(model, tok, text_file, None, ctx=CTX, prefill=PREFILL, windows=2)
    assert (r["perplexity"] == pytest.approx(full.perplexity, rel=1e-6)) == (args[-1] == "bits=16")


def test_json_to_stdout(tiny_checkpoint, text_file, capsys):
    rc = main(["ppl", "--model", str(tiny_checkpoint), "--text", str(text_file), "--ctx", "32", "--prefill", "8",
               "--policy", "streaming", "--knob", "ratio=0.5", "--json", "-"])
    out = capsys.readouterr().out
    assert rc == 0
    r = json.loads(out)
    assert r["settings"]["ratio"] == 0.5 and len(r["kv_per_layer"]) == 2


def test_quantized_and_budgeted_policies_change_the_result(tiny_checkpoint, text_file):
    from infinigen.loading import load
    model, tok, _ = load(str(tiny_checkpoint), progress=False)
    full = perplexity(model, tok, text_file, None, ctx=CTX, prefill=PREFILL)
    same = perplexity(model, tok, text_file, make_policy("h2o", heavy=CTX, recent=CTX), ctx=CTX, prefill=PREFILL)
    low = perplexity(model, tok, text_file, make_policy("int4", bits=2), ctx=CTX, prefill=PREFILL)
    assert same.perplexity == pytest.approx(full.perplexity, rel=1e-6)
    assert low.perplexity != pytest.approx(full.perplexity, rel=1e-4)


def test_corpus_names_resolve_through_infinigen_data(tmp_path, monkeypatch):
    (tmp_path / "mynovel.txt").write_text("text", encoding="utf-8")
    monkeypatch.setenv("INFINIGEN_DATA", str(tmp_path))
    assert resolve_text("mynovel") == tmp_path / "mynovel.txt"
    assert resolve_text("mynovel.txt") == tmp_path / "mynovel.txt"


@pytest.mark.parametrize("args,msg", [
    (["--ctx", "16", "--prefill", "16"], "--prefill"),
    (["--policy", "nope"], "unknown policy"),
    (["--policy", "h2o", "--knob", "sinks=3"], "no knob 'sinks'"),
    (["--policy", "full", "--knob", "alpha=5"], "no knob 'alpha'"),
    (["--capacity", "0.1"], "cannot hold"),
    (["--capacity", "-3"], "--capacity"),
    (["--capacity", "0.8", "--eviction", "random"], "--evict"),
    (["--eviction", "lru"], "need a pool limit"),
    (["--text", "no_such_novel"], "neither a file nor a bundled corpus"),
    (["--policy", "oracle", "--knob", "ratio=1.5"], "ratio"),
    (["--policy", "int4", "--knob", "bits=12"], "bits"),
    (["--policy", "h2o", "--knob", "heavy=2.5"], "whole number"),
    (["--policy", "h2o", "--knob", "nonsense=1"], "no knob"),
    (["--windows", "0"], "--windows"),
    (["--windows", "1000"], "window(s)"),
])
def test_bad_values_are_one_line_errors(tiny_checkpoint, text_file, capsys, args, msg):
    rc = main(["ppl", "--model", str(tiny_checkpoint), "--text", str(text_file), "--ctx", str(CTX),
               "--prefill", str(PREFILL), *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert msg in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.integration
def test_default_model_short_context(default_model):
    """Full cache vs H2O with an unlimited budget on the real model: identical; a 20% H2O budget costs."""
    model, tok = default_model
    full = perplexity(model, tok, "prideprejudice", None, ctx=384, prefill=128)
    same = perplexity(model, tok, "prideprejudice", make_policy("h2o", heavy=384, recent=384), ctx=384, prefill=128)
    small = perplexity(model, tok, "prideprejudice", make_policy("streaming", ratio=0.2), ctx=384, prefill=128)
    assert 5 < full.perplexity < 60
    assert same.perplexity == pytest.approx(full.perplexity, rel=1e-5)
    assert small.perplexity > full.perplexity and small.kv_all == pytest.approx(0.2, abs=0.01)


def test_progress_bar_does_not_touch_the_numbers(tiny_checkpoint, text_file, monkeypatch):
    """tqdm's update() returns True when it redraws; the per-layer hook must not pass that on as the
    MLP's output (a forward hook's return value replaces it)."""
    from infinigen.eval import ppl as ppl_mod
    from infinigen.loading import load
    model, tok, _ = load(str(tiny_checkpoint), progress=False)
    quiet = perplexity(model, tok, text_file, None, ctx=CTX, prefill=PREFILL)
    real = ppl_mod._LayerProgress.__init__

    def init(self, *a, **kw):
        real(self, *a, **kw)
        self.bar.update = lambda n=1: True  # as if it redrew at every layer
    monkeypatch.setattr(ppl_mod._LayerProgress, "__init__", init)
    loud = perplexity(model, tok, text_file, None, ctx=CTX, prefill=PREFILL, progress=True)
    assert loud.perplexity == quiet.perplexity


class _WordTokenizer:
    """Words -> ids 10.., with BOS (id 1) before every input when `bos` is set (as Gemma's tokenizer does)."""

    def __init__(self, bos: bool):
        self.bos_token_id = 1
        self.bos = bos

    def __call__(self, text, add_special_tokens=True, verbose=False):
        ids = [10 + len(w) for w in text.split()]
        return {"input_ids": ([1] if self.bos and add_special_tokens else []) + ids}


def test_token_windows_start_with_bos_where_the_tokenizer_does():
    from infinigen.eval.ppl import token_windows
    text = " ".join("a" * (1 + i % 7) for i in range(100))
    plain = token_windows(_WordTokenizer(bos=False), text, 16, windows=2)
    assert plain.shape == (2, 16) and (plain != 1).all()  # no BOS where the tokenizer adds none
    with_bos = token_windows(_WordTokenizer(bos=True), text, 16, windows=2)
    assert with_bos.shape == (2, 16) and (with_bos[:, 0] == 1).all()
    assert with_bos[:, 1:].flatten().tolist() == plain.flatten()[:30].tolist()  # then the text, in order


def test_kv_shares_on_a_model_with_local_layers():
    """Gemma 3's local layers read their window (counted as their whole cache): `kv_all` is the share over
    every layer, `kv_global` over the global ones only, and the two differ."""
    from support.models import build_gemma
    _, model = build_gemma()
    tokens = torch.randint(3, 256, (1, 48), generator=torch.Generator().manual_seed(2))
    r = perplexity(model, None, None, make_policy("oracle", ratio=0.3), ctx=48, prefill=8, tokens=tokens)
    assert r.local_layers == [0, 2, 3] and [round(r.kv_per_layer[i], 6) for i in r.local_layers] == [1.0] * 3
    assert r.kv_global == pytest.approx(r.kv_per_layer[1]) and r.kv_global < 0.6
    assert r.kv_all == pytest.approx(sum(r.kv_per_layer) / 4) and r.kv_all > r.kv_global + 0.2
