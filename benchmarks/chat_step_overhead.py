"""A batch-1 chat step's overhead around the native kernels: this checkout's compiled step against another
compiled.py (e.g. main's), side by side in one process.

    PYTHONPATH=src python benchmarks/chat_step_overhead.py --base FILE [--threads 1] [--steps 60] [--rounds 3]
        [--cpp] [--out results/compiled_step/chat_b1_overhead.json]

FILE: another version of src/infinigen/compiled.py (`git show main:src/infinigen/compiled.py > FILE`), imported as
a module of this package, so both run the same runtime, kernels and model. Per round: a full-cache session of the
default model (its defaults: bfloat16, the GGUF's int4 weights) per variant over the same 512-token prompt, each
with its own `StepParts`, warmed, then greedy steps alternating (A B, B A, ...). Reported per variant and round: the
median of the calling thread's CPU time per step (at one thread all of a step's work), the median wall time, the
aten calls of one step (torch profiler), and whether every step's logits equal the base's bit for bit. `--cpp`
adds this checkout's StepParts with Inductor's C++ wrapper.
"""
from __future__ import annotations

import argparse
import importlib.util
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
from infinigen.bench.runners import aten_calls  # noqa: E402
from infinigen.bench.side_by_side import staggered_prompts, text_ids  # noqa: E402
from infinigen.placement import Placement  # noqa: E402
from infinigen.policies import make_policy  # noqa: E402

PROMPT = 512


def _load() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def one_round(model, tok, variants: dict, steps: int) -> dict:
    prompts = staggered_prompts(text_ids(tok), PROMPT, 1)
    sessions, tokens, warm = {}, {}, {}
    cpu = {k: [] for k in variants}
    wall = {k: [] for k in variants}
    logits = {k: [] for k in variants}
    load_before = _load()
    with torch.inference_mode():
        for name, parts in variants.items():
            model.step_parts = None
            sessions[name] = Placement().new_session(model, 1, PROMPT + steps + 8, make_policy("full"))
            tokens[name] = runtime.prefill(model, prompts, sessions[name]).argmax(-1)
            warm[name] = round(parts.warm(model, 1), 1)
        try:
            order = list(variants)
            for i in range(steps + 2):
                for name in (order if i % 2 else order[::-1]):
                    model.step_parts = variants[name]
                    c, w = time.thread_time(), time.perf_counter()
                    out = runtime.decode(model, tokens[name], sessions[name])
                    tokens[name] = out.argmax(-1)
                    c, w = time.thread_time() - c, time.perf_counter() - w
                    if i >= 2:  # the first two steps find the parts (and the plan)
                        cpu[name].append(c)
                        wall[name].append(w)
                        logits[name].append(out.clone())
            ops = {}
            for name, parts in variants.items():
                model.step_parts = parts
                ops[name] = aten_calls(model, sessions[name], tokens[name])[0]
        finally:
            model.step_parts = None
    row = {"load_before": load_before, "load_after": _load()}
    for name in variants:
        row[name] = {"cpu_ms": round(1e3 * statistics.median(cpu[name]), 3),
                     "wall_ms": round(1e3 * statistics.median(wall[name]), 3), "aten_calls": ops[name],
                     "warm_s": warm[name], "failed": variants[name].failed,
                     "logits_equal_base": all(torch.equal(a, b) for a, b in zip(logits[name], logits["base"]))}
    for name in list(variants)[1:]:
        row[f"{name}_over_base_cpu"] = round(row[name]["cpu_ms"] / row["base"]["cpu_ms"], 4)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="another compiled.py, run beside as \"base\"")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpp", action="store_true", help="also this checkout's step with Inductor's C++ wrapper")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "compiled_step" / "chat_b1_overhead.json")
    a = ap.parse_args(argv)
    spec = importlib.util.spec_from_file_location("infinigen._compiled_base", a.base)
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    torch.set_num_threads(a.threads)
    model, tok, name = infinigen.load("default", dtype="auto", weights="auto")
    report = {"model": name, "torch": torch.__version__, "threads": a.threads, "steps": a.steps, "rounds": []}
    for _ in range(a.rounds):
        variants = {"base": base.StepParts(), "this": compiled.StepParts()}
        if a.cpp:
            variants["this_cpp"] = compiled.StepParts(cpp_wrapper=True)
        row = one_round(model, tok, variants, a.steps)
        print(json.dumps(row), flush=True)
        report["rounds"].append(row)
    for name in [k for k in report["rounds"][0] if k.endswith("_over_base_cpu")]:
        report[f"median_{name}"] = statistics.median(r[name] for r in report["rounds"])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k.startswith("median_")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
