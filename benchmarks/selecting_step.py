"""One decoding step of the full cache and of InfiniGen selecting at every layer (dense_below=0), the same
prompts in one process (`eval.fanout.prefill_shared`), steps interleaved A B C C B A; InfiniGen twice: its native
kernels with a (batch row, KV head) one task ("whole runs", as at batch 8 where there are tasks enough) and cut
into parts that both threads share ("parts", the default: at batch 1 three KV heads are too few); then one step of
each under
the torch profiler (aten operators by self time) and one InfiniGen step under cProfile (where a step's time goes,
per Python function and native call). With --threads 1 the step times are this thread's CPU time, which other
jobs' preemption on a shared machine does not inflate (the profiled steps are wall time).

With --count, one more step of each under a dispatch mode: the aten operators it dispatches, by name and by the
function of the package that called them (where a batch-1 step's eager calls come from).

    PYTHONPATH=src python benchmarks/selecting_step.py --length 4096 --batch 8 --threads 1
    PYTHONPATH=src python benchmarks/selecting_step.py --length 8176 --batch 1 --threads 2
    PYTHONPATH=src python benchmarks/selecting_step.py --length 4096 --batch 1 --threads 1 --count
    PYTHONPATH=src python benchmarks/selecting_step.py --length 8176 --batch 1 --threads 1 --two-calls --no-profile
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import infinigen
from infinigen import runtime
from infinigen.bench.side_by_side import interleaved_decode, staggered_prompts, text_ids
from infinigen.commands.options import enable_compile
from infinigen.eval.fanout import prefill_shared
from infinigen.kernels import fused_select
from infinigen.policies import make_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5,
                    help="timed steps per system (the first is listed, not in the median)")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--count", action="store_true", help="count one step's dispatched operators, by name and caller")
    ap.add_argument("--no-profile", action="store_true", help="leave out the profiled steps")
    ap.add_argument("--two-calls", action="store_true",
                    help="the middle system scores and cuts in two native calls (`score_int4`, `select_packed`) "
                         "instead of whole runs: the one-call `score_select` against them")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok, _ = infinigen.load("default", dtype="auto", weights="auto", progress=False)
    print("compiled:", enable_compile(model, "on", long_running=True, rows=[a.batch]) or "no")
    tokens = staggered_prompts(text_ids(tok), a.length, a.batch)
    selecting = make_policy("infinigen", calibrate=False, dense_below=0).prepare(model, tok)
    pols = [make_policy("full"), selecting, selecting]
    names = ["full", "infinigen, two calls" if a.two_calls else "infinigen, whole runs", "infinigen, parts"]
    logits, sessions = prefill_shared(model, tokens, pols, a.length + a.steps + 4)
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    parts = (fused_select.ROWS_PER_PART, fused_select.SLOTS_PER_PART)

    def cut(i: int) -> None:  # the middle system: one task per (batch row, KV head), or scored and cut in two calls
        if a.two_calls:
            fused_select.scores_with_selection = i != 1
        else:
            fused_select.ROWS_PER_PART, fused_select.SLOTS_PER_PART = (1 << 40, 1 << 40) if i == 1 else parts
    with open("/proc/loadavg") as f:
        print("loadavg", f.read().strip())
    times, _, last = interleaved_decode(model, logits.argmax(-1), sessions, a.steps, clock, before=cut)
    cut(2)
    with open("/proc/loadavg") as f:
        print("loadavg", f.read().strip())
    full = statistics.median(times[0][1:])
    for name, ts in zip(names, times):
        mid = statistics.median(ts[1:])
        print(f"{name:22s} ms/step {[round(x, 1) for x in ts]}  median {mid:.1f}"
              f" ({'CPU' if a.threads == 1 else 'wall'}), {mid / full:.2f} of the full cache")
    if a.count:
        with torch.inference_mode():
            for i, name in [(0, "full"), (2, "infinigen")]:
                with CallersOf() as counter:
                    last[i] = runtime.decode(model, last[i], sessions[i]).argmax(-1)
                print(f"== {name}: {counter.calls} operators dispatched in one step")
                print("   by operator:", ", ".join(f"{op} {n}" for op, n in counter.by_op.most_common(a.top)))
                print("   by caller:  ", ", ".join(f"{f} {n}" for f, n in counter.callers.most_common(a.top)))
    if not a.no_profile:
        profiled(model, sessions, last, a.top)


class CallersOf(TorchDispatchMode):
    """While active: `calls`, the aten operators dispatched, `by_op` by name and `callers` by the function of the
    package that called them (the first frame in src/infinigen up the stack)."""

    def __init__(self):
        super().__init__()
        self.calls, self.by_op, self.callers = 0, Counter(), Counter()
        self.package = str(Path(infinigen.__file__).parent)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and not frame.f_code.co_filename.startswith(self.package):
            frame = frame.f_back
        where = "?" if frame is None else f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}"
        self.calls += 1
        self.by_op[str(func)] += 1
        self.callers[where] += 1
        return func(*args, **(kwargs or {}))


def profiled(model, sessions, last, top: int) -> None:
    """One step of the full cache and of InfiniGen under the torch profiler (aten operators by self time), then
    one InfiniGen step under cProfile."""
    with torch.inference_mode():
        for i, name in [(0, "full"), (2, "infinigen")]:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                last[i] = runtime.decode(model, last[i], sessions[i]).argmax(-1)
            table = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            print(f"== {name}: aten self time {sum(e.self_cpu_time_total for e in table) / 1e3:.1f} ms")
            for e in table[:top]:
                print(f"   {e.key:50s} x{e.count:5d} {e.self_cpu_time_total / 1e3:8.2f} ms")
        profile = cProfile.Profile()
        profile.enable()
        last[2] = runtime.decode(model, last[2], sessions[2]).argmax(-1)
        profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
