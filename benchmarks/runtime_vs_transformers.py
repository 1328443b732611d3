"""Speed sanity: our runtime against `transformers` with the same weights.

For each context length and batch size: prefill tokens/s (a batch of `context`-token prompts) and
decode tokens/s measured from a filled cache (prefill the context, then time `--steps` greedy decode
steps). transformers runs with DynamicCache and sdpa attention and computes logits of the last
position only (as our runtime does). Both run in float32 on the CPU by default.

Each (implementation, context, batch) point runs in a fresh subprocess, so a point that runs out of
memory is reported as failed instead of ending the benchmark, and its peak memory (max RSS) is its own.

    python benchmarks/runtime_vs_transformers.py                       # the issue's grid (slow: ~1 h on 2 cores)
    python benchmarks/runtime_vs_transformers.py --contexts 128 --batches 1 2 --steps 4   # smoke run

Prints a markdown table (ratios > 1 mean our runtime is faster) and writes JSON and markdown files.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def machine() -> dict:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or cpu
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 1024 ** 2, 1)
    except OSError:
        pass
    import torch
    import transformers
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem, "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__}


# ---- one point, in its own process ---------------------------------------------------------------
def prompt_tokens(vocab: int, batch: int, context: int, seed: int = 0):
    """Random token ids: the work per token does not depend on the content (dense attention)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, context), generator=g)


def run_point(impl: str, model_spec: str, context: int, batch: int, steps: int, dtype: str, threads: int) -> dict:
    import torch
    torch.set_num_threads(threads)
    from infinigen.loading import DEFAULT_MODEL_NAME, DTYPES, _convert_gguf, default_gguf, load
    torch_dtype = DTYPES[dtype]
    if impl == "ours":
        from infinigen import runtime
        from infinigen.placement import Placement
        model, _, name = load(model_spec, dtype=dtype, progress=False)
        vocab = model.cfg.vocab_size

        def prefill(x):
            sess = Placement().new_session(model, x.shape[0], x.shape[1] + steps + 1)
            return runtime.prefill(model, x, sess), sess

        def step(nxt, sess):
            return runtime.decode(model, nxt, sess)
    else:
        from transformers import AutoModelForCausalLM, DynamicCache
        if model_spec in ("", "default"):
            path = _convert_gguf(default_gguf(), progress=False)
        elif str(model_spec).endswith(".gguf"):
            path = _convert_gguf(Path(model_spec), progress=False)
        else:
            path = Path(model_spec)
        name = DEFAULT_MODEL_NAME if model_spec in ("", "default") else Path(model_spec).name
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa").eval()
        vocab = model.config.vocab_size

        def prefill(x):
            cache = DynamicCache(config=model.config)
            out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
            return out.logits[:, -1].float(), out.past_key_values

        def step(nxt, cache):
            return model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True,
                         logits_to_keep=1).logits[:, -1].float()

    tokens = prompt_tokens(vocab, batch, context)
    result = {"impl": impl, "model": name, "context": context, "batch": batch, "steps": steps}
    with torch.inference_mode():
        # warm-up: first calls pay for allocator growth and kernel selection
        logits, state = prefill(tokens[:, :min(context, 32)])
        step(logits.argmax(-1), state)
        del logits, state

        t0 = time.perf_counter()
        logits, state = prefill(tokens)
        t1 = time.perf_counter()
        nxt = logits.argmax(-1)
        per_step = []
        for _ in range(steps):
            s = time.perf_counter()
            nxt = step(nxt, state).argmax(-1)
            per_step.append(time.perf_counter() - s)
    prefill_s = t1 - t0
    decode_s = sum(per_step)
    result.update({
        "prefill_s": prefill_s, "prefill_tokens_per_s": batch * context / prefill_s,
        "decode_s": decode_s, "decode_ms_per_step": 1000 * decode_s / steps,
        "decode_tokens_per_s": batch * steps / decode_s, "decode_step_s": per_step,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2,
    })
    return result


