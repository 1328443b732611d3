"""The compiled decoding step against the eager one, side by side in one process.

For each case (policy, prompt length, batch) two sessions of the same prompt decode in turn, one step each,
one with the compiled step (`infinigen.compiled`) and one eager, so both see the same machine load; the
medians of the per-step times are reported with their ratio, the aten operator calls of one step (torch
profiler: all aten events, and the top-level ones), the compile time (cold or from Inductor's cache, as the
run found it) and whether the greedy tokens agreed.

    PYTHONPATH=src python benchmarks/compiled_step.py [--threads 2] [--steps 40] [--cases 512x1,512x4]
        [--policies full,infinigen] [--out results/compiled_step/compiled_step.md]
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


def aten_calls(model, session, token, parts) -> tuple[int, int]:
    """(all aten events, top-level aten events) of one decoding step."""
    model.step_parts = parts
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runtime.decode(model, token, session)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return len(events), len(top)


def run_case(model, tok, policy_name: str, prompt: int, batch: int, steps: int, parts) -> dict:
    prompts = staggered_prompts(text_ids(tok), prompt, batch)
    pol = make_policy(policy_name).prepare(model, tok)
    sessions, tokens, times = {}, {}, {"eager": [], "compiled": []}
    with torch.inference_mode():
        for mode in times:
            model.step_parts = None
            sessions[mode] = Placement().new_session(model, batch, prompt + steps + 8, pol)
            tokens[mode] = runtime.prefill(model, prompts, sessions[mode]).argmax(-1)
        t0 = time.perf_counter()
        seconds_before = parts.compile_seconds
        parts.warm(model, batch)
        warm_s = time.perf_counter() - t0
        agree = True
        for _ in range(steps):
            for mode, sess in sessions.items():
                model.step_parts = parts if mode == "compiled" else None
                t = time.perf_counter()
                tokens[mode] = runtime.decode(model, tokens[mode], sess).argmax(-1)
                times[mode].append(time.perf_counter() - t)
            agree &= bool(torch.equal(tokens["eager"], tokens["compiled"]))
        ops = {mode: aten_calls(model, sess, tokens[mode], parts if mode == "compiled" else None)
               for mode, sess in sessions.items()}
    model.step_parts = None
    ms = {mode: 1e3 * statistics.median(v[3:]) for mode, v in times.items()}
    return {"policy": policy_name, "prompt": prompt, "batch": batch, "steps": steps,
            "eager_ms": round(ms["eager"], 2), "compiled_ms": round(ms["compiled"], 2),
            "speedup": round(ms["eager"] / ms["compiled"], 3),
            "eager_aten": ops["eager"][0], "compiled_aten": ops["compiled"][0],
            "eager_aten_top": ops["eager"][1], "compiled_aten_top": ops["compiled"][1],
            "compile_s": round(parts.compile_seconds - seconds_before, 1), "warm_s": round(warm_s, 1),
            "same_tokens": agree}


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
    parts = compiled.StepParts()
    rows = []
    for case in a.cases.split(","):
        prompt, batch = (int(x) for x in case.split("x"))
        for pol in a.policies.split(","):
            row = run_case(model, tok, pol, prompt, batch, a.steps, parts)
            print(json.dumps(row), flush=True)
            rows.append(row)
    lines = [f"# The compiled decoding step against the eager one ({name}, {a.threads} threads)", "",
             f"`{' '.join(['python benchmarks/compiled_step.py'] + (argv if argv is not None else sys.argv[1:]))}`, "
             f"{time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}; both steps interleaved in one process "
             "(medians of per-step times); aten calls counted by the torch profiler over one step.", "",
             "| policy | prompt x batch | eager ms/step | compiled ms/step | speedup | aten calls eager -> compiled "
             "(top-level) | compile s | same tokens |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['prompt']} x {r['batch']} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['eager_aten']} -> {r['compiled_aten']} ({r['eager_aten_top']} -> "
                     f"{r['compiled_aten_top']}) | {r['compile_s']:.1f} | {r['same_tokens']} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines) + "\n")
    a.out.with_suffix(".json").write_text(json.dumps({"model": name, "threads": a.threads, "rows": rows}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
