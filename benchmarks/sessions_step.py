"""A decoding step of several sessions together (a fan-out, `serve --no-batch-invariant`'s running requests), ms per
step: the policies side by side in one process; two checkouts compared by running it once per checkout with its
PYTHONPATH, alternately (A B B A), on a quiet machine.

    PYTHONPATH=src python benchmarks/sessions_step.py [--sessions 4] [--prompt 512] [--steps 32]
        [--policies full,infinigen,infinigen-selecting]

The default model as `serve` loads it (dtype auto, its int4 weights, the compiled step); each policy its own
sessions over `--sessions` different prompts of the same length (Emma), prefilled, then decoded together in one
`runtime.decode` call per step (greedy tokens fed back), the policies' steps interleaved in one process (A B C, C B
A, ...: side by side). "infinigen" is the default preset (its measured crossing decides where it selects),
"infinigen-selecting" the same with dense_below=0 (selecting at every length).
Prints one JSON line per policy: the median and the best ms per step after 4 warm steps, and the KV share read.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--policies", default="full,infinigen,infinigen-selecting")
    args = ap.parse_args()
    from infinigen import compiled, runtime
    from infinigen.loading import load
    from infinigen.paths import resolve_text
    from infinigen.placement import Placement
    from infinigen.policies import make_policy
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
        # each session decodes one row, as a server's requests do: the crossing at batch 1 applies
        pol = make_policy(name.split("-")[0], **knobs).prepare(model, tok, progress=False,
                                                              longest=args.prompt + args.steps)
        sessions = [Placement().new_session(model, 1, args.prompt + args.steps + 2, pol) for _ in prompts]
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
        print(json.dumps({"policy": name, "sessions": args.sessions, "prompt": args.prompt, "threads":
                          torch.get_num_threads(), "median ms": round(statistics.median(times[name][4:]) * 1e3, 2),
                          "best ms": round(min(times[name][4:]) * 1e3, 2), "kv read": round(read, 4)}), flush=True)
        for s in sessions:
            s.store.close()

if __name__ == "__main__":
    main()
