"""Selection read as packed rows against the reference path: decode ms/step of the full
cache, InfiniGen on the reference path (each KV head's slots padded to the largest head's count, gathered,
then `attend_step`) and InfiniGen reading its packed rows (`KVStore.select_rows`, one masked fused call), KV
in fast memory, default model and dtype, one shared prefill per cell (`eval.fanout.prefill_shared`), the
systems' steps interleaved A B C ... C B A so that a shared CPU's load falls on each alike. Each system
decodes its own greedy tokens; the first step is left out. Per step it also reports the entries attended and
the rows read from the store (summed over layers, batch rows and KV heads).

    python benchmarks/sparse_attention.py --cells 4096x8,8176x8 --gen 8 --breakdown 3 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import infinigen
from infinigen.bench.side_by_side import (interleaved_decode, parse_cells, per_block_breakdown, staggered_prompts,
                                          text_ids)
from infinigen.eval.fanout import prefill_shared
from infinigen.policies import make_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the padded reference lives with the tests
from support.padded_reference import padded_reference  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="4096x8", help="PROMPTxBATCH, comma separated")
    ap.add_argument("--gen", type=int, default=8, help="decoding steps per system (the first is not timed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--breakdown", type=int, default=0,
                    help="then this many instrumented steps per system: the per-block breakdown (placement.timing)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok, _ = infinigen.load("default", dtype="auto", weights="auto", progress=False)
    ids = text_ids(tok)
    rows = []
    for length, batch in parse_cells(a.cells):
        tokens = staggered_prompts(ids, length, batch)
        pols = [make_policy("full")] + [make_policy("infinigen", dense_below=0).prepare(model, tok) for _ in range(2)]
        names = ["full", "infinigen reference", "infinigen packed rows"]
        logits, sessions = prefill_shared(model, tokens, pols, length + a.gen + a.breakdown)
        padded_reference(sessions[1])
        for s in sessions:
            s.stats.reset()
        times, generated, nxt = interleaved_decode(model, logits.argmax(-1), sessions, a.gen - 1)
        breakdowns = [None] * len(pols)
        print(f"{length:5d} x {batch}  reference and packed rows decode the same greedy tokens: "
              f"{generated[1] == generated[2]}", flush=True)
        if a.breakdown:
            for i, s in enumerate(sessions):
                breakdowns[i], nxt[i] = per_block_breakdown(model, s, nxt[i], a.breakdown)
                print(f"{length:5d} x {batch}  {names[i]:24s} per-block ms: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in breakdowns[i].items()), flush=True)
        for system, ts, s, bd in zip(names, times, sessions, breakdowns):
            per = s.stats.per_step()
            row = dict(system=system, prompt=length, batch=batch, ms_median=statistics.median(ts[1:]),
                       ms_min=min(ts[1:]), rel_kv=s.stats.overall(), **per, per_block_ms=bd,
                       tokens=generated[names.index(system)])
            rows.append(row)
            print(f"{length:5d} x {batch}  {system:24s} median {row['ms_median']:7.1f} ms/step"
                  f"  min {row['ms_min']:7.1f}"
                  f"  relative KV {row['rel_kv']:.3f}  entries/step {per['entries_attended']:.0f}"
                  f"  rows read/step {per['rows_read']:.0f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
