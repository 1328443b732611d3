"""Speculation plus selection (`fused_select.score_select`) of two builds of the native kernel side by side, on a real
decoding step's inputs: the default model prefilled at `--length` x `--batch` with InfiniGen selecting at every layer
(dense_below=0), each layer's score_select arguments of the first decoding step captured once into `--capture` (a
.pt file, reused when it exists); then each source directory's fused_select.cpp (with its headers) built as its own
module, and the captured calls of every layer timed in interleaved rounds (A B B A ...), this thread's CPU time, one
thread unless `--threads` (a build without `score_select`: its `score_int4` then `select_packed`); each build's
`score_int4` alone beside it (the scores without the selection). Each build's outputs are compared with the
first's (the same selections, to the bit).

    PYTHONPATH=src python benchmarks/score_select_micro.py --src /tmp/main/src/infinigen/kernels \
        --src src/infinigen/kernels --length 8176 --batch 8
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import infinigen
from infinigen import runtime
from infinigen.bench.side_by_side import staggered_prompts, text_ids
from infinigen.eval.fanout import prefill_shared
from infinigen.kernels import fused_select, native_build
from infinigen.policies import make_policy


def capture(path: Path, length: int, batch: int) -> list:
    """Every layer's score_select arguments of one decoding step (positional, part_slots resolved)."""
    torch.set_num_threads(2)
    model, tok, _ = infinigen.load("default", dtype="auto", weights="auto", progress=False)
    tokens = staggered_prompts(text_ids(tok), length, batch)
    policy = make_policy("infinigen", dense_below=0).prepare(model, tok)
    logits, (session,) = prefill_shared(model, tokens, [policy], length + 4)
    calls = []
    inner = fused_select.score_select

    def record(q, codes, sz, group, n, scale, alpha, total, capacity, with_lse, rotation=None, part_slots=None):
        calls.append((q.clone(), codes.clone(), sz.clone(), int(group), int(n),
                      int(part_slots or fused_select.SLOTS_PER_PART),
                      fused_select._NONE if rotation is None else rotation.clone(), float(scale), float(alpha),
                      int(total), int(capacity), bool(with_lse)))
        return inner(q, codes, sz, group, n, scale, alpha, total, capacity, with_lse, rotation, part_slots)

    fused_select.score_select = record
    with torch.inference_mode():
        runtime.decode(model, logits.argmax(-1), session)
    fused_select.score_select = inner
    session.store.close()
    torch.save(calls, path)
    return calls


def build(src: Path, name: str):
    """fused_select.cpp and its headers of `src` built as module `name`."""
    work = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    for f in src.iterdir():
        if f.suffix in (".cpp", ".h"):
            shutil.copy(f, work / f.name)
    module = native_build.load(name, work / "fused_select.cpp", python_module=True)  # copies them into its build
    shutil.rmtree(work)
    if module is None:
        sys.exit(f"{src}: the build failed")
    return module


def score_select(module, call):
    """The build's score_select of one captured call, or score_int4 then select_packed where it has no one call."""
    if hasattr(module, "score_select"):
        return module.score_select(*call)
    q, codes, sz, group, n, part_slots, rotation, scale, alpha, total, capacity, with_lse = call
    scores = module.score_int4(q, codes, sz, group, n, part_slots, rotation)
    return module.select_packed(scores, scale, alpha, total, capacity, with_lse)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, action="append", required=True, help="a kernels directory (twice or more)")
    ap.add_argument("--length", type=int, default=8176)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--capture", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    for s in a.src:
        if not (s / "fused_select.cpp").is_file():
            sys.exit(f"{s}: no fused_select.cpp there")
    path = a.capture or Path(tempfile.gettempdir()) / f"score_select_{a.length}x{a.batch}.pt"
    calls = torch.load(path) if path.exists() else capture(path, a.length, a.batch)
    torch.set_num_threads(a.threads)
    modules = [build(s, f"fused_select_ab{i}") for i, s in enumerate(a.src)]
    first = [score_select(modules[0], c) for c in calls]
    for i, m in enumerate(modules[1:], 1):
        for c, ref in zip(calls, first):
            out = score_select(m, c)
            for x, y in zip(out, ref):
                if not torch.equal(x, y):
                    sys.exit(f"build {i} differs from build 0 ({a.src[i]})")
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    times, scoring = [[] for _ in modules], [[] for _ in modules]
    for r in range(a.rounds):
        for i in range(len(modules)) if r % 2 == 0 else reversed(range(len(modules))):
            t0 = clock()
            for c in calls:
                score_select(modules[i], c)
            times[i].append(1e3 * (clock() - t0) / len(calls))
            t0 = clock()
            for c in calls:
                modules[i].score_int4(*c[:7])
            scoring[i].append(1e3 * (clock() - t0) / len(calls))
    with open("/proc/loadavg") as f:
        load = f.read().strip()
    kept = [int(out[3].sum()) for out in first]
    print(f"{a.length} x {a.batch}, {len(calls)} layers, {a.threads} thread(s), loadavg {load}; kept per layer "
          f"{min(kept)}..{max(kept)} of {a.batch * calls[0][0].shape[1] * calls[0][4]}")
    for s, ts, sc in zip(a.src, times, scoring):
        print(f"{str(s):50s} ms per layer median {statistics.median(ts):.3f} (scores alone "
              f"{statistics.median(sc):.3f})  {[round(t, 3) for t in ts]}")
    base = statistics.median(times[0])
    for s, ts in zip(a.src[1:], times[1:]):
        print(f"{str(s):50s} {statistics.median(ts) / base:.3f}x the first")


if __name__ == "__main__":
    main()
