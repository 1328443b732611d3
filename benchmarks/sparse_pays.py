"""Where sparse pays: decode ms/step of the full cache against InfiniGen at given
`dense_below` settings, KV in fast memory, default model (bfloat16 and int4 weights where the CPU has
bfloat16: the CLI's defaults), one shared prefill per cell (`eval.fanout.prefill_shared`), then the systems'
decoding steps interleaved A B ... B A, so that the load of a shared CPU falls on every system alike.
Each system decodes its own greedy tokens; the first step is left out of the statistics. `measured` is the
default preset's own threshold: where selection pays on this machine (policies/crossing.py, measured once and
cached; the cost of measuring is printed).

    python benchmarks/sparse_pays.py --cells 512x1,512x4,1024x1 --dense-below 0,8192,measured --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import infinigen
from infinigen.bench.side_by_side import interleaved_decode, parse_cells, staggered_prompts, text_ids
from infinigen.eval.fanout import prefill_shared
from infinigen.policies import make_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="512x1,512x4", help="PROMPTxBATCH, comma separated")
    ap.add_argument("--dense-below", default="0",
                    help="InfiniGen dense_below settings, comma separated: a number of cached tokens, or measured")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="InfiniGen with the preset's values (calibrate=false): where its first calibration cannot run")
    ap.add_argument("--gen", type=int, default=16, help="decoding steps per system (the first is not timed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok, name = infinigen.load("default", dtype="auto", weights="auto", progress=False)
    ids = text_ids(tok)
    rows = []
    for length, batch in parse_cells(a.cells):
        tokens = staggered_prompts(ids, length, batch)
        knobs = [None if k.strip() == "measured" else int(k) for k in a.dense_below.split(",")]
        pols, names = [make_policy("full")], ["full"]
        for k in knobs:
            t0 = time.perf_counter()
            more = {"calibrate": False} if a.no_calibrate else {}
            pol = make_policy("infinigen", dense_below=k, **more).prepare(model, tok, progress=k is None)
            s = pol.settings(model)
            pols.append(pol)
            names.append(f"infinigen dense_below={s['dense_below']} ({s['dense_below_source']})")
            if k is None:
                print(f"prepare with the crossing: {time.perf_counter() - t0:.1f} s; "
                      f"crossing {json.dumps(s.get('crossing'))}", flush=True)
        logits, sessions = prefill_shared(model, tokens, pols, length + a.gen)
        times, _, _ = interleaved_decode(model, logits.argmax(-1), sessions, a.gen - 1)
        for system, ts, s in zip(names, times, sessions):
            row = dict(system=system, prompt=length, batch=batch, ms_median=statistics.median(ts[1:]),
                       ms_min=min(ts[1:]), rel_kv=s.stats.overall())
            rows.append(row)
            print(f"{length:5d} x {batch}  {system:28s} median {row['ms_median']:7.1f} ms/step  "
                  f"min {row['ms_min']:7.1f}  relative KV {row['rel_kv']:.3f}", flush=True)
    if a.json:
        meta = dict(model=name, dtype=str(model.dtype), threads=a.threads, torch=torch.__version__,
                    loadavg=open("/proc/loadavg").read().strip())
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
