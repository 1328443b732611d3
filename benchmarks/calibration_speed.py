"""InfiniGen's calibration search with the fused kernel against the torch path, side by side in one process.

Both run the search `prepare` runs (`policies/infinigen_calibration._search`: one shared dense pass, then each
candidate's rows after the prompt) on the same model, tokens and candidates; the only difference is
`fused_select.enabled` (off: each candidate's rows chosen by torch in blocks of 64 rows and attended through
`runtime.attend_rows`; on: `infinigen_select.rows_fused` and `runtime.attend_rows_packed`). Prints, per candidate,
both passes' seconds and losses, the totals and both choices, and /proc/loadavg before and after each search; with
--json the same as one object.

    PYTHONPATH=src python benchmarks/calibration_speed.py [--model M] [--threads 1] [--order fused,torch] [--json F]
"""
from __future__ import annotations

import argparse
import json
import math
import time


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def run_search(pol, model, tokenizer, fused: bool) -> dict:
    from infinigen.kernels import fused_select
    from infinigen.policies import calibrate as cal
    from infinigen.policies import infinigen_calibration as ic

    passes = []
    score_window, window = cal.score_window, cal.window

    def timed_score(model_, win, policy, blocks=True):
        t0 = time.perf_counter()
        out = score_window(model_, win, policy, blocks)
        passes.append(time.perf_counter() - t0)
        return out

    def timed_window(model_, tokens, first):
        t0 = time.perf_counter()
        out = window(model_, tokens, first)
        passes.append(time.perf_counter() - t0)
        return out

    from infinigen.paths import load_text
    from infinigen.policies.infinigen_settings import CALIBRATE_BOUND, CALIBRATE_TARGET, CALIBRATE_TEXT

    setup = ic.search_setup(pol, model)
    tokens = cal.calibration_tokens(tokenizer, load_text(CALIBRATE_TEXT), pol.budget_ref)
    cal.score_window, cal.window = timed_score, timed_window
    fused_select.enabled = fused
    before = loadavg()
    t0 = time.perf_counter()
    try:  # the search `calibration_record` runs where nothing is stored (nothing is written here)
        choice = ic._search(pol, model, tokens, "benchmark", setup, CALIBRATE_TARGET, CALIBRATE_BOUND,
                            CALIBRATE_TEXT, progress=False)
    finally:
        cal.score_window, cal.window = score_window, window
        fused_select.enabled = True
    record = ic._record(pol, choice, setup, "computed")
    total = time.perf_counter() - t0
    return {"fused": fused, "seconds": total, "window_seconds": passes[0], "pass_seconds": passes[1:],
            "loadavg_before": before, "loadavg_after": loadavg(), "chosen": record["chosen"],
            "reached": record["reached"], "trials": record["trials"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--order", default="fused,torch", help="which search runs first")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from infinigen.kernels import fused_select
    from infinigen.loading import load
    from infinigen.policies.infinigen import InfiniGen

    torch.set_num_threads(args.threads)
    model, tokenizer, name = load(args.model, "float32", "cpu", weights="fp32")
    pol = InfiniGen(calibrate=True).prepare_skew(model, tokenizer, progress=True)
    assert fused_select.available(), "the fused kernel did not build"
    runs = [run_search(pol, model, tokenizer, part == "fused") for part in args.order.split(",")]
    by = {("fused" if r["fused"] else "torch"): r for r in runs}
    f, t = by["fused"], by["torch"]
    print(f"{name}, {args.threads} thread(s), float32 dense weights")
    print("| candidate | torch: s | fused: s | torch: vs full, KV | fused: vs full, KV |")
    print("|---|---|---|---|---|")
    for i, (a, b) in enumerate(zip(t["trials"], f["trials"])):
        print(f"| {a['knobs']} | {t['pass_seconds'][i]:.1f} | {f['pass_seconds'][i]:.1f} | "
              f"{100 * a['vs_full']:+.3f}%, {100 * a['kv']:.2f}% | {100 * b['vs_full']:+.3f}%, {100 * b['kv']:.2f}% |")
    for r in runs:
        kind = "fused" if r["fused"] else "torch"
        print(f"{kind}: {r['seconds']:.1f} s in all (shared dense pass {r['window_seconds']:.1f} s, candidates "
              f"{sum(r['pass_seconds']):.1f} s), load {r['loadavg_before']} -> {r['loadavg_after']}; chose "
              f"{r['chosen']} (reached: {r['reached']})")
    same = (f["chosen"] == t["chosen"] and [x["knobs"] for x in f["trials"]] == [x["knobs"] for x in t["trials"]])
    print(f"same candidates and choice: {same}; total ratio torch / fused: {t['seconds'] / f['seconds']:.2f}x; "
          f"candidate passes: {sum(t['pass_seconds']) / sum(f['pass_seconds']):.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": name, "threads": args.threads, "runs": runs, "same_choice": same}, fh, indent=1,
                      default=lambda x: x if math.isfinite(x) else None)


if __name__ == "__main__":
    main()
