"""The fused selecting attention on CUDA (`kernels/fused_select_triton`) against the torch path it replaces and a
dense attention over the whole cache, on random tensors (no model, no download; torch and triton only).

For each shape (B batch rows, Hkv KV heads, G query heads per KV head, d, cached length S, share selected):
a layer's store of S tokens per (batch row, KV head), a random selection packed by `KVStore.select_rows`, the
token's own row stored after it. Then
  (a) check: the kernel's output and log-sum-exp against the torch path (`gather_rows` + `attend_packed`) in
      float32 (within 1e-5; the past values' sum within 1e-5 relative) and in bfloat16 against the float32
      torch path over the same bfloat16 values (within 1e-2: the kernel rounds once); and that
      `fused_select.attend_rows` on CUDA tensors dispatches to the kernel;
  (b) time (bfloat16, `torch.cuda.Event`, warm-up, median of --reps calls): the kernel with its own choice of
      splits and with one split per run, the torch path (gather + masked fused attention, with and without
      the log-sum-exp and value sums the remainder needs) and dense SDPA over all S entries (`attend_all`);
      for the first shape also a sweep over the number of splits and over rows per block x warps.
Prints one table; writes the numbers as JSON to --json (default $OUT/cuda_fused_select.json when OUT is set).
Exit status 1 when a check fails.

    PYTHONPATH=src python benchmarks/cuda_fused_select.py [--reps 50] [--json PATH]
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/cuda_fused_select.py --device cpu --smoke   # no GPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from infinigen.cache import KVStore
from infinigen.kernels import fused_select, fused_select_triton
from infinigen.runtime import attention

# (B, Hkv, G, d, S, share selected): the realistic shape first, then small ones (odd lengths, GQA groups)
SHAPES = [(8, 8, 4, 128, 8192, 0.1), (1, 8, 4, 128, 8192, 0.1), (8, 8, 4, 128, 2048, 0.1),
          (4, 3, 3, 64, 8192, 0.05), (2, 2, 7, 64, 517, 0.3), (3, 4, 1, 128, 1000, 0.5)]
SMOKE_SHAPES = [(2, 2, 3, 64, 90, 0.3), (1, 2, 4, 128, 70, 0.5)]
SWEEP_SPLITS = [1, 2, 4, 8, 16, 32]
SWEEP_LAUNCH = [(block, warps) for block in (16, 32, 64) for warps in (2, 4, 8)]  # rows per block, warps
TOL_F32, TOL_BF16 = 1e-5, 1e-2


def case(shape, dtype, device, seed=0):
    """A layer's store holding S random tokens per (batch row, KV head), a random selection of about `share`
    of them packed as rows, queries and the token's own row stored after them: (store, sel, q [B,H,1,d],
    slots [B,Hkv], own [B,Hkv] flat rows)."""
    b, hkv, g, d, s, share = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    store = KVStore(1, b, hkv, s + 1, d, dtype, device=device)
    k = torch.randn(b, hkv, s, d, generator=gen, device=device).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=gen, device=device).to(dtype)
    valid = torch.ones(b, s, dtype=torch.bool, device=device)
    store.write_prompt(0, k, v, valid, torch.arange(s, device=device).expand(b, s))
    keep = torch.rand(b, hkv, s, generator=gen, device=device) < share
    keep[0, hkv - 1] = False  # one (batch row, KV head) reads only its own token
    sel = store.select_rows(0, keep, store.valid[0][:, :, :s])
    q = torch.randn(b, hkv * g, 1, d, generator=gen, device=device).to(dtype)
    k1 = torch.randn(b, hkv, 1, d, generator=gen, device=device).to(dtype)
    slots = store.append(0, k1, k1 * 0.5, torch.full((b,), s, device=device))
    own = torch.arange(b * hkv, device=device).view(b, hkv) * store.capacity + slots
    return store, sel, q, slots, own


def torch_path(store, sel, q, slots, scale, remainder=True, buffers=None):
    """What the runtime runs without the kernel: the rows gathered, one masked fused attention (with
    `remainder`, also the log-sum-exp and the past values' sums). Returns out [B,H,d], lse [B,H], sums."""
    b, h, _, d = q.shape
    rows, head = attention.with_own(sel, slots, store.capacity)
    buffers = buffers or attention.StepBuffers()
    kp, vp = store.gather_rows(0, rows, *buffers.rows(rows.numel(), store.k[0]))
    att = attention.attend_packed(q, kp, vp, head, sel.counts.shape[1], scale, remainder)
    if not remainder:
        return att.out.view(b, h, d), None, None
    return att.out.view(b, h, d), att.lse.reshape(b, h), att.read_sum


def kernel(store, sel, q, own, scale, splits=None, **launch):
    b, h, _, d = q.shape
    return fused_select_triton.attend_rows(q.view(b, h, d), store.k[0].view(-1, d), store.v[0].view(-1, d),
                                           sel.rows, sel.counts, own, scale, splits=splits, **launch)


def errors(got, want):
    """Largest |out - ref|, |lse - ref| where finite, -inf mismatches, and |sum - ref| / max(1, |ref|)."""
    (out, lse, sums), (out_r, lse_r, sums_r) = got, want
    finite = torch.isfinite(lse_r)
    return {"out": float((out.float() - out_r.float()).abs().max()),
            "lse": float((lse - lse_r)[finite].abs().max()) if bool(finite.any()) else 0.0,
            "lse_inf_mismatch": int((torch.isneginf(lse) != torch.isneginf(lse_r)).sum()),
            "sum": float((sums - sums_r).abs().max()) / max(1.0, float(sums_r.abs().max()))}


def check(shape, device) -> dict:
    """float32 and bfloat16 against the torch path, and the dispatch of `fused_select.attend_rows`."""
    scale = shape[3] ** -0.5
    store, sel, q, slots, own = case(shape, torch.float32, device)
    ref = torch_path(store, sel, q, slots, scale)
    f32 = {f"splits={s}": errors(kernel(store, sel, q, own, scale, s), ref) for s in (None, 1, 3)}
    b, h, _, d = q.shape
    dispatched = device != "cpu" and fused_select.usable(q, store.k[0]) and torch.equal(
        fused_select.attend_rows(q.view(b, h, d), store.k[0].view(-1, d), store.v[0].view(-1, d), sel.rows,
                                 sel.counts, own, scale)[0], kernel(store, sel, q, own, scale)[0])
    sixteen = {}
    # bfloat16 with the tensor-core dots and with IEEE float32 dots; under the interpreter (CPU) float16 for the
    # tensor-core path, whose bfloat16 dot the interpreter does not emulate (it multiplies the raw bits)
    for name, dtype, fast in (("bfloat16", torch.bfloat16, True), ("bfloat16_ieee", torch.bfloat16, False)):
        if device == "cpu" and fast:
            name, dtype = "float16", torch.float16
        store16, sel16, q16, slots16, own16 = case(shape, dtype, device)
        store32 = KVStore(1, *store16.k[0].shape[:3], shape[3], torch.float32, device=device)  # the same values
        store32.k[0].copy_(store16.k[0])
        store32.v[0].copy_(store16.v[0])
        ref16 = torch_path(store32, sel16, q16.float(), slots16, scale)
        sixteen[name] = errors(kernel(store16, sel16, q16, own16, scale, fast_dot=fast), ref16)
    ok = all(e["out"] <= TOL_F32 and e["lse"] <= TOL_F32 and e["sum"] <= TOL_F32 and not e["lse_inf_mismatch"]
             for e in f32.values())
    ok = ok and all(e["out"] <= TOL_BF16 and e["lse"] <= TOL_BF16 and not e["lse_inf_mismatch"]
                    for e in sixteen.values())
    ok = ok and (dispatched or device == "cpu")  # on CPU `attend_rows` runs the C++ kernel, by design
    return {"float32": f32, **sixteen, "dispatches_to_triton": bool(dispatched), "ok": bool(ok)}


def median_ms(fn, reps: int, warmup: int, device) -> float:
    """The median of `reps` calls, each timed alone (CUDA events on a GPU, the wall clock elsewhere)."""
    for _ in range(warmup):
        fn()
    if device == "cpu":
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs)


