"""Evaluation on the default model: few-shot accuracy, long-context retrieval and the
paper's analyses, for the full cache, InfiniGen and H2O at InfiniGen's relative KV size.

    OMP_NUM_THREADS=2 python benchmarks/evaluation.py          # writes results/evaluation/evaluation.md (+ PNGs, .json)
    python benchmarks/evaluation.py --quick --out /tmp/eval/evaluation.md  # a smoke run at tiny sizes

Steps:
  1. H2O's budget: InfiniGen's (default settings) relative KV size over all layers, measured by
     perplexity on Pride and Prejudice (--match-ctx tokens, first 128 dense); H2O then keeps half of
     that share as heavy hitters and half as recent tokens (its own default split).
  2. Few-shot (BIG-bench, 5 shots): the context is the dense prefill and the answer choices are decoded
     with the policy; then a subset with half of the context decoded too (--prefill-frac 0.5), where the
     policy also shapes the hidden state the first answer token comes from.
  3. Needle retrieval: passkey (filler haystack) and needle-in-a-haystack (Paul Graham essays).
  4. `infinigen analyze` at a small window (InfiniGen with the paper's settings there).
Accuracy does not depend on timing; the wall time of each step is reported for orientation only.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from infinigen.bench import cpu_name  # noqa: E402
from infinigen.eval import analyze as an  # noqa: E402
from infinigen.eval import fewshot as fs  # noqa: E402
from infinigen.eval import needle as nd  # noqa: E402
from infinigen.eval.policyset import prepare  # noqa: E402
from infinigen.eval.ppl import load_text, perplexity, token_windows  # noqa: E402
from infinigen.loading import load  # noqa: E402
from infinigen.policies import make_policy  # noqa: E402

FEWSHOT_TASKS = ["cause_and_effect/one_sentence", "cause_and_effect/two_sentences", "general_knowledge",
                 "logical_deduction/three_objects", "social_iqa", "analytic_entailment"]
FEWSHOT_HALF_TASKS = ["analytic_entailment", "entailed_polarity", "cause_and_effect/two_sentences"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "evaluation" / "evaluation.md")
    ap.add_argument("--parts", default="fewshot,needle,analyze")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--limit", type=int, default=8, help="few-shot examples per task")
    ap.add_argument("--half-limit", type=int, default=5, help="few-shot examples per task with --prefill-frac 0.5")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--depths", default="0,0.5,1")
    ap.add_argument("--analyze-tokens", type=int, default=512)
    ap.add_argument("--match-ctx", type=int, default=1024)
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if args.quick:
        args.limit, args.half_limit, args.lengths, args.depths = 2, 1, "512", "0.5"
        args.analyze_tokens, args.match_ctx = 160, 256
    figdir = args.out.parent  # the study's folder: the report, its PNGs and analyze.md side by side
    figdir.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    model, tok, name = load("default", progress=False)
    infinigen = make_policy("infinigen", dense_below=0)  # the selection at every length
    infinigen = prepare({"infinigen": infinigen}, model, tok, progress=True)["infinigen"]
    timings, raw = {}, {}

    # 1. H2O at InfiniGen's relative KV size
    t = time.perf_counter()
    ids = token_windows(tok, load_text("prideprejudice"), args.match_ctx, 1)
    probe = perplexity(model, tok, None, infinigen, prefill=128, tokens=ids)
    kv = probe.kv_all
    h2o = make_policy("h2o", heavy_ratio=kv / 2, recent_ratio=kv / 2)
    h2o_probe = perplexity(model, tok, None, h2o, prefill=128, tokens=ids)
    full_probe = perplexity(model, tok, None, make_policy("full"), prefill=128, tokens=ids)
    timings["matching"] = time.perf_counter() - t
    pols = {"full": make_policy("full"), "infinigen": infinigen, "h2o": h2o}
    raw["matching"] = {"ctx": args.match_ctx, "prefill": 128, "infinigen_kv": kv, "h2o_kv": h2o_probe.kv_all,
                       "ppl": {"full": full_probe.perplexity, "infinigen": probe.perplexity,
                               "h2o": h2o_probe.perplexity},
                       "h2o_ratios": {"heavy_ratio": kv / 2, "recent_ratio": kv / 2}}

    knobs = ("partial_ratio", "max_fetch_ratio", "dense_layers", "budget", "spec_input", "key_mode", "skew")
    ig_desc = ", ".join([f"alpha {getattr(infinigen, '_alpha', infinigen.alpha)}"]
                        + [f"{k} {getattr(infinigen, k)}" for k in knobs])
    md = [f"# Evaluation: {name}", "",
          f"Machine: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{platform.system()} {platform.release()}; {datetime.date.today().isoformat()}. "
          f"Produced by `python benchmarks/evaluation.py "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}`.".rstrip(), "",
          "Policies: **full** cache; **infinigen** with its default settings (`make_policy(\"infinigen\")`: "
          f"{ig_desc}); **h2o** with heavy_ratio = recent_ratio = {kv / 2:.3f}, i.e. "
          f"InfiniGen's relative KV size ({kv:.3f} over all layers, measured by perplexity on Pride and Prejudice, "
          f"{args.match_ctx} tokens, 128 dense). On that window: perplexity full {full_probe.perplexity:.3f}, "
          f"infinigen {probe.perplexity:.3f} (KV {kv:.3f}), "
          f"h2o {h2o_probe.perplexity:.3f} (KV {h2o_probe.kv_all:.3f}).", ""]

    if "fewshot" in parts:
        from tqdm import tqdm
        root = fs.find_root()
        tasks = {n: fs.Task.load(n, p) for n, p in fs.list_tasks(root).items()}
        md += ["## Few-shot accuracy (BIG-bench, 5-shot, log-likelihood)", "",
               "As lm-evaluation-harness scores multiple choice: sum of the choice's token log-probabilities "
               "(acc), or divided by its length in bytes (acc_norm). Agreement: share of examples whose "
               "predicted choice (by acc) equals the full cache's. Relative KV size: over the decoded rows.", ""]
        for frac, names, limit in ((1.0, FEWSHOT_TASKS, args.limit), (0.5, FEWSHOT_HALF_TASKS, args.half_limit)):
            t = time.perf_counter()
            res = []
            total = sum(min(limit, len(tasks[n].examples)) for n in names) * len(pols)
            with tqdm(total=total, desc=f"fewshot (prefill fraction {frac:g})", file=sys.stderr) as bar:
                for n in names:
                    res += fs.evaluate_task(model, tok, tasks[n], pols, shots=5, limit=limit, prefill_frac=frac,
                                            progress=bar.update)
            timings[f"fewshot {frac:g}"] = time.perf_counter() - t
            raw[f"fewshot_{frac:g}"] = [r.to_dict(True) for r in res]
            head = ("The context is the dense prefill; the answer choices are decoded with the policy "
                    "(a one-token choice is scored from the dense prompt, so no policy changes it)." if frac == 1 else
                    "The first half of the context is the dense prefill; its second half and the answer "
                    "choices are decoded with the policy.")
            md += [f"### Prefill fraction {frac:g} ({limit} examples per task)", "", head, "",
                   fs.markdown_table(res), "", fs.markdown_table(fs.summarize(res)), ""]

    if "needle" in parts:
        from tqdm import tqdm
        lengths = [int(x) for x in args.lengths.split(",")]
        depths = [float(x) for x in args.depths.split(",")]
        t = time.perf_counter()
        total = 2 * len(lengths) * len(depths) * len(pols)
        with tqdm(total=total, desc="needle", file=sys.stderr) as bar:
            res = nd.evaluate(model, tok, pols, ("passkey", "niah"), lengths, depths, progress=bar.update)
        timings["needle"] = time.perf_counter() - t
        png = nd.heatmap(res, figdir / "needle_heatmap.png")
        raw["needle"] = nd.to_json(res)
        md += ["## Long-context retrieval", "",
               "Greedy answers with the chat template; passkey: a random 5-digit key in the passkey paper's "
               "filler text, scored 1 if the answer's first number is the key; niah: Kamradt's San Francisco "
               "needle in Paul Graham's essays, scored by the share of its key phrases (sandwich, Dolores Park) "
               "in the answer. The prompt is prefilled densely; the policy acts on the answer's decoding steps.", "",
               nd.markdown_tables(res), "", f"![needle heat map]({png.name})", "",
               "<details><summary>answers</summary>", "",
               "| task | policy | length | depth | score | answer |", "|---|---|---:|---:|---:|---|"]
        md += [f"| {r.task} | {r.policy} | {r.length} | {r.depth:g} | {r.score:g} | {r.output.strip()!r} |"
               for r in res]
        md += ["", "</details>", ""]

    if "analyze" in parts:
        from tqdm import tqdm
        t = time.perf_counter()
        n = args.analyze_tokens
        ids = token_windows(tok, load_text("prideprejudice"), n, 1)
        st = an.Settings(tokens=n, prefill=min(64, n // 4), alphas=(1, 3, 5, 7, 9), ratios=(0.1, 0.3, 0.5, 1.0))
        with tqdm(total=an.steps(an.ANALYSES, st), desc="analyze", file=sys.stderr) as bar:
            report = an.run(model, tok, ids, figdir, an.ANALYSES, st, name, "prideprejudice.txt", progress=bar.update)
        timings["analyze"] = time.perf_counter() - t
        body = report.split("\n", 1)[1].replace("\n## ", "\n### ")
        md += ["## The paper's analyses (`infinigen analyze`)", "",
               f"`infinigen analyze --tokens {n} --prefill {st.prefill} --alphas 1,3,5,7,9 --ratios 0.1,0.3,0.5,1.0` "
               "(InfiniGen with the paper's settings: alpha 5, partial ratio 0.3, speculation from layer i-1's "
               "attention input, head-averaged budget).", body, ""]

    timings["total"] = time.perf_counter() - t0
    md += ["## Wall time", "", "| step | seconds |", "|---|---:|"]
    md += [f"| {k} | {v:.0f} |" for k, v in timings.items()]
    md.append("")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(md))
    args.out.with_suffix(".json").write_text(json.dumps({"model": name, "cpu": cpu_name(),
                                                         "threads": torch.get_num_threads(),
                                                         "omp": os.environ.get("OMP_NUM_THREADS"), "timings": timings,
                                                         **raw}, indent=1, default=str))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
