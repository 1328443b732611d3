"""Load test of `infinigen serve` on 127.0.0.1 (issue 11, items 2 and 5), and how many long requests fit.

    python benchmarks/serve_load.py                         # default model, ~5 minutes
    python benchmarks/serve_load.py --smoke                 # seconds: fewer clients, shorter runs

1. Load: for each policy (full, infinigen, h2o) and KV placement (RAM, disk), an in-process server
   (uvicorn on a thread, the engine on its own thread) gets `--clients` concurrent clients of the `openai`
   package, each sending streamed completions back to back for `--seconds` (prompts of 64..`--prompt-tokens`
   tokens cut from Pride and Prejudice, `--max-tokens` new tokens, greedy). Reported: requests, errors,
   generated tokens/s, latency p50/p99, time to first token p50. Afterwards: no errors, the engine's
   reserved and measured KV bytes back to 0, and RSS against the baseline taken after a warm-up request
   (after gc and malloc_trim, so freed heap counts as freed; the warm-up is one round of `--clients`
   requests at the longest prompt, so the allocator's high-water mark is in the baseline).
2. Capacity: with one fast-memory budget (`--fast-bytes`), how many requests of `--long` prompt tokens
   (+ `--long-gen`) the engine admits at once with the KV in RAM and on disk: the admission rule's count
   from the measured per-token costs, checked live (requests submitted, prefilled, counted running).

Writes results/serve.md and results/serve.json.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import gc
import json
import os
import platform
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_mib() -> float:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def make_engine(model, tok, policy_name, offload, **kw):
    from infinigen.commands.options import make_policy_from_cli, prepare_policies
    from infinigen.generate import stop_ids
    from infinigen.placement import Placement
    from infinigen.serve.engine import Engine
    pol = make_policy_from_cli(policy_name, [])
    prepare_policies({policy_name: pol}, model, tok, progress=False)
    return Engine(model, pol, Placement(kv_offload=offload), eos=stop_ids(model, tok), **kw)


def load_run(model, tok, name, text_ids, policy, offload, args) -> dict:
    import openai

    from infinigen.serve.app import BackgroundServer, create_app
    eng = make_engine(model, tok, policy, offload, max_batch=args.clients, max_queue=4 * args.clients)
    app = create_app(eng, tok, name)
    lat, ttft, errors, tokens = [], [], [], 0
    lock = threading.Lock()
    with BackgroundServer(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

        def request(prompt):
            t0 = time.perf_counter()
            first, n = None, 0
            stream = client.completions.create(model=name, prompt=prompt, max_tokens=args.max_tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text and first is None:
                    first = time.perf_counter() - t0
                if chunk.usage is not None:
                    n = chunk.usage.completion_tokens
            return time.perf_counter() - t0, first, n

        # warm-up: one round at the largest prompt, so one-time allocations and the allocator's high-water
        # mark belong to the baseline; growth after the run is then what requests left behind
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(lambda i: request(text_ids[i * 50:i * 50 + args.prompt_tokens]), range(args.clients)))
        base = rss_mib()
        stop_at = time.perf_counter() + args.seconds

        def client_loop(i):
            nonlocal tokens
            r = random.Random(i)
            while time.perf_counter() < stop_at:
                n = r.randint(64, args.prompt_tokens)
                start = r.randint(0, len(text_ids) - n)
                try:
                    dt, first, k = request(text_ids[start:start + n])
                except Exception as e:  # counted, not raised: the run goes on
                    with lock:
                        errors.append(repr(e)[:200])
                    continue
                with lock:
                    lat.append(dt)
                    ttft.append(first if first is not None else dt)
                    tokens += k

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(client_loop, range(args.clients)))
        wall = time.perf_counter() - t0
        deadline = time.monotonic() + 30
        while not eng.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        eng._measure()
        snap = eng.snapshot()
        after = rss_mib()
    return {"policy": policy, "kv": offload, "clients": args.clients, "seconds": round(wall, 1), "requests": len(lat),
            "errors": len(errors), "error_samples": errors[:3], "tokens": tokens, "tokens_per_s": tokens / wall,
            "latency_p50_s": pct(lat, 50), "latency_p99_s": pct(lat, 99), "ttft_p50_s": pct(ttft, 50),
            "idle_after": eng.idle(),
            "reserved_bytes_after": snap["reserved_fast_bytes"] + snap["reserved_slow_bytes"],
            "kv_bytes_after": snap["kv_fast_bytes"] + snap["kv_slow_bytes"],
            "rss_baseline_mib": base, "rss_after_mib": after, "rss_delta_mib": after - base,
            "cost_fast_per_token": eng.cost.fast1, "cost_slow_per_token": eng.cost.slow1}


def alone_run(model, tok, text_ids, args) -> dict:
    from infinigen.generate import Sampling, generate_ids
    n = (64 + args.prompt_tokens) // 2
    generate_ids(model, [text_ids[:n]], 2, Sampling())  # warm-up: first-call costs are not the request's
    g = generate_ids(model, [text_ids[:n]], args.max_tokens, Sampling())
    return {"prompt": n, "new": len(g.tokens[0]), "prefill_s": g.prefill_s, "decode_tokens_per_s": g.decode_tokens_per_s}


def capacity_run(model, tok, text_ids, policy, offload, args) -> dict:
    """Requests of args.long prompt tokens submitted at once; the engine admits what its budgets hold."""
    from infinigen.errors import UserError
    from infinigen.serve.engine import Request
    eng = make_engine(model, tok, policy, offload, max_batch=1000, max_queue=1000, fast_bytes=args.fast_bytes)
    fast, slow = eng.request_cost(args.long, args.long_gen)
    by_rule = min(eng.fast_budget // fast, (eng.slow_budget // slow) if slow else 10 ** 9)
    k = min(int(by_rule) + 2, args.max_live) if by_rule else 1
    try:
        reqs = [eng.submit(Request(text_ids[i * 7:i * 7 + args.long], args.long_gen)) for i in range(k)]
    except UserError:  # not even one fits: refused at once (HTTP 400)
        assert by_rule == 0
        reqs = []
    t0 = time.perf_counter()
    eng.step()  # admits and prefills what fits, then one decode step of them all
    live = eng.snapshot()
    for r in reqs:
        eng.cancel(r)
    while not eng.idle():
        eng.step()
    return {"policy": policy, "kv": offload, "fast_budget": eng.fast_budget, "slow_budget": eng.slow_budget,
            "fast_per_request": fast, "slow_per_request": slow, "fit_by_rule": int(by_rule), "submitted": k,
            "running_live": live["running"], "waiting_live": live["waiting"], "kv_fast_live": live["kv_fast_bytes"],
            "kv_slow_live": live["kv_slow_bytes"], "step_s": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--policies", default="full,infinigen,h2o")
    ap.add_argument("--kv", default="none,disk")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--fast-bytes", type=int, default=128 << 20)
    ap.add_argument("--long", type=int, default=2048)
    ap.add_argument("--long-gen", type=int, default=128)
    ap.add_argument("--max-live", type=int, default=6, help="cap on the requests the live capacity check prefills")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--render", type=Path, help="only rewrite serve.md from this serve.json")
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args(argv)
    if args.render:
        d = json.loads(args.render.read_text())
        for k in ("clients", "max_live"):
            setattr(args, k, int(d["args"][k]))
        for k in ("seconds",):
            setattr(args, k, float(d["args"][k]))
        for k in ("prompt_tokens", "max_tokens", "fast_bytes", "long", "long_gen"):
            setattr(args, k, int(d["args"][k]))
        args.render.with_suffix(".md").write_text(report(d["model"], args, d["machine"], d["alone"], d["load"], d["capacity"]))
        return 0
    if args.smoke:
        args.clients, args.seconds, args.prompt_tokens, args.max_tokens = 2, 3, 128, 8
        args.long, args.long_gen, args.fast_bytes, args.max_live = 512, 32, 64 << 20, 6
        args.out = Path(os.environ.get("TMPDIR", "/tmp")) / "serve-smoke"
    import torch

    from infinigen.loading import load
    from infinigen.paths import load_text
    model, tok, name = load(args.model, progress=False)
    served = "model"
    text_ids = tok(load_text("prideprejudice", default="prideprejudice"))["input_ids"][:20000]
    policies, kvs = args.policies.split(","), args.kv.split(",")
    loads, caps = [], []
    alone = alone_run(model, tok, text_ids, args)
    print(json.dumps(alone), file=sys.stderr, flush=True)
    for p in policies:
        for kv in kvs:
            r = load_run(model, tok, served, text_ids, p, kv, args)
            loads.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "error_samples"}), file=sys.stderr, flush=True)
    for p in policies:
        for kv in kvs:
            c = capacity_run(model, tok, text_ids, p, kv, args)
            caps.append(c)
            print(json.dumps(c), file=sys.stderr, flush=True)
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "load_avg": os.getloadavg()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve.json").write_text(json.dumps({"model": name, "args": {k: str(v) for k, v in vars(args).items()},
                                                     "machine": machine, "alone": alone, "load": loads, "capacity": caps}, indent=2) + "\n")
    (args.out / "serve.md").write_text(report(name, args, machine, alone, loads, caps))
    print(f"wrote {args.out / 'serve.md'}", file=sys.stderr)
    bad = [r for r in loads if r["errors"] or r["reserved_bytes_after"] or r["kv_bytes_after"] or not r["idle_after"]]
    return 1 if bad else 0


def report(name, args, machine, alone, loads, caps) -> str:
    kvname = {"none": "RAM", "cpu": "host pool", "disk": "disk"}
    mib = 2 ** 20
    out = [f"# `infinigen serve` under load ({name})", "",
           f"Machine: {machine['cores']} cores ({machine['cpu']}), torch {machine['torch']}, {machine['threads']} "
           f"torch threads; load average at the end {machine['load_avg'][0]:.1f} (the cores are shared with other "
           "work, so absolute speeds are low and noisy; compare rows of one run).",
           f"Command: `python benchmarks/serve_load.py` ({args.clients} concurrent `openai` clients for {args.seconds:g} s "
           f"per row, streamed completions of 64..{args.prompt_tokens} prompt tokens and {args.max_tokens} new tokens, "
           "greedy, server on 127.0.0.1 in the same process).", "",
           f"For scale, one request alone through `generate` (no server; {alone['prompt']} prompt tokens, "
           f"{alone['new']} new, full cache in RAM) in this run: prefill {alone['prefill_s']:.2f} s, decode "
           f"{alone['decode_tokens_per_s']:.1f} tokens/s. Prefills are not chunked: a joining request's prefill "
           "holds up the running batch for its duration, which is most of the latency at these prompt lengths.", "",
           "## Load", "",
           "| policy | KV | requests | errors | tokens/s | latency p50 | p99 | first token p50 | after: KV reserved / held | RSS vs baseline |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in loads:
        out.append(f"| {r['policy']} | {kvname[r['kv']]} | {r['requests']} | {r['errors']} | {r['tokens_per_s']:.1f} | "
                   f"{r['latency_p50_s']:.2f} s | {r['latency_p99_s']:.2f} s | {r['ttft_p50_s']:.2f} s | "
                   f"{r['reserved_bytes_after']} / {r['kv_bytes_after']} B | {r['rss_delta_mib']:+.1f} MiB "
                   f"({r['rss_baseline_mib']:.0f} -> {r['rss_after_mib']:.0f}) |")
    out += ["", "## How many long requests fit", "",
            f"One fast-memory budget of {args.fast_bytes / mib:.0f} MiB; requests of {args.long} prompt tokens + "
            f"{args.long_gen} new ones. Per-request costs are measured (see below); 'live' is what the engine admitted "
            f"when min(fit + 2, {args.max_live}) such requests arrived at once (prefilled and running; with 0 fit the "
            "request is refused with 400: it could never run).", "",
            "| policy | KV | fast bytes / request | pool bytes / request | fit by the rule | running live / arrived |",
            "|---|---|---|---|---|---|"]
    for c in caps:
        out.append(f"| {c['policy']} | {kvname[c['kv']]} | {c['fast_per_request'] / mib:.1f} MiB | "
                   f"{c['slow_per_request'] / mib:.1f} MiB | {c['fit_by_rule']} | {c['running_live']} / {c['submitted']} |")
    by = {(c["policy"], c["kv"]): c for c in caps}
    lines = []
    for p in dict.fromkeys(c["policy"] for c in caps):
        ram, disk = by.get((p, "none")), by.get((p, "disk"))
        if ram and disk:
            lines.append(f"{p} {ram['fit_by_rule']} -> {disk['fit_by_rule']}")
    out += ["", "With the KV on disk, more long requests fit in the same fast memory: " + ", ".join(lines)
            + " (RAM -> disk). The live check admitted exactly the rule's count (up to the arrivals), and the fast "
            "bytes the running requests then held stayed within their reservations: "
            + ", ".join(f"{c['policy']}/{kvname[c['kv']]} {c['kv_fast_live'] / mib:.0f} of "
                        f"{c['running_live'] * c['fast_per_request'] / mib:.0f} MiB" for c in caps if c["running_live"]) + "."]
    out += ["", ADMISSION, ""]
    return "\n".join(out) + "\n"


ADMISSION = """## The admission rule

