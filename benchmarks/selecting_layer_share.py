"""Where a selecting step's time goes, and speculation plus selection as a share of dense attention per layer:
the full cache, the default InfiniGen and the same with `dense_below=0` (`--batch` above 1: the full cache and
`dense_below=0` alone, to hold two stores of the long case in memory, not three), prefilled once in one process, steps
interleaved; each native call of the latter's steps timed (`fused_select.*`, this thread's CPU time); dense attention
timed as `attend_all` over a real layer's used slots. One thread, so the times are CPU times a loaded machine's
preemption does not inflate.

    PYTHONPATH=src python benchmarks/selecting_layer_share.py --length 8176
    PYTHONPATH=src python benchmarks/selecting_layer_share.py --length 8176 --batch 8 --steps 4
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

import infinigen
from infinigen import runtime
from infinigen.bench.side_by_side import staggered_prompts, text_ids
from infinigen.commands.options import enable_compile
from infinigen.eval.fanout import prefill_shared
from infinigen.kernels import fused_select
from infinigen.policies import make_policy

NATIVE = ["score_select", "score_int4", "select_packed", "attend_rows", "scatter_int4", "append_token"]


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def _timed_native_calls() -> dict:
    """Wrap each native call of `fused_select` so that its CPU time is recorded: name -> [seconds]."""
    spent = defaultdict(list)
    for name in NATIVE:
        inner = getattr(fused_select, name, None)
        if inner is None:
            continue

        def timed(*args, _inner=inner, _name=name, **kwargs):
            t0 = time.thread_time()
            out = _inner(*args, **kwargs)
            spent[_name].append(time.thread_time() - t0)
            return out
        setattr(fused_select, name, timed)
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=8176)
    ap.add_argument("--steps", type=int, default=8, help="steps per system (the first is left out of the median)")
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok, _ = infinigen.load("default", dtype="auto", weights="auto", progress=False)
    enable_compile(model, "on", long_running=True, rows=[a.batch])
    tokens = staggered_prompts(text_ids(tok), a.length, a.batch)
    policies = [make_policy("full"), make_policy("infinigen").prepare(model, tok),
                make_policy("infinigen", dense_below=0).prepare(model, tok)]
    names = ["full cache", "InfiniGen (default)", "InfiniGen dense_below=0"]
    if a.batch > 1:
        del policies[1], names[1]
    logits, sessions = prefill_shared(model, tokens, policies, a.length + a.steps + 4)
    spent = _timed_native_calls()
    layers, selecting = model.cfg.num_layers, len(sessions) - 1
    last, times, per_layer = [logits.argmax(-1)] * len(sessions), [[] for _ in sessions], {}
    print("loadavg", _loadavg())
    with torch.inference_mode():
        for step in range(a.steps):
            for i in range(len(sessions)) if step % 2 == 0 else reversed(range(len(sessions))):
                for calls in spent.values():
                    calls.clear()
                t0 = time.thread_time()
                last[i] = runtime.decode(model, last[i], sessions[i]).argmax(-1)
                times[i].append(1e3 * (time.thread_time() - t0))
                if i == selecting:  # the native calls of the policy selecting at every length, ms per layer
                    per_layer = {k: 1e3 * sum(v) / layers for k, v in spent.items() if v}
        q = torch.randn(a.batch, model.cfg.num_heads, 1, model.cfg.head_dim, dtype=model.dtype)
        dense = []
        for _ in range(3):
            for layer in range(layers):
                k, v = sessions[0].store.used_keys_values(layer)
                t0 = time.thread_time()
                runtime.attend_all(q, k, v, model.scale)
                dense.append(1e3 * (time.thread_time() - t0))
    print("loadavg", _loadavg())
    for name, ts in zip(names, times):
        steps = [round(t, 1) for t in ts]
        print(f"{name:26s} ms/step (CPU, one thread) median {statistics.median(ts[1:]):.1f}  {steps}")
    print("KV read by InfiniGen:", [round(s.stats.overall(), 4) for s in sessions[1:]])
    print("native calls of dense_below=0, ms per layer:", {k: round(v, 3) for k, v in per_layer.items()},
          f"(x{layers}: {layers * sum(per_layer.values()):.1f} ms)")
    attention = statistics.median(dense)
    selection = sum(per_layer.get(k, 0.0) for k in ("score_select", "score_int4", "select_packed"))
    print(f"dense attention per layer (attend_all over {k.shape[2]} slots): {attention:.3f} ms; speculation + "
          f"selection {selection:.3f} ms = {100 * selection / attention:.0f}% of it; with the attention over the rows "
          f"{100 * (selection + per_layer.get('attend_rows', 0.0)) / attention:.0f}%")


if __name__ == "__main__":
    main()
