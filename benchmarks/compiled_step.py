"""The compiled decoding step against the eager one, side by side in one process.

For each case (policy, prompt length, batch) three sessions of the same prompt decode in turn, one step each:
eager, with the compiled dense parts between eager attentions (`StepParts(whole=False)`), and with the whole
step where it may run whole (each layer's attention inside the compiled region, `StepParts.runs_whole`), so
all see the same machine load. Reported: the medians of the per-step times and decode tok/s, the ratios to
eager, the aten operator calls of one step (torch profiler: all aten events, and the top-level ones; a dispatch
mode: the operators dispatched from Python, what the step itself calls; Python function calls), the
compile time of each mode (cold or from Inductor's cache, as the run found it), whether the steps ran whole,
and whether the greedy tokens agreed with eager's.

    PYTHONPATH=src python benchmarks/compiled_step.py [--threads 2] [--steps 40] [--cases 512x1,512x4]
        [--policies full,infinigen] [--out results/compiled_step/compiled_step.md]

The whole step's attending parts take the cached length as a symbolic size: they are compiled once, in the
first case's warm-up, whatever lengths later steps reach; the compile log at the end shows what each part cost
(run with an empty TORCHINDUCTOR_CACHE_DIR for the cold compile, again for the one from Inductor's cache).
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
from infinigen.bench.dispatch import DispatchedCalls  # noqa: E402
from infinigen.bench.side_by_side import staggered_prompts, text_ids  # noqa: E402
from infinigen.placement import Placement  # noqa: E402
from infinigen.policies import make_policy  # noqa: E402


MODES = ("eager", "parts", "whole")


def aten_calls(model, session, tokens, parts) -> tuple[int, int, int, int]:
    """(all aten events, top-level aten events, aten operators dispatched, Python function calls) of a decoding
    step: the torch profiler over one step, a dispatch mode over the next, `sys.setprofile` over a third."""
    model.step_parts = parts
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runtime.decode(model, tokens, session)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    with DispatchedCalls() as counter:
        runtime.decode(model, tokens, session)
    python_calls = 0

    def count(frame, event, arg):
        nonlocal python_calls
        python_calls += event == "call"

    sys.setprofile(count)
    try:
        runtime.decode(model, tokens, session)
    finally:
        sys.setprofile(None)
    return len(events), len(top), counter.calls, python_calls


def run_case(model, tok, policy_name: str, prompt: int, batch: int, steps: int, parts: dict) -> dict:
    """`parts`: the StepParts of the compiled modes ("parts", "whole"), kept across cases (compiled once)."""
    prompts = staggered_prompts(text_ids(tok), prompt, batch)
    pol = make_policy(policy_name).prepare(model, tok)
    sessions, tokens, times = {}, {}, {mode: [] for mode in MODES}
    step_parts = {"eager": None, **parts}
    with torch.inference_mode():
        for mode in MODES:
            model.step_parts = None
            sessions[mode] = Placement().new_session(model, batch, prompt + steps + 8, pol)
            tokens[mode] = runtime.prefill(model, prompts, sessions[mode]).argmax(-1)
        seconds_before = {mode: p.compile_seconds for mode, p in parts.items()}
        warm_s = {}
        for mode, p in parts.items():
            t0 = time.perf_counter()
            p.warm(model, batch)
            warm_s[mode] = time.perf_counter() - t0
        agree = {mode: True for mode in parts}
        whole_steps = 0
        for _ in range(steps):
            whole_steps += parts["whole"].runs_whole(model, sessions["whole"])
            for mode, sess in sessions.items():
                model.step_parts = step_parts[mode]
                t = time.perf_counter()
                tokens[mode] = runtime.decode(model, tokens[mode], sess).argmax(-1)
                times[mode].append(time.perf_counter() - t)
            for mode in parts:
                agree[mode] &= bool(torch.equal(tokens["eager"], tokens[mode]))
        ops = {mode: aten_calls(model, sess, tokens[mode], step_parts[mode]) for mode, sess in sessions.items()}
    model.step_parts = None
    ms = {mode: 1e3 * statistics.median(v[3:]) for mode, v in times.items()}
    row = {"policy": policy_name, "prompt": prompt, "batch": batch, "steps": steps, "whole_steps": whole_steps}
    for mode in MODES:
        row[f"{mode}_ms"] = round(ms[mode], 2)
        row[f"{mode}_tok_s"] = round(1e3 * batch / ms[mode], 1)
        row[f"{mode}_aten"], row[f"{mode}_aten_top"], row[f"{mode}_dispatched"], row[f"{mode}_python_calls"] = ops[mode]
    for mode in parts:
        row[f"{mode}_speedup"] = round(ms["eager"] / ms[mode], 3)
        row[f"{mode}_compile_s"] = round(parts[mode].compile_seconds - seconds_before[mode], 1)
        row[f"{mode}_warm_s"] = round(warm_s[mode], 1)
        row[f"{mode}_same_tokens"] = agree[mode]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--cases", default="512x1,512x4", help="PROMPTxBATCH, comma separated")
    ap.add_argument("--policies", default="full,infinigen")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "compiled_step" / "compiled_step.md")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, tok, name = infinigen.load("default", dtype="auto", weights="auto")
    parts = {"parts": compiled.StepParts(whole=False), "whole": compiled.StepParts()}
    rows = []
    for case in a.cases.split(","):
        prompt, batch = (int(x) for x in case.split("x"))
        for pol in a.policies.split(","):
            row = run_case(model, tok, pol, prompt, batch, a.steps, parts)
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    compiles = ", ".join(f"{part} {sec:.1f} s" for part, sec in parts["whole"].compile_log)
    lines = [f"# The compiled decoding step against the eager one ({name}, {a.threads} threads)", "",
             f"`{' '.join(['python benchmarks/compiled_step.py'] + (argv if argv is not None else sys.argv[1:]))}`, "
             f"{time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, load average after the run {load}; "
             "the three steps interleaved in one process (medians of per-step times); aten calls counted by the "
             "torch profiler over one step. parts: the compiled dense parts between eager attentions; whole: "
             "each layer's attention inside the compiled region where the step may run whole.", "",
             "| policy | prompt x batch | eager ms/step | parts ms/step | whole ms/step | tok/s eager / parts / whole "
             "| speedup parts, whole | aten calls eager / parts / whole (top-level) | dispatched eager / parts / whole "
             "| Python calls eager / parts / whole | steps whole | same tokens parts, whole |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tok_s = " / ".join(f"{r[f'{mode}_tok_s']:.1f}" for mode in MODES)
        lines.append(f"| {r['policy']} | {r['prompt']} x {r['batch']} | {r['eager_ms']:.1f} | {r['parts_ms']:.1f} | "
                     f"{r['whole_ms']:.1f} | {tok_s} | "
                     f"{r['parts_speedup']:.2f}x, {r['whole_speedup']:.2f}x | {r['eager_aten']} / {r['parts_aten']} / "
                     f"{r['whole_aten']} ({r['eager_aten_top']} / {r['parts_aten_top']} / {r['whole_aten_top']}) | "
                     f"{r['eager_dispatched']} / {r['parts_dispatched']} / {r['whole_dispatched']} | "
                     f"{r['eager_python_calls']} / {r['parts_python_calls']} / {r['whole_python_calls']} | "
                     f"{r['whole_steps']}/{r['steps']} | {r['parts_same_tokens']}, {r['whole_same_tokens']} |")
    lines += ["", f"Compiled for the whole step, part by part: {compiles or 'nothing (all from this process)'}."]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines) + "\n")
    a.out.with_suffix(".json").write_text(json.dumps({"model": name, "threads": a.threads, "load": load, "rows": rows,
                                                      "whole_compile_log": parts["whole"].compile_log}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
