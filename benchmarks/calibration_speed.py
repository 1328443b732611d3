"""InfiniGen's calibration search, timed, and its candidate passes by two scoring paths side by side.

1. The search `prepare` runs (`policies/infinigen_calibration._search`: one shared dense pass, then each candidate's
   rows after the prompt), timed (wall and process CPU seconds, each pass apart), its trials compared with those of
   the artifact the package ships for the default model.
2. Side by side in one process, alternating: the shared dense pass and the passes of `--compare` candidates of that
   search (default: the first and the chosen one) by two of these paths (`--paths`, default exact,fast): "torch"
   (the rows chosen by torch in blocks of 64, `runtime.attend_rows`, the float32 head, every layer run), "exact"
   (the fused kernel: `infinigen_select.rows_fused`, `runtime.attend_rows`; the float32 head, every layer
   run), "fast" (what the search runs now: the fused kernel, `calibrate.head_nll` over a large vocabulary, each
   candidate's rows entering its first selecting layer from the shared pass: `calibrate.shared_layers`); with how
   far the loss moved between them.
3. `--early-stop N`: the whole search N times each way, alternating: "one pass" (every candidate's rows in one
   block, run to the end: the search before) and "early stop" (rows in blocks of `calibrate.BLOCK_ROWS`, a
   candidate stopped once it certainly misses the target: policies/calibrate_stop.py); each's CPU seconds, choice,
   and per candidate its loss, reads and the tokens it scored.
4. `--low-precision N`: the whole search N times each way, alternating: "float32" (what the search runs), "bf16
   layers" (a candidate's dense layers multiply in bfloat16: `low_blocks`) and "bf16 layers and window" (the
   shared dense pass too), or `--ways` of these and "head before" (`calibrate.head_nll` before its reused
   buffers and in-place log-sum-exp); each's CPU seconds, choice, and per candidate its loss and reads.
5. `--crossing N`: where selection pays (policies/crossing.py), measured N times each way, alternating: "sweep"
   (the measurement before: three lengths, ctx/16, ctx/4 and ctx, each 2 untimed then 7 timed interleaved steps
   of each system, medians, `crossing_from`) and "search" (`crossing.measure`: a few lengths, each timed until
   its side is clear); the policy measured is the model's calibrated one (found in the cache, else searched).
/proc/loadavg is printed before and after each part (the machine may be shared: compare ratios).

    PYTHONPATH=src python benchmarks/calibration_speed.py [--model M] [--threads 2] [--compare 0,-1]
        [--paths exact,fast] [--knobs '[{...}, ...]'] [--early-stop N] [--low-precision N] [--crossing N]
        [--json F]
"""
from __future__ import annotations

import argparse
import json
import math
import time


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


class Clock:
    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def low_blocks(model):
    """The model's blocks with every nn.Linear multiplying in bfloat16 (input and weight rounded, float32 sums),
    returning float32 with the bias added in float32; every other module and tensor is the model's own."""
    import copy

    import torch
    import torch.nn.functional as F
    from torch import nn

    class LowLinear(nn.Module):
        def __init__(self, linear: nn.Linear):
            super().__init__()
            self.low = linear.weight.detach().to(torch.bfloat16)
            self.bias = None if linear.bias is None else linear.bias.detach()

        def forward(self, x):
            y = F.linear(x.to(torch.bfloat16), self.low).float()
            return y if self.bias is None else y + self.bias

    blocks = []
    for block in model.layers:
        twin = copy.deepcopy(block, memo={id(t): t for t in [*block.parameters(), *block.buffers()]})
        for name, m in list(twin.named_modules()):
            if type(m) is nn.Linear:
                parent, _, leaf = name.rpartition(".")
                setattr(twin.get_submodule(parent) if parent else twin, leaf, LowLinear(m))
        blocks.append(twin)
    return nn.ModuleList(blocks)


