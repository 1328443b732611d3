"""Where a decoding step's time goes at batch 1 (and 4), and torch's int4 kernel against the native one
(kernels/int4_gemv), side by side in one process.

    PYTHONPATH=src python benchmarks/batch1_weights.py [--threads 1,2] [--steps 30] [--rounds 20]
        [--batches 1,4] [--base REV] [--out results/compiled_step/batch1_weights.json]

--base REV: the native kernels of git revision REV (built beside this checkout's, weight_kernels_micro.base_ops)
take the place of torch's, so the two native builds are compared side by side.

For each thread count:
- calls: each weight kind's call at batch 1 (the 30 layers' modules of that kind in turn, as a step reads them,
  so the weights come from memory), torch's `_weight_int4pack_mm_for_cpu` and `infinigen::int4_gemv` called
  straight as ops, alternating by round: microseconds per call (wall, and the calling thread's CPU time, which at
  one thread is all of it) and the weight bytes (codes and scales) read per second; the head (int8, its table
  once per call); the bandwidth floor: a float32 sum over as many bytes as a step's weights, and a copy of them.
- steps: a 512-token prompt per row, full cache, the compiled whole step, one `StepParts` traced with each kernel,
  steps alternating: ms/step, the thread's CPU time per step, the time inside the compiled calls, in the head,
  and the rest (Python and the eager calls between).
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
from infinigen.kernels import int4_gemv  # noqa: E402
from infinigen.placement import Placement  # noqa: E402
from infinigen.policies import make_policy  # noqa: E402

KERNELS = ["torch", "native"]  # --base: ["base", "native"]
_BASE = {}  # "ops": the base revision's op namespace (--base)
_NATIVE = {"int4": int4_gemv.int4_gemv, "int8": int4_gemv.int8_gemv}


def use_kernel(kernel: str) -> None:
    """The kernels `Int4Linear` and `Int8Linear` call from now on (and trace into a compiled step)."""
    int4_gemv.enabled = kernel != "torch"
    base = kernel == "base"
    int4_gemv.int4_gemv = (lambda x, p, g, sz: _BASE["ops"].int4_gemv(x, p, g, sz)) if base else _NATIVE["int4"]
    int4_gemv.int8_gemv = (lambda x, q, s: _BASE["ops"].int8_gemv(x, q, s)) if base else _NATIVE["int8"]


def load_base(rev: str) -> None:
    from weight_kernels_micro import base_ops

    _BASE["ops"] = base_ops(rev)
    torch.library.register_fake("infinigen_base::int4_gemv", lambda x, p, g, sz: x.new_empty(x.shape[0], p.shape[0]))
    torch.library.register_fake("infinigen_base::int8_gemv", lambda x, q, s: x.new_empty(x.shape[0], q.shape[0]))
    KERNELS[0] = "base"


def weight_kinds(model) -> dict:
    return {"qkv (joined)": [b.attn.qkv_proj for b in model.layers], "o": [b.attn.o_proj for b in model.layers],
            "gate_up (joined)": [b.mlp.gate_up_proj for b in model.layers],
            "down": [b.mlp.down_proj for b in model.layers]}


def _op(kernel: str):
    if kernel == "base":
        return _BASE["ops"].int4_gemv
    return torch.ops.aten._weight_int4pack_mm_for_cpu if kernel == "torch" else torch.ops.infinigen.int4_gemv


def call_times(modules, x, rounds: int) -> dict:
    """Per kernel: median wall and CPU seconds per call over rounds of one call per module."""
    wall = {k: [] for k in KERNELS}
    cpu = {k: [] for k in KERNELS}
    for r in range(rounds):
        for kernel in (KERNELS if r % 2 else KERNELS[::-1]):
            op = _op(kernel)
            t, c = time.perf_counter(), time.thread_time()
            for m in modules:
                op(x, m.packed, m.group, m.scale_zero)
            cpu[kernel].append((time.thread_time() - c) / len(modules))
            wall[kernel].append((time.perf_counter() - t) / len(modules))
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in KERNELS}


def calls(model, rounds: int) -> dict:
    out = {}
    dtype = model.dtype
    step_bytes = 0
    for kind, modules in weight_kinds(model).items():
        m = modules[0]
        x = torch.randn(1, m.in_features).to(dtype)
        got = _op(KERNELS[0])(x, m.packed, m.group, m.scale_zero).float()
        want = _op("native")(x, m.packed, m.group, m.scale_zero).float()
        nbytes = m.packed.numel() + m.scale_zero.numel() * m.scale_zero.element_size()
        step_bytes += nbytes * len(modules)
        times = call_times(modules, x, rounds)
        out[kind] = {"shape": [m.out_features, m.in_features], "bytes": nbytes,
                     "max_rel_diff": float((got - want).abs().max() / want.abs().max()),
                     **{f"{k}_us": round(1e6 * w, 1) for k, (w, _) in times.items()},
                     **{f"{k}_cpu_us": round(1e6 * c, 1) for k, (_, c) in times.items()},
                     **{f"{k}_gb_s": round(nbytes / w / 1e9, 2) for k, (w, _) in times.items()}}
    head = model.lm_head
    h = torch.randn(1, head.in_features).to(dtype)
    head_bytes = head.qweight.numel() + head.scales.numel() * head.scales.element_size()
    head_times = {k: {"wall": [], "cpu": []} for k in KERNELS}
    for r in range(rounds):
        for kernel in (KERNELS if r % 2 else KERNELS[::-1]):
            use_kernel(kernel)
            t, c = time.perf_counter(), time.thread_time()
            head(h)
            head_times[kernel]["wall"].append(time.perf_counter() - t)
            head_times[kernel]["cpu"].append(time.thread_time() - c)
    use_kernel("native")
    wall = {k: statistics.median(v["wall"]) for k, v in head_times.items()}
    out["head (int8)"] = {"shape": list(head.qweight.shape), "bytes": head_bytes,
                          **{f"{k}_us": round(1e6 * w, 1) for k, w in wall.items()},
                          **{f"{k}_cpu_us": round(1e6 * statistics.median(v["cpu"]), 1)
                             for k, v in head_times.items()},
                          **{f"{k}_gb_s": round(head_bytes / w / 1e9, 2) for k, w in wall.items()}}
    total = step_bytes + head_bytes
    src = torch.ones(total // 4)
    dst = torch.empty_like(src)
    sums, copies = [], []
    for _ in range(max(rounds // 2, 3)):
        t = time.perf_counter()
        src.sum()
        sums.append(time.perf_counter() - t)
        t = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t)
    out["floor"] = {"bytes": total, "sum_ms": round(1e3 * min(sums), 2), "sum_gb_s": round(total / min(sums) / 1e9, 2),
                    "copy_ms": round(1e3 * min(copies), 2), "copy_read_gb_s": round(total / min(copies) / 1e9, 2)}
    return out


def _timed(fn, into: dict, key: str):
    def call(*args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            into[key] += time.perf_counter() - t
    return call


def steps(model, tok, batch: int, count: int) -> dict:
    """Full-cache sessions of a 512-token prompt, one per kernel, each with its own compiled whole step; steps
    alternate. Medians per step: wall ms, CPU ms (calling thread), ms inside the compiled calls and in the head."""
    prompts = staggered_prompts(text_ids(tok), 512, batch)
    policy = make_policy("full")
    sessions, tokens, parts = {}, {}, {}
    spent = {k: {"compiled": 0.0, "head": 0.0} for k in KERNELS}
    rows = {k: {"wall": [], "cpu": [], "compiled": [], "head": []} for k in KERNELS}
    head = model.head
    current = {"kernel": KERNELS[0]}

    def timed_head(h):
        t = time.perf_counter()
        try:
            return head(h)
        finally:
            spent[current["kernel"]]["head"] += time.perf_counter() - t

    with torch.inference_mode():
        for kernel in KERNELS:
            use_kernel(kernel)
            model.step_parts = None
            sessions[kernel] = Placement().new_session(model, batch, 512 + count + 8, policy)
            tokens[kernel] = runtime.prefill(model, prompts, sessions[kernel]).argmax(-1)
            parts[kernel] = compiled.StepParts()
            parts[kernel].warm(model, batch)
        model.head = timed_head
        try:
            for i in range(count + 2):
                for kernel in (KERNELS if i % 2 else KERNELS[::-1]):
                    current["kernel"] = kernel
                    use_kernel(kernel)
                    p = model.step_parts = parts[kernel]
                    if i == 1:  # compiled for these inputs by now: time each compiled call from here on
                        for key, (fn, names) in list(p._parts.items()):
                            p._parts[key] = (_timed(fn, spent[kernel], "compiled"), names)
                    spent[kernel]["compiled"] = spent[kernel]["head"] = 0.0
                    t, c = time.perf_counter(), time.thread_time()
                    tokens[kernel] = runtime.decode(model, tokens[kernel], sessions[kernel]).argmax(-1)
                    wall, cpu = time.perf_counter() - t, time.thread_time() - c
                    if i >= 2:
                        for name, v in (("wall", wall), ("cpu", cpu), *spent[kernel].items()):
                            rows[kernel][name].append(v)
        finally:
            del model.head
            model.step_parts = None
            use_kernel("native")
    out = {"batch": batch, "steps": count}
    for kernel in KERNELS:
        med = {name: 1e3 * statistics.median(v) for name, v in rows[kernel].items()}
        out[kernel] = {**{f"{name}_ms": round(v, 2) for name, v in med.items()},
                       "rest_ms": round(med["wall"] - med["compiled"] - med["head"], 2),
                       "tok_s": round(1e3 * batch / med["wall"], 1), "failed": parts[kernel].failed}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--base", help="a git revision whose native kernels replace torch's")
    ap.add_argument("--skip-steps", action="store_true", help="the calls only")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "compiled_step" / "batch1_weights.json")
    a = ap.parse_args(argv)
    if a.base:
        load_base(a.base)
    model, tok, name = infinigen.load("default", dtype="auto", weights="auto")
    if not int4_gemv.available(model.dtype):
        raise SystemExit(f"no native int4 kernel for {model.dtype} on this machine")
    report = {"model": name, "torch": torch.__version__, "kernels": KERNELS, "base": a.base, "runs": []}
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        with open("/proc/loadavg") as f:
            before = f.read().strip()
        run = {"threads": threads, "load_before": before, "calls": calls(model, a.rounds)}
        print(json.dumps(run["calls"], indent=1), flush=True)
        if not a.skip_steps:
            run["steps"] = [steps(model, tok, int(b), a.steps) for b in a.batches.split(",")]
            print(json.dumps(run["steps"], indent=1), flush=True)
        with open("/proc/loadavg") as f:
            run["load_after"] = f.read().strip()
        report["runs"].append(run)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
