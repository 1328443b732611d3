"""A compiled decoding step with Inductor's C++ wrapper against its Python wrapper (and optionally against another
version of compiled.py), side by side in one process.

    PYTHONPATH=src python benchmarks/step_wrapper.py [--threads 1,2] [--batches 1,4] [--steps 40]
        [--base FILE] [--no-cpp] [--out results/compiled_step/step_wrapper.json]

For each thread count and batch: full-cache sessions of a 512-token prompt (the default model, its defaults),
each with its own `compiled.StepParts`: "python" (this checkout, Python wrapper), "cpp" (this checkout,
`cpp_wrapper=True`) and, with --base, "base" (the StepParts of FILE, e.g. `git show main:src/infinigen/compiled.py`,
imported as a module of this package), decoding greedily, their steps alternating. Medians per step: wall ms,
the calling thread's CPU ms (at one thread all of the step's work), the ms inside the compiled calls, in the head,
and the rest (Python and eager calls between); /proc/loadavg before and after each run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

import infinigen  # noqa: E402
from infinigen import compiled, runtime  # noqa: E402
from infinigen.bench.side_by_side import staggered_prompts, text_ids  # noqa: E402
from infinigen.placement import Placement  # noqa: E402
from infinigen.policies import make_policy  # noqa: E402

VARIANTS = {"python": {"cpp_wrapper": False}, "cpp": {"cpp_wrapper": True}}
BASE = None  # the module of --base


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def _timed(fn, into: dict):
    def call(*args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            into["compiled"] += time.perf_counter() - t
    return call


def steps(model, tok, batch: int, count: int) -> dict:
    prompts = staggered_prompts(text_ids(tok), 512, batch)
    sessions, tokens, parts, compile_s = {}, {}, {}, {}
    spent = {k: {"compiled": 0.0, "head": 0.0} for k in VARIANTS}
    rows = {k: {"wall": [], "cpu": [], "compiled": [], "head": []} for k in VARIANTS}
    head, current = model.head, {"variant": "python"}

    def timed_head(h):
        t = time.perf_counter()
        try:
            return head(h)
        finally:
            spent[current["variant"]]["head"] += time.perf_counter() - t

    load_before = _load()
    with torch.inference_mode():
        for name, cpp in VARIANTS.items():
            model.step_parts = None
            sessions[name] = Placement().new_session(model, batch, 512 + count + 8, make_policy("full"))
            tokens[name] = runtime.prefill(model, prompts, sessions[name]).argmax(-1)
            parts[name] = BASE.StepParts() if name == "base" else compiled.StepParts(**cpp)
            compile_s[name] = round(parts[name].warm(model, batch), 1)
        model.head = timed_head
        try:
            for i in range(count + 2):
                for name in (list(VARIANTS) if i % 2 else list(VARIANTS)[::-1]):
                    current["variant"] = name
                    p = model.step_parts = parts[name]
                    if i == 1:  # compiled for these inputs by now: time each compiled call from here on
                        for key, (fn, names) in list(p._parts.items()):
                            p._parts[key] = (_timed(fn, spent[name]), names)
                        for seen in p._keys.values():  # the parts each input layout found: found again
                            if isinstance(seen, list):
                                seen[3] = None
                    spent[name]["compiled"] = spent[name]["head"] = 0.0
                    t, c = time.perf_counter(), time.thread_time()
                    tokens[name] = runtime.decode(model, tokens[name], sessions[name]).argmax(-1)
                    wall, cpu = time.perf_counter() - t, time.thread_time() - c
                    if i >= 2:
                        for key, v in (("wall", wall), ("cpu", cpu), *spent[name].items()):
                            rows[name][key].append(v)
        finally:
            del model.head
            model.step_parts = None
    out = {"batch": batch, "steps": count, "load_before": load_before, "load_after": _load()}
    for name in VARIANTS:
        med = {key: 1e3 * statistics.median(v) for key, v in rows[name].items()}
        out[name] = {**{f"{key}_ms": round(v, 2) for key, v in med.items()},
                     "rest_ms": round(med["wall"] - med["compiled"] - med["head"], 2),
                     "tok_s": round(1e3 * batch / med["wall"], 1), "compile_s": compile_s[name],
                     "wrappers": getattr(parts[name], "wrappers", None),
                     "cpp_failed": getattr(parts[name], "cpp_failed", None),
                     "failed": parts[name].failed}
    for name in list(VARIANTS)[1:]:
        out[f"{name}_over_python_wall"] = round(out[name]["wall_ms"] / out["python"]["wall_ms"], 3)
        out[f"{name}_over_python_cpu"] = round(out[name]["cpu_ms"] / out["python"]["cpu_ms"], 3)
    out["same_last_tokens"] = [bool(torch.equal(tokens[n], tokens["python"])) for n in VARIANTS]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--base", type=Path, help="another compiled.py whose StepParts runs beside (as \"base\")")
    ap.add_argument("--no-cpp", action="store_true", help="leave out the C++ wrapper's variant (its compile is long)")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "compiled_step" / "step_wrapper.json")
    a = ap.parse_args(argv)
    if a.no_cpp:
        del VARIANTS["cpp"]
    if a.base is not None:
        global BASE
        import importlib.util
        spec = importlib.util.spec_from_file_location("infinigen._compiled_base", a.base)
        BASE = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(BASE)
        VARIANTS["base"] = {}
    model, tok, name = infinigen.load("default", dtype="auto", weights="auto")
    report = {"model": name, "torch": torch.__version__, "runs": []}
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        for batch in (int(b) for b in a.batches.split(",")):
            run = {"threads": threads, **steps(model, tok, batch, a.steps)}
            print(json.dumps(run), flush=True)
            report["runs"].append(run)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
