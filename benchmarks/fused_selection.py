"""A decoding step with the fused selecting layer (`kernels/fused_select`: `select_packed` from the 4-bit scores
to the packed rows and the remainder's log-sum-exp, then `attend_rows` over those rows) against the torch path
(`_choose`, `select_rows`, `remainder_lse`, `gather_rows` + head mask + `attend_masked`), the fused attention
alone (the selection in torch) and the full cache, side by side in one process: default model and dtype, KV in
fast memory, one shared prefill per cell (`eval.fanout.prefill_shared`), the systems' steps interleaved
A B C ... C B A so that a shared CPU's load falls on each alike; the first step is left out. Per system: median
and min ms/step, the aten operator calls of one step (torch profiler: all aten events and the top-level ones),
the operators that took the most self time in that step, and whether the InfiniGen paths decoded the same greedy tokens.

    PYTHONPATH=src python benchmarks/fused_selection.py --cells 512x1,8176x8 --gen 12 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import infinigen
from infinigen import runtime
from infinigen.bench.side_by_side import (interleaved_decode, parse_cells, per_block_breakdown, staggered_prompts,
                                          text_ids)
from infinigen.eval.fanout import prefill_shared
from infinigen.kernels import fused_select
from infinigen.policies import make_policy

NAMES = ["full", "infinigen torch", "infinigen fused attention", "infinigen fused selection+attention"]
FUSED = [(True, True), (False, False), (True, False), (True, True)]  # (attention fused, selection fused)


def _use_paths(system: int) -> None:
    """The kernel paths system `system` decodes with (FUSED)."""
    fused_select.enabled, fused_select.packs_selection = FUSED[system]


def _profiled(model, token, session, top: int):
    """One step under the torch profiler: (all aten events, top-level aten events, the `top` operators by
    self CPU time as (name, calls, self ms))."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = runtime.decode(model, token, session)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top_level = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    table = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    ops = [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in table]
    return out, len(events), len(top_level), ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="512x1,4096x4", help="PROMPTxBATCH, comma separated")
    ap.add_argument("--gen", type=int, default=12, help="decoding steps per system (the first is not timed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this thread's CPU time per step (needs --threads 1), for a machine other jobs load")
    ap.add_argument("--top", type=int, default=12, help="operators listed per profiled step")
    ap.add_argument("--breakdown", type=int, default=0,
                    help="then this many instrumented steps per system: the per-block breakdown (placement.timing)")
    ap.add_argument("--calibrate", action="store_true",
                    help="calibrate the default preset first (slow where it is not cached); else its starting values")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.clock == "cpu" and a.threads != 1:
        raise SystemExit("--clock cpu measures one thread: use --threads 1")
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    torch.set_num_threads(a.threads)
    if not fused_select.available():
        raise SystemExit("the fused kernel is unavailable here: nothing to compare")
    model, tok, _ = infinigen.load("default", dtype="auto", weights="auto", progress=False)
    ids = text_ids(tok)
    rows = []
    for length, batch in parse_cells(a.cells):
        tokens = staggered_prompts(ids, length, batch)
        knobs = {"dense_below": 0} if a.calibrate else {"calibrate": False, "dense_below": 0}
        pols = [make_policy("full")] + [make_policy("infinigen", **knobs).prepare(model, tok) for _ in NAMES[1:]]
        logits, sessions = prefill_shared(model, tokens, pols, length + a.gen + a.breakdown + 2)
        for s in sessions:
            s.stats.reset()
        times, generated, nxt = interleaved_decode(model, logits.argmax(-1), sessions, a.gen - 1, clock, _use_paths)
        with torch.inference_mode():
            profiles = []
            for i, s in enumerate(sessions):
                _use_paths(i)
                out, n_all, n_top, ops = _profiled(model, nxt[i], s, a.top)
                nxt[i] = out.argmax(-1)
                profiles.append((n_all, n_top, ops))
            breakdowns = [None] * len(pols)
            if a.breakdown:
                for i, s in enumerate(sessions):
                    _use_paths(i)
                    breakdowns[i], nxt[i] = per_block_breakdown(model, s, nxt[i], a.breakdown)
        fused_select.enabled, fused_select.packs_selection = True, True
        same = generated[1] == generated[2] == generated[3]
        print(f"{length:5d} x {batch}  the InfiniGen paths decode the same greedy tokens: {same}", flush=True)
        for i, (system, ts) in enumerate(zip(NAMES, times)):
            n_all, n_top, ops = profiles[i]
            row = dict(system=system, prompt=length, batch=batch, ms_median=round(statistics.median(ts[1:]), 2),
                       ms_min=round(min(ts[1:]), 2), clock=a.clock, threads=a.threads,
                       aten_calls=n_all, aten_calls_top=n_top, top_ops=ops,
                       rel_kv=sessions[i].stats.overall(), per_block_ms=breakdowns[i], same_tokens=same)
            rows.append(row)
            print(f"{length:5d} x {batch}  {system:22s} median {row['ms_median']:8.1f} ms/step"
                  f"  min {row['ms_min']:8.1f}"
                  f"  aten calls {n_all} (top-level {n_top})  relative KV {row['rel_kv']:.3f}", flush=True)
            print("      " + "; ".join(f"{n} x{c} {ms} ms" for n, c, ms in ops), flush=True)
            if breakdowns[i]:
                print("      per-block ms: " + ", ".join(f"{k} {v:.2f}" for k, v in breakdowns[i].items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
