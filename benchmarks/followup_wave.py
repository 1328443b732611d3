"""A wave of follow-ups on prefix-cache hits, as a server's second turn runs them: each request's cached prefix restored
into its own pool, its follow-up prefilled one layer per round over every request (`serve`'s chunked prefill), then
all of them decoded together. Seconds per phase, per policy, each policy in its own fresh process.

    PYTHONPATH=src python benchmarks/followup_wave.py [--requests 11] [--prefix 7936] [--follow-up 60]
        [--steps 12] [--policies full,infinigen] [--memory-limit 1.5G]

The default model as `serve` loads it (dtype auto, its int4 weights, the compiled step, large allocations
mapped), one torch thread (the scenario's `--threads 1`); the pools on disk in blocks of 16 (`--kv-offload disk
--disk-block 16`, InfiniGen with serve_disk.py's knobs); the prefix's keys and values random (the phases' work does
not depend on them), restored in blocks of 256 tokens as the prefix cache's; `--memory-limit` runs each policy in a
memory cgroup of that size, which the pools' page cache is charged to. Prints one JSON line per policy: restore
s, prefill s, the first decoding step and the median of the others.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

KNOBS = ("calibrate=false alpha=7 kv_budget=0.1354 budget_growth=0.5 exact_first=true remainder_from=1 dense_layers= "
         "dense_below=0 block=16").split()  # benchmarks/serve_disk.py's InfiniGen
BLOCK = 256  # tokens per prefix-cache block


def run(policy: str, args) -> dict:
    from infinigen import compiled, runtime
    from infinigen.loading import load
    from infinigen.memory import map_large_allocations
    from infinigen.placement import Placement
    from infinigen.policies.knobs import make_policy_from_cli
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    map_large_allocations()  # as `serve` does: a large freed tensor's pages go back at once (the bound counts them)
    model, tok, _ = load("default", dtype="auto", progress=False)
    compiled.enable(model, "on")
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    shape = (1, cfg.num_kv_heads, BLOCK, cfg.head_dim)
    blocks = [[[torch.randn(shape, generator=g).to(model.dtype) for _ in range(cfg.num_layers)] for _ in "kv"]
              for _ in range(args.prefix // BLOCK)]
    follow = torch.randint(0, cfg.vocab_size, (1, args.follow_up), generator=g)
    pol = make_policy_from_cli(policy, KNOBS if policy == "infinigen" else None).prepare(
        model, tok, progress=False, longest=args.prefix + args.follow_up + args.steps)
    placement = Placement("disk", disk_block=16, threaded=True)
    t0 = time.perf_counter()
    sessions = []
    for _ in range(args.requests):
        s = placement.new_session(model, 1, args.prefix + args.follow_up + args.steps + 1, pol)
        for i, (k, v) in enumerate(blocks):
            s.restore_prefix(k, v, at=i * BLOCK)
        sessions.append(s)
    t1 = time.perf_counter()
    cached = len(blocks) * BLOCK
    slices = [runtime.prefill_in_slices(model, follow, s, layers_per_slice=1, cached=cached, tile=BLOCK)
              for s in sessions]
    logits = [None] * len(sessions)
    while any(x is None for x in logits):  # one layer of every request per round
        for r, it in enumerate(slices):
            if logits[r] is None:
                try:
                    next(it)
                except StopIteration as done:
                    logits[r] = done.value
    t2 = time.perf_counter()
    tokens = torch.cat([x.argmax(-1) for x in logits])
    steps = []
    for _ in range(args.steps):
        a = time.perf_counter()
        tokens = runtime.decode(model, tokens, sessions).argmax(-1)
        steps.append(time.perf_counter() - a)
    for s in sessions:
        s.store.close()
    return {"policy": policy, "requests": args.requests, "prefix": cached, "follow_up": args.follow_up,
            "restore_s": round(t1 - t0, 2), "prefill_s": round(t2 - t1, 2), "first_step_s": round(steps[0], 3),
            "step_s_median": round(statistics.median(steps[1:]), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=11)
    ap.add_argument("--prefix", type=int, default=7936)
    ap.add_argument("--follow-up", type=int, default=60)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--policies", default="full,infinigen")
    ap.add_argument("--memory-limit", default=None, help="each policy in a memory cgroup of this size (e.g. 1.5G)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the policy this process runs
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run(args.one, args)), flush=True)
        return
    from infinigen import membound
    for policy in args.policies.split(","):
        argv = [sys.executable, *sys.argv, "--one", policy]
        if args.memory_limit:
            with membound.MemoryBound(membound.parse_limit(args.memory_limit)) as mb:
                code = mb.run(argv, env=dict(os.environ))
                print(json.dumps({"policy": policy, "bound": mb.describe(),
                                  "peak_mib": mb.stats()["peak"] >> 20, "exit": code}), flush=True)
        else:
            subprocess.run(argv, check=True)


if __name__ == "__main__":
    main()
