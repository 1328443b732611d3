"""Bad input at the edges: knobs beyond 64 bits, memory limits, broken data files, a full or closed stdout,
misleading messages. Each CLI case is exit 2 and one line on stderr, before the work (before the model loads
where the check does not need it), nothing half written. One test per class."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infinigen import runtime
from support.cli import cli_process, one_line_error, subprocess_env
from support.models import CORPUS

INT64_MAX = 2 ** 63 - 1


# ---- knob values out of range for their type -----------------------------------------------------------------
KNOBS = [
    (["generate", "-p", "hi", "--policy", "infinigen", "--knob", "min_fetch=99999999999999999999"], "min_fetch"),
    (["generate", "-p", "hi", "--policy", "infinigen", "--knob", "min_fetch=9223372036854775808"], "min_fetch"),
    (["generate", "-p", "hi", "--policy", "infinigen", "--knob", "block=99999999999999999999"], "block"),
    (["ppl", "--policy", "streaming", "--knob", "sinks=99999999999999999999"], "sinks"),
    (["ppl", "--policy", "h2o", "--knob", "heavy=-9223372036854775809"], "heavy"),
    (["ppl", "--policy", "oracle", "--knob", "dense_layers=0,18446744073709551616"], "dense_layers"),
]


@pytest.mark.parametrize("argv,needle", KNOBS, ids=[" ".join(a[-2:]) for a, _ in KNOBS])
def test_knob_out_of_int64_is_refused_before_loading(cli, tiny_checkpoint, text_file, no_model_load, argv, needle):
    text = ["--text", text_file] if argv[0] == "ppl" else []
    one_line_error(*cli(*argv, "--model", tiny_checkpoint, *text)[::2], needle, "64-bit")


def test_a_knob_of_thousands_of_digits(cli, tiny_checkpoint, no_model_load):
    """Beyond what Python parses as an int: the same one line, and it is not 5000 digits long."""
    code, _, err = cli("generate", "-p", "hi", "--policy", "streaming", "--knob", "sinks=" + "9" * 5000,
                       "--model", tiny_checkpoint)
    one_line_error(code, err, "sinks", "whole number", "5000 characters")
    assert len(err) < 300


def _int_knobs():
    from infinigen.policies import REGISTRY, knob_types
    return [(name, knob) for name in REGISTRY for knob, tp in knob_types(name).items() if tp in (int, tuple)]


def test_every_int_knob_is_checked_at_construction():
    """Generic, from the dataclass annotations: every policy's whole-number knobs refuse what int64 cannot
    hold (and a bool, a float or text), at make_policy, not in the first decoding step."""
    from infinigen.errors import UserError
    from infinigen.policies import make_policy
    knobs = _int_knobs()
    assert {("infinigen", "min_fetch"), ("infinigen", "block"), ("streaming", "sinks"), ("h2o", "heavy"),
            ("oracle", "tokens"), ("int4", "group"), ("oracle", "dense_layers")} <= set(knobs)
    for name, knob in knobs:
        for bad in (10 ** 20, 2 ** 63, -(2 ** 63) - 1):
            value = (0, bad) if knob == "dense_layers" else bad
            with pytest.raises(UserError, match=f"{knob}.*64-bit") as e:
                make_policy(name, **{knob: value})
            assert "\n" not in str(e.value)
        if knob != "dense_layers":
            for bad in (True, 2.0, "3"):
                with pytest.raises(UserError, match=knob):
                    make_policy(name, **{knob: bad})
    with pytest.raises(UserError, match="alpha"):  # a float knob given an int no float holds
        make_policy("infinigen", alpha=10 ** 400)
    with pytest.raises(UserError, match="skew"):
        make_policy("infinigen", skew=1)


LIMITLESS = [("streaming", dict(sinks=INT64_MAX, window=INT64_MAX)), ("h2o", dict(heavy=INT64_MAX, recent=INT64_MAX)),
             ("oracle", dict(tokens=INT64_MAX)), ("int4", dict(bits=INT64_MAX)),
             ("infinigen", dict(min_fetch=INT64_MAX, skew=False)),
             ("infinigen", dict(min_fetch=INT64_MAX, block=INT64_MAX, budget="layer", skew=False)),
             ("infinigen", dict(min_fetch=INT64_MAX, budget_ref=INT64_MAX, skew=False))]


@pytest.mark.parametrize("name,knobs", LIMITLESS, ids=[f"{n}-{'-'.join(k)}" for n, k in LIMITLESS])
def test_the_largest_accepted_knob_runs(tiny_llama, name, knobs):
    """What the check lets through, the runtime can hold: int64's largest value as a token budget runs the
    prefill, decoding and the teacher-forced path without an overflow, and (a budget beyond any context)
    reads every entry, as the full cache does."""
    from infinigen.placement import Placement
    from infinigen.policies import make_policy
    _, model = tiny_llama
    tokens = torch.randint(3, 200, (2, 40), generator=torch.Generator().manual_seed(0))

    def run(pol):
        forced = runtime.teacher_forced(model, tokens, 16, Placement().new_session(model, 2, 40, pol))
        sess = Placement().new_session(model, 2, 30, pol)
        steps = [runtime.prefill(model, tokens[:, :16], sess)]
        steps += [runtime.decode(model, tokens[:, 16 + i], sess) for i in range(8)]
        return forced, torch.stack(steps)

    want, got = run(make_policy("full")), run(make_policy(name, **knobs))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


# ---- memory: everything a batch allocates, logits included -------------------------------------------------------
def test_python_generate_checks_memory_before_allocating(checkpoint_model, monkeypatch):
    import importlib

    import infinigen
    from infinigen.errors import UserError
    g = importlib.import_module("infinigen.generate")  # the module (`infinigen.generate` is the function)
    model, tok = checkpoint_model
    rows = 2000
    need = g.batch_memory(model, rows, len(tok("hi")["input_ids"]), 1, padded=False)  # what generate will ask
    assert need["logits"] >= rows * model.cfg.vocab_size * 4  # the [rows, vocab] float32 scores are counted
    total = need["kv"] + need["logits"] + need["activations"] + need["policy"]

    def no_work(*a, **k):
        raise AssertionError("allocated before the memory check")
    monkeypatch.setattr(g.runtime, "prefill", no_work)
    monkeypatch.setattr(g, "left_pad", no_work)
    # room for everything but the logits: still refused (the logits alone are most of this batch)
    monkeypatch.setattr(g, "free_memory", lambda device: {"ram": total - need["logits"] // 2})
    with pytest.raises(UserError, match="logits") as e:
        infinigen.generate(model, tok, ["hi"] * rows, max_new_tokens=1)
    assert "\n" not in str(e.value) and "2000 prompts" in str(e.value)
    # an address-space limit (ulimit -v) is a bound of its own, the disk pool's mapping included
    monkeypatch.setattr(g, "free_memory", lambda device: {"ram": 1 << 40, "address space": total // 2})
    with pytest.raises(UserError, match="address space"):
        infinigen.generate(model, tok, ["hi"] * rows, max_new_tokens=1)
    # with the room it needs, the same batch runs
    monkeypatch.undo()
    monkeypatch.setattr(g, "free_memory", lambda device: {"ram": total + (1 << 20)})
    out = infinigen.generate(model, tok, ["hi"] * 50, max_new_tokens=1)
    assert len(out.texts) == 50


def _under_ulimit_v() -> str:
    """A Python program that runs the CLI with its address space limited to 1 GiB more than it maps now."""
    return (
        "import resource, sys, torch\n"
        "from infinigen.generate import _read_kib\n"
        "room = _read_kib('/proc/self/status', 'VmSize') + (1 << 30)\n"
        "resource.setrlimit(resource.RLIMIT_AS, (room, room))\n"
        "from infinigen.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")


def test_cli_refuses_a_batch_beyond_ulimit_v(tiny_checkpoint):
    """`ulimit -v` and a batch far beyond it: exit 2 and one line, not the allocator's traceback."""
    p = subprocess.run([sys.executable, "-c", _under_ulimit_v(), "generate",
                        "-p", "the quick brown fox jumps over the lazy dog", "-b", "65536", "-n", "1",
                        "--model", str(tiny_checkpoint)], capture_output=True, text=True, env=subprocess_env(),
                       timeout=300)
    one_line_error(p.returncode, p.stderr, "address space", "logits", "65536 prompts")
    assert p.stdout == ""


