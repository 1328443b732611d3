"""Issue 12's tuning: which layers to keep dense and how to spread the KV budget, on the calibration
split only (Emma, Mansfield Park; the validation texts are in `accuracy_table.py --validation`).

Candidates, all at the same all-layer bound (kv_budget 0.2 at context 2048, prefill 256):
  dense 0,1      layers 0 and 1 read in full (the issue 3 preset), the other caps derived from the bound
  dense 0        layer 1 speculated from layer 0's attention output
  exact first    no dense layer: layer 0 selects with its exact query
  + budget_power 0.5 / 1: layer caps spread by the calibrated attention sparsity
  + alpha 9      more tokens qualify, up to the caps (with exact first: the default it chose)

    OMP_NUM_THREADS=2 python benchmarks/budget_tuning.py     # writes results/budget_tuning/budget_tuning.md (+ .json)
    python benchmarks/budget_tuning.py --texts emma --configs full,exact_first

Each record keeps the code it was measured with (`code`): runs of an earlier prototype are labelled so
in the table until this script re-measures them.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from infinigen.eval.ppl import perplexity, resolve_text, token_windows  # noqa: E402
from infinigen.loading import load  # noqa: E402
from infinigen.placement import Placement  # noqa: E402
from infinigen.policies import make_policy  # noqa: E402

CALIB_SPLIT = ("emma", "mansfieldpark")
CONFIGS = {  # alpha pinned: the default's alpha is what this chose
    "full": ("full cache", "full", {}),
    "dense01": ("dense 0,1 (the issue 3 preset)", "infinigen", dict(dense_layers=(0, 1), exact_first=False, alpha=7.0)),
    "dense0": ("dense 0 (layer 1 speculated)", "infinigen", dict(dense_layers=(0,), exact_first=False, alpha=7.0)),
    "exact_first": ("exact first (no dense layer)", "infinigen", dict(dense_layers=(), exact_first=True, alpha=7.0)),
    "dense0_p1": ("dense 0, budget_power 1", "infinigen",
                  dict(dense_layers=(0,), exact_first=False, budget_power=1.0, alpha=7.0)),
    "exact_first_p05": ("exact first, budget_power 0.5", "infinigen",
                        dict(dense_layers=(), exact_first=True, budget_power=0.5, alpha=7.0)),
    "exact_first_p1": ("exact first, budget_power 1", "infinigen",
                       dict(dense_layers=(), exact_first=True, budget_power=1.0, alpha=7.0)),
    "exact_first_a9": ("exact first, alpha 9 (the default)", "infinigen",
                       dict(dense_layers=(), exact_first=True, alpha=9.0)),
    # tokens read ~ sqrt(cached length): 13% at 2048 tokens, so that a run with prefill 1/8 of the context
    # averages 19% at context 2048 and 9.6% at 8192 (the mean of 0.13 * sqrt(2048 / n) over n in [N/8, N])
    "growth05": ("exact first, alpha 9, tokens ~ sqrt(length): 13% at 2048", "infinigen",
                 dict(dense_layers=(), exact_first=True, alpha=9.0, budget_growth=0.5, kv_budget=0.13)),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", default=",".join(CALIB_SPLIT))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--kv-budget", type=float, default=0.2)
    ap.add_argument("--calib", default="emma")
    ap.add_argument("--out", default=str(ROOT / "results" / "budget_tuning" / "budget_tuning.md"))
    ap.add_argument("--report-only", action="store_true", help="rewrite the table from the .json")
    args = ap.parse_args(argv)
    jpath = Path(args.out).with_suffix(".json")
    runs = json.loads(jpath.read_text())["runs"] if jpath.exists() else []
    if not args.report_only:
        model, tok, name = load("default", progress=False)
        commit = _commit()
        for text in args.texts.split(","):
            ids = token_windows(tok, resolve_text(text).read_text(encoding="utf-8"), args.ctx, 1)
            for c in args.configs.split(","):
                label, policy, knobs = CONFIGS[c]
                if policy == "infinigen":
                    # a config's own budget wins
                    knobs = dict(dict(kv_budget=args.kv_budget, calib=args.calib, dense_below=0), **knobs)
                pol = make_policy(policy, **knobs).prepare(model, tok)
                t0 = time.perf_counter()
                r = perplexity(model, tok, None, pol, prefill=args.prefill, tokens=ids, placement=Placement())
                rec = {"config": c, "text": text, "ctx": args.ctx, "prefill": args.prefill, "ppl": r.perplexity,
                       "kv_all": r.kv_all, "kv_speculated": r.kv_speculated, "kv_per_layer": r.kv_per_layer,
                       "settings": pol.settings(model), "seconds": time.perf_counter() - t0,
                       "code": f"budget_tuning.py at {commit}", "model": name}
                runs = [x for x in runs if (x["config"], x["text"], x["ctx"]) != (c, text, args.ctx)] + [rec]
                jpath.parent.mkdir(parents=True, exist_ok=True)
                jpath.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
                print(f"{text} {label}: ppl {r.perplexity:.3f}, KV {100 * r.kv_all:.1f}%", file=sys.stderr)
    write(args, runs)
    return 0


def _commit() -> str:
    import subprocess
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:  # not a checkout
        return "unknown"


def _table(runs, texts, ctx, full) -> list[str]:
    lines = ["| configuration | " + " | ".join(f"{t}: KV | ppl | vs full" for t in texts) + " | code |",
             "|---|" + "---|---|---|" * len(texts) + "---|"]
    for c, (label, _, _) in CONFIGS.items():
        cells, code = [], set()
        for t in texts:
            r = next((x for x in runs if x["config"] == c and x["text"] == t and x["ctx"] == ctx), None)
            if r is None:
                cells += ["-", "-", "-"]
                continue
            code.add(r["code"])
            gap = f"{100 * (r['ppl'] / full[t] - 1):+.2f}%" if t in full and c != "full" else ""
            cells += [f"{100 * r['kv_all']:.1f}%", f"{r['ppl']:.3f}", gap]
        if code:
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {'; '.join(sorted(code))} |")
    return lines


def write(args, runs) -> None:
    texts = [t for t in CALIB_SPLIT if any(r["text"] == t for r in runs)]
    others = sorted({r["text"] for r in runs} - set(CALIB_SPLIT))
    full = {r["text"]: r["ppl"] for r in runs if r["config"] == "full" and r["ctx"] == args.ctx}
    val = ROOT / "results" / "accuracy" / "accuracy_validation.json"  # accuracy_table.py's full-cache runs
    if val.exists():
        for r in json.loads(val.read_text())["runs"]:
            if r["policy"] == "full" and r["label"].endswith(f" {args.ctx}"):
                full.setdefault(r["label"].split(", ")[1].split()[0], r["perplexity"])
    lines = [
        "# Issue 12 tuning on the calibration split",
        "",
        f"Generated by `benchmarks/budget_tuning.py` on {datetime.date.today().isoformat()}. Context {args.ctx}, "
        f"prefill {args.prefill}, one all-layer bound of {100 * args.kv_budget:g}% of the KV (dense layers count "
        "100%); the other knobs of the default preset. KV: the share read over all layers. `code` says what "
        "measured the row. The default preset was chosen on these two texts only.",
        "",
    ] + _table(runs, texts, args.ctx, full)
    if others:
        lines += ["", "For comparison only (not used to choose): the same configurations on validation texts "
                  "(their full-cache perplexity from results/accuracy/accuracy_validation.json).", ""]
        lines += _table(runs, others, args.ctx, full)
    out = Path(args.out)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