def timings(shape, device, reps: int, warmup: int, sweep: bool) -> dict:
    """bfloat16 medians (ms) of the kernel, the torch path and dense SDPA over the whole cache."""
    b, hkv, g, d, s, _ = shape
    scale = d ** -0.5
    store, sel, q, slots, own = case(shape, torch.bfloat16, device)
    buffers = attention.StepBuffers()
    kd, vd = store.k[0][:, :, :s + 1], store.v[0][:, :, :s + 1]  # every entry and the own token
    read = int(sel.counts.sum()) + b * hkv
    auto = fused_select_triton.splits_for(b * hkv, sel.rows.shape[1] + 1)
    row = {"rows_read": read, "rows_per_pair_max": int(sel.counts.max()), "auto_splits": auto,
           "kernel_ms": median_ms(lambda: kernel(store, sel, q, own, scale), reps, warmup, device),
           "kernel_1split_ms": median_ms(lambda: kernel(store, sel, q, own, scale, 1), reps, warmup, device),
           "kernel_ieee_ms": median_ms(lambda: kernel(store, sel, q, own, scale, fast_dot=False), reps, warmup,
                                       device),
           "torch_ms": median_ms(lambda: torch_path(store, sel, q, slots, scale, True, buffers), reps, warmup,
                                 device),
           "torch_out_only_ms": median_ms(lambda: torch_path(store, sel, q, slots, scale, False, buffers), reps,
                                          warmup, device),
           "dense_sdpa_ms": median_ms(lambda: attention.attend_all(q, kd, vd, scale), reps, warmup, device)}
    kv_bytes = read * 2 * d * q.element_size()
    row["kernel_gbps"] = kv_bytes / (row["kernel_ms"] * 1e-3) / 1e9
    row["dense_gbps"] = b * hkv * (s + 1) * 2 * d * q.element_size() / (row["dense_sdpa_ms"] * 1e-3) / 1e9
    if sweep:
        row["splits_ms"] = {str(n): median_ms(lambda n=n: kernel(store, sel, q, own, scale, n), reps, warmup, device)
                            for n in SWEEP_SPLITS}
        row["launch_ms"] = {f"block={bl},warps={w}": median_ms(
            lambda bl=bl, w=w: kernel(store, sel, q, own, scale, block=bl, num_warps=w), reps, warmup, device)
            for bl, w in SWEEP_LAUNCH}
    return row