@pytest.mark.integration
def test_default_model_refuses_a_batch_beyond_ulimit_v_in_one_line():
    """On the default model: `ulimit -v 6000000; infinigen generate -p hi -b 65536 -n 1`."""
    cmd = " ".join(cli_process("generate", "-p", "hi", "-b", "65536", "-n", "1"))
    p = subprocess.run(["bash", "-c", f"ulimit -v 6000000; exec {cmd}"], capture_output=True, text=True,
                       env=subprocess_env(), timeout=600)
    one_line_error(p.returncode, p.stderr, "65536 prompts", "logits", "GiB")


# ---- a BIG-bench folder with broken tasks ---------------------------------------------------------------------
@pytest.fixture
def bigbench(tmp_path):
    root = tmp_path / "bb"
    good = root / "good_task"
    good.mkdir(parents=True)
    examples = [{"input": f"question {i}?", "target_scores": {"yes": 1, "no": 0}} for i in range(4)]
    (good / "task.json").write_text(json.dumps({"name": "good_task", "examples": examples}))
    broken = {"random_bytes": random.Random(0).randbytes(300), "a_list": b"[1, 2]",
              "string_scores": json.dumps({"examples": [{"input": "q", "target_scores": "yes"}]}).encode()}
    for name, body in broken.items():
        (root / name).mkdir()
        (root / name / "task.json").write_bytes(body)
    return root, sorted(broken)


