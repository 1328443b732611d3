"""A decoding step of several sessions together (a fan-out, `serve --no-batch-invariant`'s running requests), ms per
step: the policies side by side in one process; two checkouts compared by running it once per checkout with its
PYTHONPATH, alternately (A B B A), on a quiet machine.

    PYTHONPATH=src python benchmarks/sessions_step.py [--sessions 4] [--prompt 512] [--steps 32]
        [--policies full,infinigen,infinigen-selecting] [--kv-offload disk --disk-block 16] [--inline]
        [--memory-limit 1.75G]

The default model as `serve` loads it (dtype auto, its int4 weights, the compiled step); each policy its own
sessions over `--sessions` different prompts of the same length (Emma), prefilled, then decoded together in one
`runtime.decode` call per step (greedy tokens fed back), the policies' steps interleaved in one process (A B C, C B
A, ...: side by side). "infinigen" is the default preset (its measured crossing decides where it selects),
"infinigen-selecting" the same with dense_below=0 (selecting at every length).
`--kv-offload disk --disk-block 16`: each session's pool in its own file in blocks of 16 tokens, as `serve
--kv-offload disk` keeps a request's (InfiniGen with its knob block=16, as the server's disk tier runs it; the page
cache is not bounded unless `--memory-limit` runs the script again in a memory cgroup of that size, which the
page cache is charged to: then the pools' pages come from the device); `--inline`: the stores' fetches on the
calling thread instead of one worker thread per session.
Prints one JSON line per policy: the median and the best ms per step after 4 warm steps, and the KV share read.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--policies", default="full,infinigen,infinigen-selecting")
    ap.add_argument("--kv-offload", default="none", choices=["none", "cpu", "disk"])
    ap.add_argument("--disk-block", type=int, default=0)
    ap.add_argument("--inline", action="store_true", help="offloaded: fetch on the calling thread")
    ap.add_argument("--knob", action="append", default=[], help="an InfiniGen knob, name=value (repeatable)")
    ap.add_argument("--memory-limit", default=None, help="run in a memory cgroup of this size (e.g. 1.75G)")
    args = ap.parse_args()
    from infinigen import membound
    bound = membound.current()
    if args.memory_limit and bound is None:  # this script again, inside the bound
        with membound.MemoryBound(membound.parse_limit(args.memory_limit)) as mb:
            env = dict(os.environ, **{membound.BOUND_ENV: json.dumps(mb.info())})
            code = mb.run([sys.executable, *sys.argv], env=env)
            print(f"{mb.describe()}: peak {mb.stats()['peak'] / 2**20:.0f} MiB, exit {code}", flush=True)
        raise SystemExit(code)
    from infinigen import compiled, runtime
    from infinigen.loading import load
    from infinigen.paths import resolve_text
    from infinigen.placement import Placement
    from infinigen.policies.knobs import make_policy_from_cli
    torch.set_grad_enabled(False)
    model, tok, _ = load("default", dtype="auto", progress=False)
    ids = tok(resolve_text("emma").read_text(encoding="utf-8")[:400_000])["input_ids"]
    parts = compiled.enable(model, "on")
    parts.warm(model, args.sessions)
    prompts = [ids[i * 4099:i * 4099 + args.prompt] for i in range(args.sessions)]
    names = args.policies.split(",")
    runs = {}  # policy -> [its sessions, the tokens they decode next]
    for name in names:
        knobs = {"dense_below": 0} if name == "infinigen-selecting" else {}
        if args.disk_block and name.startswith("infinigen"):
            knobs["block"] = args.disk_block
        # each session decodes one row, as a server's requests do: the crossing at batch 1 applies
        base = name.split("-")[0]
        given = [*args.knob, *(f"{k}={v}" for k, v in knobs.items())] if base == "infinigen" else None
        pol = make_policy_from_cli(base, given).prepare(model, tok, progress=False, longest=args.prompt + args.steps)
        placement = Placement(args.kv_offload, disk_block=args.disk_block, threaded=not args.inline)
        sessions = [placement.new_session(model, 1, args.prompt + args.steps + 2, pol) for _ in prompts]
        runs[name] = [sessions, torch.cat([runtime.prefill(model, torch.tensor([p]), s).argmax(-1)
                                           for p, s in zip(prompts, sessions)])]
    times = {name: [] for name in names}
    for step in range(args.steps):  # the policies' steps interleaved, the order reversed every step
        for name in (names if step % 2 == 0 else names[::-1]):
            sessions, tokens = runs[name]
            t0 = time.perf_counter()
            runs[name][1] = runtime.decode(model, tokens, sessions).argmax(-1)
            times[name].append(time.perf_counter() - t0)
    for name in names:
        sessions = runs[name][0]
        read = statistics.mean(s.stats.overall() for s in sessions)
        print(json.dumps({"policy": name, "sessions": args.sessions, "prompt": args.prompt,
                          "kv_offload": args.kv_offload, "disk_block": args.disk_block, "inline": args.inline,
                          "memory_limit": args.memory_limit, "knobs": args.knob if name.startswith("infinigen") else [],
                          "query": _query(sessions[0]), "threads": torch.get_num_threads(),
                          "median ms": round(statistics.median(times[name][4:]) * 1e3, 2),
                          "best ms": round(min(times[name][4:]) * 1e3, 2), "kv read": round(read, 4)}), flush=True)
        for s in sessions:
            s.store.close()

def _query(session) -> str | None:
    """Which query a session's InfiniGen selects with ("own", "ahead", "corrected"), None for another policy."""
    st = session.state
    if not hasattr(st, "own_query"):
        return None
    return "corrected" if st.own_query and st.ahead else "own" if st.own_query else "ahead"


if __name__ == "__main__":
    main()