def fused_search(pol, model, tokenizer, low: tuple = ()) -> dict:
    """The search, each pass timed; `low`: the passes ("window", "score_rows") run with `low_blocks`."""
    from infinigen.paths import load_text
    from infinigen.policies import calibrate as cal
    from infinigen.policies import infinigen_calibration as ic
    from infinigen.policies.infinigen_settings import CALIBRATE_BOUND, CALIBRATE_TARGET, CALIBRATE_TEXT

    passes = []
    score_rows, window = cal.score_rows, cal.window
    layers = {"float32": model.layers, "bf16": low_blocks(model) if low else None}

    def timed(fn):
        def run(*a, **k):
            model.layers = layers["bf16" if fn.__name__ in low else "float32"]
            try:
                with Clock() as c:
                    out = fn(*a, **k)
            finally:
                model.layers = layers["float32"]
            passes.append((c.wall, c.cpu))
            return out
        return run

    setup = ic.search_setup(pol, model)
    tokens = cal.calibration_tokens(tokenizer, load_text(CALIBRATE_TEXT), pol.budget_ref)
    cal.score_rows, cal.window = timed(score_rows), timed(window)
    before = loadavg()
    try:  # the search `calibration_record` runs where nothing is stored (nothing is written here)
        with Clock() as c:
            choice = ic._search(pol, model, tokens, "benchmark", setup, CALIBRATE_TARGET, CALIBRATE_BOUND,
                                CALIBRATE_TEXT, progress=False)
    finally:
        cal.score_rows, cal.window = score_rows, window
    return {"wall": c.wall, "cpu": c.cpu, "window": passes[0], "passes": passes[1:], "loadavg": [before, loadavg()],
            "choice": choice, "tokens": tokens, "setup": setup}