def test_broken_bigbench_tasks_are_skipped_or_named(cli, tiny_checkpoint, bigbench, no_model_load):
    root, broken = bigbench
    code, out, err = cli("fewshot", "--data", root, "--list")
    assert code == 0 and out.split("\t")[0] == "good_task" and len(out.splitlines()) == 1, err
    warnings = err.strip().splitlines()
    assert len(warnings) == 3 and "Traceback" not in err
    for name, line in zip(broken, warnings):
        assert line.startswith("infinigen: warning: skipping BIG-bench task ") and name in line
    for name in broken:  # the one asked for: exit 2 naming it, before the model loads
        one_line_error(*cli("fewshot", "--data", root, "--task", name, "--model", tiny_checkpoint)[::2],
                       name, "task.json")


def test_other_tasks_still_run_beside_a_broken_one(cli, tiny_checkpoint, bigbench):
    root, broken = bigbench
    code, out, err = cli("fewshot", "--data", root, "--task", "all", "--policy", "full", "--shots", "1",
                         "--limit", "2", "--model", tiny_checkpoint)
    assert code == 0, err
    assert "good_task" in out and "Traceback" not in err
    assert all(f"skipping BIG-bench task {name}" in err for name in broken)


# ---- skew artifacts that are NaN or not orthogonal ---------------------------------------------------------------
@pytest.mark.parametrize("damage", ["nan", "not-orthogonal"])
def test_broken_skew_artifact_is_refused(cli, tiny_checkpoint, text_file, tmp_path, monkeypatch, damage):
    """Checked when loaded, as a truncated file is: the file named, and how to replace it. A cache entry is
    refused, not recomputed behind the user's back: the cache is shared by runs and a broken entry means
    something went wrong that a silent recomputation would hide (recomputing is one `--force` away)."""
    from safetensors.torch import load_file, save_file

    from infinigen.errors import UserError
    from infinigen.skew import Skew
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    args = ["skew", "--model", tiny_checkpoint, "--calib", text_file, "--tokens", "64", "--json"]
    code, out, err = cli(*args)
    assert code == 0, err
    path = Path(json.loads(out)["path"])
    t = load_file(str(path))
    if damage == "nan":
        t["matrices"][1, 0, 2, 3] = float("nan")
    else:
        t["matrices"][0, 1] *= 1.5  # a scaled basis: no longer orthogonal
    save_file(t, str(path), metadata={"format": "2"})
    with pytest.raises(UserError, match="NaN" if damage == "nan" else "orthogonal"):
        Skew.load(path)
    one_line_error(*cli(*args)[::2], str(path), "--force")
    # the policy that would use it (the only artifact of this model in the cache) refuses it too
    one_line_error(*cli("generate", "-p", "hi", "-n", "2", "--policy", "infinigen", "--model", tiny_checkpoint)[::2],
                   str(path))
    code, out, err = cli(*args, "--force")
    assert code == 0 and Skew.load(path) is not None, err


# ---- calibration text: binary, or too short ----------------------------------------------------------------------
@pytest.mark.parametrize("body,needle", [(bytes(range(256)) * 8, "UTF-8"), (b"It is a truth.\0\0\0 " * 50, "NUL"),
                                          (b"", "empty")], ids=["binary", "nul", "empty"])