def table(results: list[dict]) -> str:
    head = ("| B | Hkv | G | d | S | sel | check | kernel ms (splits) | 1 split ms | IEEE dots ms "
            "| torch ms (lse+sums / out) | dense SDPA ms | kernel / dense | kernel / torch | kernel GB/s |")
    lines = [head, "|" + "---|" * 15]
    for r in results:
        b, hkv, g, d, s, share = r["shape"]
        t = r["time"]
        lines.append(f"| {b} | {hkv} | {g} | {d} | {s} | {share:.0%} | {'ok' if r['check']['ok'] else 'FAIL'} "
                     f"| {t['kernel_ms']:.4f} ({t['auto_splits']}) | {t['kernel_1split_ms']:.4f} "
                     f"| {t['kernel_ieee_ms']:.4f} "
                     f"| {t['torch_ms']:.4f} / {t['torch_out_only_ms']:.4f} | {t['dense_sdpa_ms']:.4f} "
                     f"| {t['kernel_ms'] / t['dense_sdpa_ms']:.2f} | {t['kernel_ms'] / t['torch_ms']:.2f} "
                     f"| {t['kernel_gbps']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda; cpu only under TRITON_INTERPRET=1 (a smoke run)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="two tiny shapes, 2 calls each (checks the script)")
    ap.add_argument("--json", type=Path, default=None, help="default: $OUT/cuda_fused_select.json if OUT is set")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cuda_fused_select: torch sees no CUDA device (use --device cpu under TRITON_INTERPRET=1)",
              file=sys.stderr)
        return 2
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("cuda_fused_select: --device cpu needs TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    shapes, reps, warmup = (SMOKE_SHAPES, 1, 0) if args.smoke else (SHAPES, args.reps, args.warmup)
    began = time.perf_counter()
    results = []
    for i, shape in enumerate(shapes):
        results.append({"shape": list(shape), "check": check(shape, args.device),
                        "time": timings(shape, args.device, reps, warmup, sweep=i == 0)})
        print(f"  {shape}: {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (triton interpreter)"
    import triton
    meta = {"device": device, "torch": torch.__version__, "triton": triton.__version__, "reps": reps,
            "warmup": warmup, "seconds": time.perf_counter() - began}
    print(f"{device}; torch {torch.__version__}, triton {triton.__version__}; bfloat16 timings, median of {reps}")
    print(table(results))
    if results[0]["time"].get("splits_ms"):
        print("splits sweep at", tuple(results[0]["shape"]), "(ms):",
              ", ".join(f"{n}: {ms:.4f}" for n, ms in results[0]["time"]["splits_ms"].items()))
        print("launch sweep (auto splits) (ms):",
              ", ".join(f"{k}: {ms:.4f}" for k, ms in results[0]["time"]["launch_ms"].items()))
    failed = [r for r in results if not r["check"]["ok"]]
    for r in failed:
        print("CHECK FAILED", tuple(r["shape"]), json.dumps(r["check"]))
    target = args.json or (Path(os.environ["OUT"]) / "cuda_fused_select.json" if os.environ.get("OUT") else None)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