def shipped_trials(model) -> list | None:
    """The trials of the calibration the package ships for this model (None: it ships none)."""
    from safetensors import safe_open

    from infinigen.skew import model_fingerprint, shipped_calibration_dir
    for path in sorted(shipped_calibration_dir().glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("fingerprint") != model_fingerprint(model):
            continue
        for k, v in meta.items():
            if k.startswith("calibration-"):
                stored = json.loads(v)
                return [dict(t, vs_full=math.expm1(t["nll"] - stored["reference_nll"])) for t in stored["trials"]]
    return None


KINDS = {"torch": "torch", "fused": "fused", "exact": "float32 head, every layer", "fast": "fast"}


class ScoringPath:
    """One way of scoring a candidate, set while in use: "torch" (the rows chosen by torch in blocks, the
    float32 head, every layer run), "exact" (the fused kernel, the float32 head, every layer run: the search
    before the fast head), "fused"/"fast" (what the search runs now: the fused kernel, the bfloat16 head with
    its top logits in float32, the candidate's rows entering its first selecting layer from the shared pass)."""

    def __init__(self, kind: str):
        self.kind = kind

    def __enter__(self):
        from infinigen.kernels import fused_select
        from infinigen.policies import calibrate as cal
        self.saved = (fused_select.enabled, cal.BF16_HEAD_VOCAB, cal.shared_layers)
        fused_select.enabled = self.kind != "torch"
        if self.kind in ("torch", "exact"):
            cal.BF16_HEAD_VOCAB = 1 << 62
            cal.shared_layers = lambda *a: 0
        return self

    def __exit__(self, *exc):
        from infinigen.kernels import fused_select
        from infinigen.policies import calibrate as cal
        fused_select.enabled, cal.BF16_HEAD_VOCAB, cal.shared_layers = self.saved


def side_by_side(pol, model, found: dict, candidates: list, kinds=("torch", "fused")) -> list:
    """Each candidate's pass by each path, alternating, and the shared dense pass (`window`) by each."""
    from infinigen.policies import calibrate as cal
    from infinigen.policies.infinigen_calibration import candidate

    wins, rows = {}, []
    row = {"knobs": "shared dense pass", "loadavg_before": loadavg()}
    for kind in kinds:
        with ScoringPath(kind), Clock() as c:
            wins[kind] = cal.window(model, found["tokens"], pol.budget_ref // 8)
        row[kind] = {"wall": c.wall, "cpu": c.cpu, "vs_full": 0.0, "kv": 1.0, "nll": wins[kind].reference_nll}
    row["loadavg_after"] = loadavg()
    rows.append(row)
    for knobs in candidates:
        cand = candidate(pol, model, knobs, found["setup"]["growth"])
        row = {"knobs": knobs, "loadavg_before": loadavg()}
        for kind in kinds:
            win = wins[kind]
            with ScoringPath(kind), Clock() as c:
                nll, kv = cal.score_window(model, win, cand)
            row[kind] = {"wall": c.wall, "cpu": c.cpu, "vs_full": math.expm1(nll - win.reference_nll), "kv": kv,
                         "nll": nll}
        row["loadavg_after"] = loadavg()
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare", default="0,-1", help="indices of the search's trials to time both ways")
    ap.add_argument("--knobs", default=None, help="a JSON list of candidates' knobs to time both ways, instead of "
                    "running the search first")
    ap.add_argument("--paths", default="exact,fast", help="the two ways to score them side by side: torch, exact "
                    "(fused kernel, float32 head, every layer) or fast (what the search runs now)")
    ap.add_argument("--early-stop", type=int, default=0, help="run the whole search N times each way (one pass "
                    "per candidate, and blocks stopped early), instead of the search's passes")
    ap.add_argument("--low-precision", type=int, default=0, help="run the whole search N times each way (float32, "
                    "bfloat16 layers, bfloat16 layers and shared pass), instead of the search's passes")
    ap.add_argument("--ways", default="float32,bf16 layers,bf16 layers and window", help="with --low-precision: "
                    "the ways compared, of " + ", ".join(WAYS))
    ap.add_argument("--crossing", type=int, default=0, help="measure where selection pays N times each way (sweep "
                    "and search), instead of the search's passes")
    ap.add_argument("--dtype", default="float32", help="with --crossing: the compute dtype (calibrate's: float32)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from infinigen.kernels import fused_select
    from infinigen.loading import load
    from infinigen.policies.infinigen import InfiniGen

    torch.set_num_threads(args.threads)
    if args.crossing:
        crossings(args)
        return
    model, tokenizer, name = load(args.model, "float32", "cpu", weights="fp32")
    pol = InfiniGen(calibrate=True).prepare_skew(model, tokenizer, progress=True)
    assert fused_select.available(), "the fused kernel did not build"
    if args.knobs:
        side_only(pol, model, tokenizer, json.loads(args.knobs), args)
        return
    if args.early_stop:
        early_stop_searches(pol, model, tokenizer, name, args)
        return
    if args.low_precision:
        low_precision_searches(pol, model, tokenizer, name, args)
        return
    found = fused_search(pol, model, tokenizer)
    choice = found["choice"]
    print(f"{name}, {args.threads} thread(s), float32 dense weights")
    print(f"search: {found['wall']:.1f} s wall, {found['cpu']:.1f} s CPU; shared dense pass "
          f"{found['window'][0]:.1f} s; load {found['loadavg'][0]} -> {found['loadavg'][1]}; chose {choice.knobs} "
          f"(reached: {choice.reached})")
    shipped = shipped_trials(model)
    print("| candidate | pass: wall s, CPU s | vs full, KV | shipped: vs full, KV |")
    print("|---|---|---|---|")
    for i, t in enumerate(choice.trials):
        ref = shipped[i] if shipped and i < len(shipped) else None
        was = "" if ref is None else f"{100 * ref['vs_full']:+.3f}%, {100 * ref['kv']:.2f}%"
        wall, cpu = found["passes"][i]
        vs = math.expm1(t["nll"] - choice.reference_nll)
        print(f"| {t['knobs']} | {wall:.1f}, {cpu:.1f} | {100 * vs:+.3f}%, {100 * t['kv']:.2f}% | {was} |")
    same = shipped is not None and [t["knobs"] for t in shipped] == [t["knobs"] for t in choice.trials]
    print(f"the shipped search's candidates, in order: {same}")
    rows = side_by_side(pol, model, found, [found["choice"].trials[int(i)]["knobs"] for i in args.compare.split(",")],
                        args.paths.split(","))
    print_side_by_side(rows)
    if args.json:
        out = {"model": name, "threads": args.threads, "search": {k: found[k] for k in ("wall", "cpu", "window",
               "passes", "loadavg")}, "choice": choice.to_dict(), "shipped_trials": shipped, "side_by_side": rows}
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=str)


def early_stop_searches(pol, model, tokenizer, name: str, args) -> None:
    """The whole search `args.early_stop` times each way, alternating: "one pass" (EARLY_STOP off, every
    candidate's rows in one block) and "early stop" (what the search runs now)."""
    from infinigen.policies import calibrate as cal

    print(f"{name}, {args.threads} thread(s), float32 dense weights")
    print("| run | way | wall s | CPU s | shared pass CPU s | chosen | per candidate: vs full, KV, tokens scored, "
          "CPU s | load before -> after |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for run in range(args.early_stop):
        for way in (("one pass", "early stop") if run % 2 == 0 else ("early stop", "one pass")):
            saved = cal.EARLY_STOP, cal.BLOCK_ROWS
            if way == "one pass":
                cal.EARLY_STOP, cal.BLOCK_ROWS = False, 1 << 30
            try:
                found = fused_search(pol, model, tokenizer)
            finally:
                cal.EARLY_STOP, cal.BLOCK_ROWS = saved
            rows.append(search_row(run, way, found))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": name, "threads": args.threads, "searches": rows}, fh, indent=1, default=str)


def search_row(run: int, way: str, found: dict) -> dict:
    """One timed search's record (its choice, and per candidate its loss, reads, tokens and CPU), printed as a
    row of the table."""
    choice = found["choice"]
    trials = [{"knobs": t["knobs"], "vs_full": math.expm1(t["nll"] - choice.reference_nll), "kv": t["kv"],
               "nll": t["nll"], "rows": t["rows"], "cpu": cpu} for t, (_, cpu) in zip(choice.trials, found["passes"])]
    each = "; ".join(f"{100 * t['vs_full']:+.3f}%, {100 * t['kv']:.2f}%, {t['rows']}, {t['cpu']:.1f}" for t in trials)
    print(f"| {run} | {way} | {found['wall']:.1f} | {found['cpu']:.1f} | {found['window'][1]:.1f} | "
          f"{choice.knobs} | {each} | {found['loadavg'][0]} -> {found['loadavg'][1]} |", flush=True)
    return {"run": run, "way": way, "wall": found["wall"], "cpu": found["cpu"], "window_cpu": found["window"][1],
            "reference_nll": choice.reference_nll, "chosen": choice.knobs, "reached": choice.reached,
            "trials": trials, "loadavg": found["loadavg"]}


WAYS = {"float32": (), "bf16 layers": ("score_rows",), "bf16 layers and window": ("score_rows", "window"),
        "head before": "head before"}


def head_before(h, weight, low, targets, cap=None, exact=64, buffers=None):
    """`calibrate.head_nll` before its buffers: fresh tensors, the float32 copy ranked, torch.logsumexp."""
    import torch
    logits = (h.to(low.dtype) @ low.T).float()
    idx = torch.cat([logits.topk(min(exact, logits.shape[1]), dim=-1).indices, targets[:, None]], 1)
    logits.scatter_(1, idx, torch.einsum("nd,nkd->nk", h.float(), weight[idx].float()))
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return torch.logsumexp(logits, -1) - logits.gather(1, targets[:, None])[:, 0]


def low_precision_searches(pol, model, tokenizer, name: str, args) -> None:
    """The whole search `args.low_precision` times each way of `args.ways` (WAYS: which passes run `low_blocks`,
    or the head before its buffers), the order turned round each run."""
    from infinigen.policies import calibrate as cal

    ways = args.ways.split(",")
    print(f"{name}, {args.threads} thread(s), float32 dense weights")
    print("| run | way | wall s | CPU s | shared pass CPU s | chosen | per candidate: vs full, KV, tokens scored, "
          "CPU s | load before -> after |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for run in range(args.low_precision):
        for way in (ways if run % 2 == 0 else ways[::-1]):
            saved = cal.head_nll
            if WAYS[way] == "head before":
                cal.head_nll = head_before
            try:
                found = fused_search(pol, model, tokenizer, () if WAYS[way] == "head before" else WAYS[way])
            finally:
                cal.head_nll = saved
            rows.append(search_row(run, way, found))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": name, "threads": args.threads, "searches": rows}, fh, indent=1, default=str)


def sweep(model, policy) -> dict:
    """The crossing as measured before the search: every length of `crossing.lengths_for`, 2 untimed and 7 timed
    interleaved steps of each system there, the medians' ratio, `crossing.crossing_from`."""
    import dataclasses
    import statistics

    import torch

    from infinigen.policies import crossing
    t0 = time.perf_counter()
    selecting = dataclasses.replace(policy, dense_below=0, calibrate=False).with_skew(policy.matrices)
    gen = torch.Generator().manual_seed(0)
    lengths, ratio = crossing.lengths_for(model), []
    for n in lengths:
        pairs = list(crossing.step_pairs(model, selecting, n, gen, 1, 8))[1:]  # the first pair untimed too
        ratio.append(statistics.median(p for _, p in pairs) / statistics.median(f for f, _ in pairs))
    return {"lengths": lengths, "ratio": [round(r, 4) for r in ratio],
            "dense_below": crossing.crossing_from(lengths, ratio, model.cfg.max_position),
            "seconds": round(time.perf_counter() - t0, 2)}


def crossings(args) -> None:
    from infinigen.loading import load
    from infinigen.policies import crossing
    from infinigen.policies.infinigen import InfiniGen

    model, tokenizer, name = load(args.model, args.dtype, "cpu", weights="fp32" if args.dtype == "float32" else "auto")
    pol = InfiniGen(calibrate=True, dense_below=0).prepare(model, tokenizer, progress=True)  # calibrated, no crossing
    print(f"{name}, {args.threads} thread(s), {args.dtype}; policy {pol.settings(model)['calibration']['chosen']}")
    print("| run | way | lengths | ratio | dense_below | wall s | CPU s | load before -> after |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for run in range(args.crossing):
        for way in (("sweep", "search") if run % 2 == 0 else ("search", "sweep")):
            before = loadavg()
            with Clock() as c:
                got = sweep(model, pol) if way == "sweep" else crossing.measure(model, pol)
            rows.append({"run": run, "way": way, **got, "wall": c.wall, "cpu": c.cpu, "loadavg": [before, loadavg()]})
            print(f"| {run} | {way} | {got['lengths']} | {got['ratio']} | {got['dense_below']} | {c.wall:.1f} | "
                  f"{c.cpu:.1f} | {before} -> {loadavg()} |", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": name, "threads": args.threads, "dtype": args.dtype, "crossings": rows}, fh, indent=1)


def side_only(pol, model, tokenizer, knobs: list, args) -> None:
    from infinigen.paths import load_text
    from infinigen.policies import calibrate as cal
    from infinigen.policies import infinigen_calibration as ic
    from infinigen.policies.infinigen_settings import CALIBRATE_TEXT

    tokens = cal.calibration_tokens(tokenizer, load_text(CALIBRATE_TEXT), pol.budget_ref)
    rows = side_by_side(pol, model, {"tokens": tokens, "setup": ic.search_setup(pol, model)}, knobs,
                        args.paths.split(","))
    print(f"{args.model}, {args.threads} thread(s), float32 dense weights")
    print_side_by_side(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "threads": args.threads, "side_by_side": rows}, fh, indent=1)


def print_side_by_side(rows: list) -> None:
    old, new = [k for k in rows[0] if k in KINDS]
    print(f"| candidate | {KINDS[old]}: wall s, CPU s | {KINDS[new]}: wall s, CPU s | CPU ratio | {KINDS[old]}: vs "
          f"full, KV | {KINDS[new]}: vs full, KV | NLL moved | load before -> after |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = r[old], r[new]
        print(f"| {r['knobs']} | {a['wall']:.1f}, {a['cpu']:.1f} | {b['wall']:.1f}, {b['cpu']:.1f} | "
              f"{a['cpu'] / b['cpu']:.2f}x | {100 * a['vs_full']:+.3f}%, {100 * a['kv']:.2f}% | "
              f"{100 * b['vs_full']:+.3f}%, {100 * b['kv']:.2f}% | {b['nll'] - a['nll']:+.2e} | "
              f"{r['loadavg_before']} -> {r['loadavg_after']} |")


if __name__ == "__main__":
    main()