def test_calibration_text_must_be_text(cli, tiny_checkpoint, tmp_path, monkeypatch, no_model_load, body, needle):
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    calib = tmp_path / "calib.bin"
    calib.write_bytes(body)
    one_line_error(*cli("skew", "--calib", calib, "--model", tiny_checkpoint)[::2], str(calib), needle)
    assert not (tmp_path / "cache" / "skew").exists()


def test_calibration_text_too_short(cli, tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    calib = tmp_path / "short.txt"
    calib.write_text("Emma Woodhouse.")  # a few tokens
    one_line_error(*cli("skew", "--calib", calib, "--tokens", "256", "--model", tiny_checkpoint)[::2],
                   str(calib), "fewer than the 256 asked for")
    # no --tokens: all the text holds, but at least a head's width (head_dim 8 here)
    one_line_error(*cli("skew", "--calib", calib, "--model", tiny_checkpoint)[::2], str(calib), "head_dim 8")
    assert not list((tmp_path / "cache").rglob("*.safetensors"))
    # a shorter text than the default 4096 tokens, and no --tokens: calibrates on what it holds, named so
    calib.write_text(" ".join(CORPUS) * 3)
    code, out, err = cli("skew", "--calib", calib, "--json", "--model", tiny_checkpoint)
    assert code == 0, err
    r = json.loads(out)
    assert 8 <= r["tokens"] < 4096 and r["path"].endswith(f"-{r['tokens']}.safetensors")


# ---- standard output that cannot be written -----------------------------------------------------------------------
def test_stdout_to_a_full_device(tiny_checkpoint):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    for argv in (["info"], ["generate", "-p", "hello there", "-n", "8"]):
        with open("/dev/full", "w") as full:
            p = subprocess.run(cli_process(*argv, "--model", tiny_checkpoint), stdout=full, stderr=subprocess.PIPE,
                               text=True, env=subprocess_env(), timeout=120)
        one_line_error(p.returncode, p.stderr, "standard output", "No space left")


def test_stdout_closed_by_the_reader(tiny_checkpoint):
    """`| head`: the reader left; the command ends quietly (no traceback, no message)."""
    for argv in (["info"], ["generate", "-p", "hello there", "-n", "30"]):
        p = subprocess.Popen(cli_process(*argv, "--model", tiny_checkpoint), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=subprocess_env())
        p.stdout.close()
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 1 and err == "", err


# ---- misleading messages --------------------------------------------------------------------------------------------
def test_the_right_option_is_blamed(cli, tiny_checkpoint, text_file, bigbench, tmp_path, no_model_load):
    m = ["--model", tiny_checkpoint]
    one_line_error(*cli("generate", "-f", tmp_path, *m)[::2], str(tmp_path), "folder")
    for argv in (["generate", "-p", "hi"], ["ppl", "--text", text_file], ["needle"],
                 ["fewshot", "--data", bigbench[0], "--task", "good_task"]):
        code, out, err = cli(*argv, "--pool-dir", tmp_path / "pool", *m)
        one_line_error(code, err, "--pool-dir", "--kv-offload disk")
    assert not (tmp_path / "pool").exists()


def test_max_new_tokens_beyond_the_context_is_not_a_batch_size_error(cli, tiny_checkpoint):
    code, out, err = cli("generate", "-p", "hi", "-n", "99999999999999999999", "--model", tiny_checkpoint)
    one_line_error(code, err, "max-new-tokens", "context")
    assert "batch" not in err and "GiB" not in err


def test_free_memory_sees_a_cgroup_limit(tmp_path):
    """Inside a memory cgroup (a container's limit) the room left is the group's, not the host's RAM."""
    from infinigen.errors import UserError
    from infinigen.membound import MemoryBound
    try:
        mb = MemoryBound(256 << 20)
    except UserError as e:
        pytest.skip(f"no memory bound here: {e}")
    out = tmp_path / "free.json"
    probe = ("import importlib, json, sys\n"
             "g = importlib.import_module('infinigen.generate')\n"
             f"open({str(out)!r}, 'w').write(json.dumps(g.free_memory('cpu')))\n")
    with mb:
        if mb.group is None:
            pytest.skip(f"{mb.mechanism}: no group to read")
        assert mb.run([sys.executable, "-c", probe], env=subprocess_env()) == 0
    assert json.loads(out.read_text())["ram"] <= 256 << 20
