"""The native weight kernels (kernels/int4_gemv.cpp) of this checkout against those of another git revision, side by
side in one process: GB/s of weight bytes per call at each batch-1 shape of the default model (SmolLM2-135M) and
the output table, rounds alternating between the two builds.

    PYTHONPATH=src python benchmarks/weight_kernels_micro.py [--base HEAD] [--threads 1,2] [--rows 1,4]
        [--rounds 30] [--layers 30]

The base revision's source is built under another op namespace (`infinigen_base`), so both load in one process.
Each round calls the `--layers` copies of a shape in turn (random codes and scales: the bytes, not the values,
are the time), so the weights come from memory as in a decoding step. Prints a markdown table: median wall
microseconds per call, the calling thread's CPU microseconds, GB/s (codes + scales over wall), and /proc/loadavg.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

from infinigen.kernels import int4_gemv  # noqa: E402
from infinigen.kernels.native_build import load_library  # noqa: E402
from infinigen.kernels.qlinear import Int4Linear, Int8Linear  # noqa: E402

SHAPES = {"qkv 960x576": (960, 576), "o 576x576": (576, 576), "gate_up 3072x576": (3072, 576),
          "down 576x1536": (576, 1536)}
HEAD = (49152, 576)


def base_ops(rev: str):
    """The base revision's kernels, built under the namespace `infinigen_base`."""
    text = subprocess.run(["git", "show", f"{rev}:src/infinigen/kernels/int4_gemv.cpp"], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout
    text = text.replace("TORCH_LIBRARY_FRAGMENT(infinigen,", "TORCH_LIBRARY_FRAGMENT(infinigen_base,")
    text = text.replace("TORCH_LIBRARY_IMPL(infinigen,", "TORCH_LIBRARY_IMPL(infinigen_base,")
    folder = Path(tempfile.mkdtemp(prefix="weight_kernels_base_"))
    for header in (REPO / "src/infinigen/kernels").glob("*.h"):
        (folder / header.name).write_bytes(header.read_bytes())
    source = folder / "int4_gemv_base.cpp"
    source.write_text(text)
    if not load_library("int4_gemv_base", source):
        raise SystemExit("the base revision's kernels did not build")
    return torch.ops.infinigen_base


def int4_modules(n: int, k: int, layers: int) -> list:
    g = torch.Generator().manual_seed(n + k)
    out = []
    for _ in range(layers):
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        scale = torch.rand(n, k // 32, generator=g) / 8 + 0.01
        zero = torch.randn(n, k // 32, generator=g) / 4
        out.append(Int4Linear.from_codes(codes, scale, zero, torch.bfloat16))
    return out


def timed(call, items, rounds: int, names) -> dict:
    wall = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 else names[::-1]):
            t, c = time.perf_counter(), time.thread_time()
            for item in items:
                call(name, item)
            wall[name].append((time.perf_counter() - t) / len(items))
            cpu[name].append((time.thread_time() - c) / len(items))
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in names}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    ops = {"base": base_ops(args.base), "new": None}
    assert int4_gemv.available(torch.bfloat16)
    ops["new"] = torch.ops.infinigen
    names = ("base", "new")
    print("| threads | rows | call | base us wall / cpu | new us wall / cpu | base GB/s | new GB/s | new/base wall "
          "| loadavg |")
    print("|---|---|---|---|---|---|---|---|---|")
    kinds = {label: int4_modules(n, k, args.layers) for label, (n, k) in SHAPES.items()}
    g = torch.Generator().manual_seed(1)
    head = Int8Linear.quantize(torch.randn(*HEAD, generator=g), torch.bfloat16)
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for rows in [int(r) for r in args.rows.split(",")]:
            for label, mods in list(kinds.items()) + [("head int8 49152x576", [head])]:
                x = torch.randn(rows, mods[0].in_features, generator=g).bfloat16()
                if isinstance(mods[0], Int8Linear):
                    nbytes = head.qweight.numel() + head.scales.numel() * 2

                    def call(name, m, x=x):
                        ops[name].int8_gemv(x, m.qweight, m.scales)
                    rounds = max(args.rounds // 3, 5)
                else:
                    nbytes = mods[0].packed.numel() + mods[0].scale_zero.numel() * 2

                    def call(name, m, x=x):
                        ops[name].int4_gemv(x, m.packed, m.group, m.scale_zero)
                    rounds = args.rounds
                for name in names:  # warm both builds and check they agree
                    call(name, mods[0])
                got = timed(call, mods, rounds, names)
                load = Path("/proc/loadavg").read_text().split()[:3]
                (bw, bc), (nw, nc) = got["base"], got["new"]
                print(f"| {threads} | {rows} | {label} | {bw * 1e6:.1f} / {bc * 1e6:.1f} | {nw * 1e6:.1f} / "
                      f"{nc * 1e6:.1f} | {nbytes / bw / 1e9:.1f} | {nbytes / nw / 1e9:.1f} | {nw / bw:.2f} | "
                      f"{' '.join(load)} |", flush=True)


if __name__ == "__main__":
    main()
