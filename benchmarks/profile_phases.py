"""Where a server's engine thread spends a span of a run, from a py-spy profile: its busy seconds by phase (prefill,
decode, bookkeeping) and, within each phase, the functions that hold the most time; its fetch workers' busy seconds.

    py-spy record --subprocesses --rate 20 --format speedscope -o run.json -- \\
        python benchmarks/serve_disk.py --clients 16 --doc-tokens 2000 --memory-limit 1G --turns 2 --no-alone --no-llama
    python benchmarks/profile_phases.py run.json --after restore_prefix --top 25

`--after NAME`: count only the samples from the first one whose stack holds NAME on (e.g. `restore_prefix`: the
second turn, the first prefix restored from the cache). Samples are py-spy's (idle threads not sampled), so a thread
waiting for the GIL counts as busy where it waits; read the phases' shares, not their seconds, as the cost.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json

PHASES = (("prefill", ("Engine._prefill", "Engine._advance_prefill")), ("decode", ("decode",)),
          ("bookkeeping", ("Engine._measure", "Engine._trim_heap")))


# frames every sample of a phase passes through: they say nothing about where its time goes
WRAPPERS = ("process ", "Thread.", "Engine.", "_bootstrap", "Module._", "context_decorator", "_wrap_generator",
            "decode.<locals>")


def phase_of(stack: list[str]) -> str:
    for name, marks in PHASES:
        if any(f == m or f.endswith("." + m) or f == m.split(".")[-1] for f in stack for m in marks):
            return name
    return "other"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", help="py-spy's speedscope JSON (or .json.gz)")
    ap.add_argument("--after", default=None, help="count from the first sample whose stack holds this function")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args(argv)
    d = json.load((gzip.open if a.profile.endswith(".gz") else open)(a.profile, "rt"))
    names = [f["name"] for f in d["shared"]["frames"]]
    out = []
    for p in d["profiles"]:
        if "infinigen-engine" not in p["name"]:
            continue
        pid = p["name"].split()[1]
        samples = [[names[i] for i in s] for s in p["samples"]]
        start = 0 if a.after is None else next((i for i, s in enumerate(samples) if any(a.after in f for f in s)),
                                                    len(samples))
        by_phase, by_fn = collections.Counter(), collections.Counter()
        for stack, w in zip(samples[start:], p["weights"][start:]):
            ph = phase_of(stack)
            by_phase[ph] += w
            for fn in set(stack):
                by_fn[(ph, fn)] += w
        fetch = sum(sum(q["weights"]) for q in d["profiles"]
                    if q["name"].split()[1] == pid and "infinigen-fetch" in q["name"])
        row = {"process": pid, "engine_busy_s": round(sum(by_phase.values()), 2),
               "phases_s": {k: round(v, 2) for k, v in by_phase.most_common()},
               "fetch_workers_busy_s_whole_run": round(fetch, 2),
               "top": [(ph, fn, round(w, 2)) for (ph, fn), w in by_fn.most_common() if ph in ("prefill", "decode")
                       and not fn.startswith(WRAPPERS) and fn != "decode"][:a.top]}
        out.append(row)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
