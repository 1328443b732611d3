"""One decoding step of the full cache and of InfiniGen selecting at every layer (dense_below=0), the same
prompts in one process (`eval.fanout.prefill_shared`), steps interleaved A B B A; then one step of each under
the torch profiler (aten operators by self time) and one InfiniGen step under cProfile (where a step's time goes,
per Python function and native call). With --threads 1 the step times are this thread's CPU time, which other
jobs' preemption on a shared machine does not inflate (the profiled steps are wall time).

    PYTHONPATH=src python benchmarks/selecting_step.py --length 4096 --batch 8 --threads 1
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

import infinigen
from infinigen import runtime
from infinigen.bench.side_by_side import interleaved_decode, staggered_prompts, text_ids
from infinigen.eval.fanout import prefill_shared
from infinigen.policies import make_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5,
                    help="timed steps per system (the first is listed, not in the median)")
    ap.add_argument("--top", type=int, default=18)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok, _ = infinigen.load("default", dtype="auto", weights="auto", progress=False)
    tokens = staggered_prompts(text_ids(tok), a.length, a.batch)
    pols = [make_policy("full"), make_policy("infinigen", calibrate=False, dense_below=0).prepare(model, tok)]
    logits, sessions = prefill_shared(model, tokens, pols, a.length + a.steps + 4)
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    times, _, last = interleaved_decode(model, logits.argmax(-1), sessions, a.steps, clock)
    with open("/proc/loadavg") as f:
        print("loadavg", f.read().strip())
    for name, ts in zip(["full", "infinigen"], times):
        print(f"{name:10s} ms/step {[round(x, 1) for x in ts]}  median {statistics.median(ts[1:]):.1f}"
              f" ({'CPU' if a.threads == 1 else 'wall'})")
    with torch.inference_mode():
        for i, name in enumerate(["full", "infinigen"]):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                last[i] = runtime.decode(model, last[i], sessions[i]).argmax(-1)
            table = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            print(f"== {name}: aten self time {sum(e.self_cpu_time_total for e in table) / 1e3:.1f} ms")
            for e in table[:a.top]:
                print(f"   {e.key:50s} x{e.count:5d} {e.self_cpu_time_total / 1e3:8.2f} ms")
        profile = cProfile.Profile()
        profile.enable()
        last[1] = runtime.decode(model, last[1], sessions[1]).argmax(-1)
        profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(a.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