Each request has its own KV store sized for prompt + max_tokens tokens (so nothing is evicted), and reserves,
before it is prefilled, what that session will hold in each tier:

- fast tier (RAM here; GPU memory behind a GPU): with the KV in RAM, the whole store (keys, values, slot
  metadata) plus the policy's per-request tensors (H2O's scores, InfiniGen's 4-bit partial key cache);
  with the KV offloaded, only the slot metadata, the fetched rows of the two layers in flight (the store
  double-buffers by layer parity; dense layers and the full policy fetch every row of a layer) and the
  policy's tensors;
- slow tier (disk): the pool, every layer's keys and values.

The per-token costs are measured, not derived by hand: at start-up the engine fills two probe sessions to
two lengths, decodes two steps (so fetch buffers grow to their size at that length) and takes the
difference of the bytes they hold (`KVCost.measure`). A request is admitted when both reservations fit the
budgets (`--fast-bytes`, `--pool-bytes`), and fewer than `--max-batch` requests run; otherwise it waits in
a FIFO queue (no overtaking, so a long request is not starved), and beyond `--max-queue` waiting requests
the server answers 429. A request that would not fit even alone gets 400 at once.

So with the KV in RAM the fast budget holds every layer's KV of every running request, and with the KV on
disk it holds about 2 layers' worth of fetched rows plus metadata and policy state: the count of long
requests that fit grows by the ratio of those costs. InfiniGen gains less than full and H2O because its
partial key cache (all key columns in 4 bits, kept as float32 today) lives in the fast tier by design. Disk
reads go through the page cache: on a machine with free RAM this measures the mmap path, not the device,
and pages of the mapped pool count in RSS while a request runs (they go when its store closes)."""


if __name__ == "__main__":
    sys.exit(main())
