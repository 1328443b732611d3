"""Byte sizes given on the command line ("2G", "512M", "1.5GiB", "1000000"): one parser (`infinigen.sizes`)
reads every size flag of every command; a value it cannot hold (hundreds of digits, beyond 64 bits, inf, nan,
negative, garbage) is one line and exit 2 before the model loads (and, for `serve`, before the port is bound)."""
from __future__ import annotations

import pytest

from support.cli import one_line_error
from infinigen.errors import UserError
from infinigen.sizes import MAX_BYTES, parse_bytes

HUGE = "9" * 300  # a float of it is finite (1e300), with a unit it is inf
TOO_LARGE = [HUGE, HUGE + "G", "1" + "0" * 5000, "8E", "8EiB", str(MAX_BYTES + 1), "9999999999999999999999K"]
MALFORMED = ["inf", "nan", "-1", "-2G", "garbage", "", "2X", "1e9", "0x10", "2 G B", "1,000"]


@pytest.mark.parametrize("text, value", [
    ("2G", 2 << 30), ("512M", 512 << 20), ("1.5GiB", 3 << 29), ("1000000", 1000000), ("2gb", 2 << 30),
    ("64k", 65536), (" 3 KiB ", 3072), ("0.5K", 512), ("7E", 7 << 60), (str(MAX_BYTES), MAX_BYTES), ("1", 1),
    ("100b", 100), (".25M", 1 << 18)])
def test_sizes_are_read_exactly(text, value):
    assert parse_bytes(text, "pool-bytes") == value


@pytest.mark.parametrize("text", TOO_LARGE + MALFORMED + ["0", "0.4", "0K"])
def test_sizes_that_are_refused(text):
    with pytest.raises(UserError, match="--pool-bytes") as e:
        parse_bytes(text, "pool-bytes")
    assert len(str(e.value)) < 200  # one readable line, even for a value of thousands of digits


def test_zero_turns_off_where_allowed():
    assert parse_bytes("0", "row-cache-bytes", zero=True) == 0
    assert parse_bytes("0G", "row-cache-bytes", zero=True) == 0
    with pytest.raises(UserError, match="at least 1 byte"):
        parse_bytes("0.1", "row-cache-bytes", zero=True)  # rounds to 0 but is not "off"


def test_memory_limit_reads_sizes_the_same_way():
    from infinigen.membound import parse_limit
    assert parse_limit("2G") == 2 << 30 and parse_limit("none") == 0 and parse_limit("auto") is None
    with pytest.raises(UserError, match="memory-limit.*too large"):
        parse_limit(HUGE + "G")


# every size flag of every command
FLAGS = [(cmd, "--pool-bytes") for cmd in ("generate", "bench", "ppl", "needle", "fewshot", "serve")] + [
    ("bench", "--row-cache-bytes"), ("bench", "--memory-limit"), ("serve", "--fast-bytes"),
    ("serve", "--prefix-cache-bytes"), ("serve", "--prefix-cache-dir-bytes")]
ARGS = {"generate": ["-p", "hi"], "bench": ["--prompt-len", "16", "--gen-len", "2"], "ppl": [], "needle": [],
        "fewshot": ["--task", "cause_and_effect"], "serve": ["--port", "0"]}


@pytest.fixture
def no_serving(monkeypatch, no_model_load):
    """`serve` may neither bind its port nor build its engine: the error had to come before both."""
    import infinigen.commands.serve as serve

    def refuse(*a, **k):
        raise AssertionError("serve bound its port or built its engine before the bad size was noticed")
    monkeypatch.setattr(serve, "_listen", refuse)
    monkeypatch.setattr(serve, "build", refuse)


@pytest.mark.parametrize("value", [HUGE, HUGE + "G", "8E", "-1", "nan", "inf", "lots"])
@pytest.mark.parametrize("command, flag", FLAGS, ids=[f"{c}{f}" for c, f in FLAGS])
def test_a_bad_size_is_one_line_before_the_work(cli, tiny_checkpoint, text_file, no_serving, command, flag, value):
    text = ["--text", text_file] if command in ("ppl", "bench") else []
    code, _, err = cli(command, "--model", tiny_checkpoint, *ARGS[command], *text, flag, value)
    one_line_error(code, err, flag)


def test_a_row_cache_too_small_for_a_row_is_refused_before_the_work(cli, tiny_checkpoint, text_file, monkeypatch):
    """The row cache's least size depends on the model and the pool (a map of the pool's rows per layer): known
    once the model's config is, and checked then, before compiling or running anything."""
    import infinigen.commands.bench as bench_cmd

    def refuse(*a, **k):
        raise AssertionError("bench went on to compile before the row cache's size was checked")
    monkeypatch.setattr(bench_cmd, "enable_compile", refuse)
    code, _, err = cli("bench", "--model", tiny_checkpoint, "--text", text_file, "--policy", "full", "--prompt-len",
                       "16", "--gen-len", "2", "--batch-size", "1,2", "--no-ideal", "--no-transformers",
                       "--kv-offload", "cpu", "--row-cache-bytes", "64")
    one_line_error(code, err, "row cache of 64 bytes holds no row")


@pytest.mark.parametrize("argv, needle", [
    (["--prefix-cache-dir-bytes", "1G"], "needs --prefix-cache-dir"),
    (["--no-prefix-cache", "--prefix-cache-bytes", "1G"], "--no-prefix-cache turns off"),
    (["--no-prefix-cache", "--prefix-cache-dir", "."], "--no-prefix-cache turns off")])
def test_a_prefix_cache_size_that_would_be_ignored_is_refused(cli, tiny_checkpoint, no_serving, argv, needle):
    one_line_error(*cli("serve", "--model", tiny_checkpoint, "--port", "0", *argv)[::2], needle)