def run_isolated(impl, args, context, batch) -> dict:
    cmd = [sys.executable, __file__, "--point", impl, "--model", args.model, "--contexts", str(context),
           "--batches", str(batch), "--steps", str(args.steps), "--dtype", args.dtype, "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    why = "killed (out of memory?)" if r.returncode in (-9, 137) else f"exit {r.returncode}"
    tail = (r.stderr.strip().splitlines() or [""])[-1][:200]
    return {"impl": impl, "context": context, "batch": batch, "failed": f"{why}: {tail}",
            "wall_s": time.perf_counter() - t}


def best(runs: list[dict]) -> dict:
    """One point from repeated runs: the best prefill and the best decode (what the code can do; the
    slower runs are the machine's noise), every run kept under "runs"."""
    ok = [r for r in runs if "failed" not in r]
    if not ok:
        return runs[-1]
    out = dict(max(ok, key=lambda r: r["prefill_tokens_per_s"]))
    dec = min(ok, key=lambda r: r["decode_ms_per_step"])
    for k in ("decode_s", "decode_ms_per_step", "decode_tokens_per_s", "decode_step_s"):
        out[k] = dec[k]
    out["peak_rss_gib"] = max(r["peak_rss_gib"] for r in ok)
    if len(runs) > 1:
        out["runs"] = runs
    return out


# ---- the table -------------------------------------------------------------------------------------
def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def table(rows: list[dict], info: dict, args) -> str:
    by = {(r["impl"], r["context"], r["batch"]): r for r in rows}
    lines = [
        f"Default-model speed, our runtime vs transformers {info['transformers']} (DynamicCache, sdpa), "
        f"{args.dtype}, CPU: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, torch {info['torch']}, "
        f"{args.threads} threads; decode: {args.steps} steps from a filled cache. Ratio = ours / transformers "
        f"(throughput: > 1 is faster)."
        + (f" Best of {args.repeats} alternating runs per point." if args.repeats > 1 else ""),
        "",
        "| context | batch | prefill tok/s ours | prefill tok/s HF | ratio | decode ms/step ours | decode ms/step HF "
        "| decode tok/s ours | decode tok/s HF | ratio | peak RSS GiB ours / HF |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in args.contexts:
        for b in args.batches:
            o, h = by.get(("ours", c, b), {}), by.get(("hf", c, b), {})
            pr = o.get("prefill_tokens_per_s"), h.get("prefill_tokens_per_s")
            dr = o.get("decode_tokens_per_s"), h.get("decode_tokens_per_s")

            def ratio(a):
                return f"{a[0] / a[1]:.2f}" if None not in a else "-"

            rss = f"{fmt(o.get('peak_rss_gib'))} / {fmt(h.get('peak_rss_gib'))}"
            cells = [c, b, fmt(pr[0], ".0f"), fmt(pr[1], ".0f"), ratio(pr), fmt(o.get("decode_ms_per_step")),
                     fmt(h.get("decode_ms_per_step")), fmt(dr[0]), fmt(dr[1]), ratio(dr), rss]
            lines.append("| " + " | ".join(str(x) for x in cells) + " |")
            for r in (o, h):
                if "failed" in r:
                    lines.append(f"|  |  | {r['impl']} failed: {r['failed']} |" + " |" * 8)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="default, a .gguf file or a checkpoint directory")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--steps", type=int, default=16, help="decode steps timed after the prefill")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--impls", nargs="+", default=["ours", "hf"], choices=["ours", "hf"])
    p.add_argument("--repeats", type=int, default=1, help="runs per point, alternating the implementations; "
                   "the table shows the best of each")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per point")
    p.add_argument("--out", default=str(ROOT / "results" / "runtime_vs_transformers" / "runtime_vs_transformers"),
                   help="writes OUT.json and OUT.md")
    p.add_argument("--point", choices=["ours", "hf"], help=argparse.SUPPRESS)  # internal: one point, JSON on stdout
    args = p.parse_args(argv)
    if min(args.contexts) < 1 or min(args.batches) < 1 or args.steps < 1 or args.threads < 1 or args.repeats < 1:
        p.error("contexts, batches, steps, threads and repeats must be >= 1")

    if args.point:
        print(json.dumps(run_point(args.point, args.model, args.contexts[0], args.batches[0], args.steps,
                                   args.dtype, args.threads)))
        return 0

    info = machine()
    rows = []
    for c in args.contexts:
        for b in args.batches:
            runs = {impl: [] for impl in args.impls}
            for _ in range(args.repeats):  # alternate the implementations, so drifts of the machine hit both
                for impl in args.impls:
                    r = run_isolated(impl, args, c, b)
                    runs[impl].append(r)
                    status = r.get("failed") or (f"prefill {r['prefill_tokens_per_s']:.0f} tok/s, decode "
                                                 f"{r['decode_ms_per_step']:.1f} ms/step, "
                                                 f"peak {r['peak_rss_gib']:.1f} GiB")
                    print(f"[{impl:>4}] context {c:>5} batch {b}: {status}", file=sys.stderr, flush=True)
            rows += [best(rs) for rs in runs.values()]
    md = table(rows, info, args)
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"machine": info,
                                                    "args": {k: v for k, v in vars(args).items() if k != "point"},
                                                    "rows": rows}, indent=2))
    out.with_suffix(".md").write_text(md + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
