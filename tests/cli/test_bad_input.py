"""Every bad input and every interrupt gets exit code 2 (or 130), one line on stderr, no
traceback, no half-written output, and, where the input alone tells, before any expensive work.
One test per class of case; each parametrized case is a reported failure."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from support.cli import console, one_line_error


# ---- interrupts ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["ppl", "--ctx", "64", "--prefill", "16"],
                                  ["bench", "--prompt-len", "32", "--gen-len", "4"],
                                  ["fewshot", "--task", "cause_and_effect"], ["info"], ["generate", "-p", "hi"]],
                         ids=["ppl", "bench", "fewshot", "info", "generate"])
def test_interrupt_exits_130(cli, monkeypatch, tiny_checkpoint, text_file, argv):
    """Ctrl-C during the work: exit 130, one line, no traceback (typer turns it into an Exit it returns)."""
    from infinigen import loading

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(loading, "load", interrupted)
    extra = ["--text", text_file] if argv[0] in ("ppl", "bench") else []
    code, out, err = cli(*argv, "--model", tiny_checkpoint, *extra)
    assert code == 130, err
    assert "Traceback" not in err and "interrupted" in err


@pytest.mark.parametrize("delay", [0.6, 2.0], ids=["while-importing", "later"])
def test_sigint_to_the_process(tiny_checkpoint, text_file, delay):
    """A real SIGINT to the console script, early (torch still importing) and later: 130, no traceback."""
    p = subprocess.Popen(console("ppl", "--model", tiny_checkpoint, "--text", text_file, "--ctx", "128",
                                 "--prefill", "16", "--windows", "3"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    if p.returncode == 0:
        pytest.skip("the command finished before the signal")
    assert p.returncode == 130, err
    assert "Traceback" not in err


# ---- output paths ------------------------------------------------------------------------------------------
def test_output_paths_checked_before_the_work(cli, tiny_checkpoint, text_file, tmp_path, no_model_load):
    existing = tmp_path / "a_file"
    existing.write_text("keep me")
    m = ["--model", tiny_checkpoint]
    one_line_error(*cli("fewshot", "--task", "cause_and_effect", "--json", "/proc/x.json", *m)[::2], "/proc/x.json")
    one_line_error(*cli("needle", "--out", existing, *m)[::2], "not a folder")
    assert existing.read_text() == "keep me"
    one_line_error(*cli("analyze", "--out", "/proc/an", "--text", text_file, *m)[::2], "/proc/an")
    one_line_error(*cli("bench", "--plot", tmp_path / "out.xyz", "--text", text_file, *m)[::2], ".xyz", "format")
    one_line_error(*cli("ppl", "--json", tmp_path, "--text", text_file, *m)[::2], "folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing written, no probe left


def test_json_is_written_whole(tmp_path):
    """Atomic write: an interrupted write leaves the old file, never half a new one."""
    from infinigen.commands.options import write_json
    out = tmp_path / "r.json"
    write_json(out, {"a": 1, "b": float("nan")})
    assert json.loads(out.read_text()) == {"a": 1, "b": None}  # NaN is not JSON

    class Boom:
        pass
    with pytest.raises(TypeError):
        write_json(out, {"a": Boom()})
    assert json.loads(out.read_text()) == {"a": 1, "b": None}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


# ---- NaN and inf ------------------------------------------------------------------------------------------
NON_FINITE = [
    (["generate", "-p", "hi", "-t", "nan"], "temperature"),
    (["generate", "-p", "hi", "--top-p", "inf"], "top-p"),
    (["ppl", "--capacity", "nan"], "capacity"),
    (["ppl", "--capacity", "inf"], "capacity"),
    (["ppl", "--policy", "h2o", "--knob", "heavy_ratio=nan"], "heavy_ratio"),
    (["ppl", "--policy", "h2o", "--knob", "heavy=1e400"], "heavy"),
    (["ppl", "--policy", "h2o", "--knob", "recent=nan"], "recent"),
    (["ppl", "--policy", "oracle", "--knob", "alpha=nan"], "alpha"),
    (["ppl", "--policy", "infinigen", "--knob", "alpha=inf"], "alpha"),
    (["ppl", "--policy", "streaming", "--knob", "window=nan"], "window"),
    (["analyze", "--budget", "nan"], "budget"),
    (["analyze", "--count-alphas", "nan"], "count-alphas"),
    (["analyze", "--alphas", "1,inf"], "alphas"),
    (["bench", "--weights-offload", "nan"], "weights-offload"),
    (["skew", "--ratio", "nan"], "ratio"),
    (["fewshot", "--prefill-frac", "nan"], "prefill-frac"),
]


@pytest.mark.parametrize("argv,needle", NON_FINITE, ids=[" ".join(a) for a, _ in NON_FINITE])
def test_nan_and_inf_refused(cli, tiny_checkpoint, text_file, no_model_load, argv, needle):
    text = ["--text", text_file] if argv[0] in ("ppl", "analyze", "bench") else []
    one_line_error(*cli(*argv, "--model", tiny_checkpoint, *text)[::2], needle)


# ---- weights that do not match config.json ----------------------------------------------------------------
@pytest.mark.parametrize("key,delta", [("num_key_value_heads", -1), ("vocab_size", 7), ("hidden_size", 8),
                                       ("num_hidden_layers", -1), ("num_hidden_layers", 1), ("intermediate_size", 4)])
def test_weights_that_do_not_match_the_config(cli, tiny_checkpoint, tmp_path, key, delta):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg[key] += delta
    (ck / "config.json").write_text(json.dumps(cfg))
    code, out, err = cli("info", "--model", ck)
    one_line_error(code, err, "config")
    assert out == ""


# ---- the cache ------------------------------------------------------------------------------------------------
def _fake_gguf(tmp_path) -> Path:
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + b"\x00" * 64)
    return f


def test_unwritable_cache_fails_before_converting(cli, tmp_path, monkeypatch):
    blocker = tmp_path / "plainfile"
    blocker.write_text("x")
    monkeypatch.setenv("INFINIGEN_CACHE", str(blocker / "cache"))  # below a file: cannot be made, even by root
    from infinigen.loading import default_gguf
    t = time.perf_counter()
    code, _, err = cli("info", "--model", default_gguf())
    one_line_error(code, err, "cache", "INFINIGEN_CACHE")
    assert time.perf_counter() - t < 10  # not after the 20 s conversion


def test_stale_partial_conversions_are_removed(cli, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("INFINIGEN_CACHE", str(cache))
    gguf = cache / "gguf"
    dead = gguf / ".partial-999999999-abc"  # no such pid: a killed conversion
    live = gguf / f".partial-{os.getpid()}-def"  # a conversion running now
    for d in (dead, live):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"0" * 100)
    one_line_error(*cli("info", "--model", _fake_gguf(tmp_path))[::2], "broken.gguf")
    assert not dead.exists() and live.exists()


def test_corrupt_converted_checkpoint_names_its_path(cli, tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    ck = tmp_path / "cache" / "gguf" / "model-0123"
    shutil.copytree(tiny_checkpoint, ck)
    (ck / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    one_line_error(*cli("info", "--model", ck)[::2], str(ck / "model.safetensors"), "delete")


def test_corrupt_skew_artifact_names_the_file_and_force(cli, tiny_checkpoint, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    args = ["skew", "--model", tiny_checkpoint, "--calib", text_file, "--tokens", "64", "--json"]
    code, out, err = cli(*args)
    assert code == 0, err
    path = Path(json.loads(out)["path"])
    path.write_bytes(b"\x00not safetensors" * 8)
    one_line_error(*cli(*args)[::2], str(path), "--force")
    code, out, err = cli(*args, "--force")
    assert code == 0, err
    assert json.loads(out)["reused"] is False
    code, out, err = cli(*args)
    assert code == 0 and json.loads(out)["reused"] is True, err


# ---- bounds -------------------------------------------------------------------------------------------------------
def test_bounds_before_loading(cli, tiny_checkpoint, text_file, no_model_load):
    m = ["--model", tiny_checkpoint]
    t = time.perf_counter()
    one_line_error(*cli("generate", "-p", "hi", "--batch-size", "1000000000", *m)[::2], "batch-size")
    assert time.perf_counter() - t < 5  # no 10^9 prompts were built
    one_line_error(*cli("generate", "-p", "hi", "--knob", "alpha=abc", "--policy", "infinigen", *m)[::2],
                   "alpha", "number", "'abc'")
    one_line_error(*cli("bench", "--capacity", "10", "--prompt-len", "100", "--text", text_file, *m)[::2],
                   "--capacity", "prompt")


def test_bounds_that_need_the_model(cli, tiny_checkpoint, text_file, tmp_path):
    m = ["--model", tiny_checkpoint]  # a 2-layer Llama (RoPE) with 128 positions
    one_line_error(*cli("ppl", "--ctx", "1000", "--text", text_file, *m)[::2], "--ctx", "128")
    one_line_error(*cli("generate", "-p", "hi", "--policy", "infinigen", "--knob", "dense_layers=0,99",
                        "--knob", "skew=false", *m)[::2], "dense layer 99", "2 layers")
    one_line_error(*cli("ppl", "--policy", "oracle", "--knob", "dense_layers=5", "--ctx", "64", "--prefill", "16",
                        "--text", text_file, *m)[::2],
                   "dense layer 5")
    task = tmp_path / "bb" / "tiny_task"
    task.mkdir(parents=True)
    examples = [{"input": f"q{i}", "target_scores": {"a": 1, "b": 0}} for i in range(4)]
    (task / "task.json").write_text(json.dumps({"name": "tiny_task", "examples": examples}))
    one_line_error(*cli("fewshot", "--data", tmp_path / "bb", "--task", "tiny_task", "--shots", "1000", *m)[::2],
                   "--shots", "4 examples", "at most 3")


def test_generate_rows_beyond_memory(cli, tiny_checkpoint, monkeypatch):
    """Rows that fit the static bound but not the machine's memory: refused after loading, before the work."""
    import importlib
    generate = importlib.import_module("infinigen.generate")  # the one check, the Python API's too
    monkeypatch.setattr(generate, "free_memory", lambda device: {"ram": 1 << 20})
    one_line_error(*cli("generate", "-p", "hi", "-n", "100", "--batch-size", "4096", "--model", tiny_checkpoint)[::2],
                   "4096 prompts", "GiB")


# ---- the bench table ----------------------------------------------------------------------------------------------
def test_bench_tables_fit_80_columns():
    import io

    from rich.console import Console

    from infinigen.commands.bench import tables
    row = dict(system="transformers DynamicCache(offloading)", batch=64, prompt_len=32768, prefill_s=123.456,
               decode_ms_per_step=1234.5, decode_tokens_per_s=51.84, x_vs_ideal=0.97, x_vs_transformers=2.31,
               x_vs_full_offload=12.5, bytes_moved_per_token=98765, peak_fast_bytes=3 << 30, peak_slow_bytes=40 << 30,
               relative_kv=0.0734, speculation_bytes=25 << 20)
    buf = io.StringIO()
    console = Console(file=buf, width=80, force_terminal=False)
    for t in tables([row, dict(row, system="infinigen (cpu)")]):
        console.print(t)
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text
    for cell in ("1234", "51.84", "0.97", "2.31", "12.50", "123.5", "96.5", "3072", "40960", "7.3%", "25.0"):
        assert cell in text, (cell, text)
