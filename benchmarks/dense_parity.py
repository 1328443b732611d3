"""InfiniGen below its crossing against the full cache: the same decoding step (`Policy.reads_all`), measured.

Side by side in one process, steps interleaved (the order rotated each step): the full cache, the default
InfiniGen (reading densely below its crossing), and the same InfiniGen made to ask its `keep` at every layer
(what the step did before `reads_all`: the plan asked one layer ahead, the per-layer read). Reports ms per step
(median and minimum) and the aten calls of one step (torch profiler: all aten events, and the top-level ones).
Writes results/default_preset_speed/dense_parity.{md,json}."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

import infinigen  # noqa: E402
from infinigen import compiled, runtime  # noqa: E402
from infinigen.bench.side_by_side import staggered_prompts, text_ids  # noqa: E402
from infinigen.placement import Placement  # noqa: E402
from infinigen.policies import make_policy  # noqa: E402
from infinigen.policy import Policy  # noqa: E402

SYSTEMS = ("full", "infinigen", "infinigen_per_layer")


class _AskingEveryLayer:
    """While active, InfiniGen answers `reads_all` as the base class does for it (False): its step asks `keep`
    at every layer, as before `reads_all` existed."""

    def __init__(self, policy):
        self.cls = type(policy)

    def __enter__(self):
        self.saved = self.cls.reads_all
        self.cls.reads_all = Policy.reads_all

    def __exit__(self, *exc):
        self.cls.reads_all = self.saved


def _step(model, token, sess, name):
    if name == "infinigen_per_layer":
        with _AskingEveryLayer(sess.policy):
            return runtime.decode(model, token, sess)
    return runtime.decode(model, token, sess)


def aten_calls(model, sess, token, name) -> tuple[int, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(model, token, sess, name)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return len(events), len(top)


def run_case(model, tok, policies, parts, prompt: int, batch: int, steps: int) -> dict:
    prompts = staggered_prompts(text_ids(tok), prompt, batch)
    sessions, tokens, times = {}, {}, {name: [] for name in SYSTEMS}
    with torch.inference_mode():
        for name in SYSTEMS:
            sessions[name] = Placement().new_session(model, batch, prompt + steps + 8, policies[name])
            tokens[name] = runtime.prefill(model, prompts, sessions[name]).argmax(-1)
        parts.warm(model, batch)
        same, whole = True, {name: 0 for name in SYSTEMS}
        for step in range(steps):
            logits = {}
            order = SYSTEMS[step % 3:] + SYSTEMS[:step % 3]
            for name in order:
                whole[name] += parts.runs_whole(model, sessions[name])
                t0 = time.perf_counter()
                logits[name] = _step(model, tokens[name], sessions[name], name)
                times[name].append(time.perf_counter() - t0)
                tokens[name] = logits[name].argmax(-1)
            same &= all(torch.equal(logits["full"], logits[name]) for name in SYSTEMS)
        ops = {name: aten_calls(model, sessions[name], tokens[name], name) for name in SYSTEMS}
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    row = {"prompt": prompt, "batch": batch, "steps": steps, "same_logits": same, "load_after": load,
           "dense_below": sessions["infinigen"].state.dense_below}
    for name in SYSTEMS:
        row[name] = {"ms_median": round(1e3 * statistics.median(times[name][2:]), 2),
                     "ms_min": round(1e3 * min(times[name][2:]), 2), "aten": ops[name][0], "aten_top": ops[name][1],
                     "whole_steps": whole[name]}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cases", default="512x1:40,512x4:30,4096x1:30", help="PROMPTxBATCH:STEPS, comma separated")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "default_preset_speed" / "dense_parity.md")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    with open("/proc/loadavg") as f:
        load_before = " ".join(f.read().split()[:3])
    model, tok, name = infinigen.load("default", dtype="auto", weights="auto")
    infinigen_policy = make_policy("infinigen").prepare(model, tok)
    policies = {"full": make_policy("full").prepare(model, tok), "infinigen": infinigen_policy,
                "infinigen_per_layer": infinigen_policy}
    parts = compiled.StepParts()
    model.step_parts = parts
    rows = []
    for case in a.cases.split(","):
        shape, steps = case.split(":")
        prompt, batch = (int(x) for x in shape.split("x"))
        row = run_case(model, tok, policies, parts, prompt, batch, int(steps))
        print(json.dumps(row), flush=True)
        rows.append(row)
    cmd = " ".join(["python benchmarks/dense_parity.py"] + (argv if argv is not None else sys.argv[1:]))
    lines = [f"# InfiniGen below its crossing against the full cache ({name}, {a.threads} threads)", "",
             f"`{cmd}`, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.__version__}; load (1/5/15 min) "
             f"before: {load_before}. Steps interleaved in one process, the order rotated each step; "
             "`per layer`: the same InfiniGen asking its `keep` at every layer (the step before `reads_all`).", "",
             "| case | ms/step full | ms/step InfiniGen | ms/step per layer | InfiniGen over full (median, min) "
             "| aten calls full / InfiniGen / per layer (top-level) | same logits | load after |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, i, p = r["full"], r["infinigen"], r["infinigen_per_layer"]
        lines.append(f"| {r['prompt']} x {r['batch']} | {f['ms_median']} (min {f['ms_min']}) | {i['ms_median']} "
                     f"(min {i['ms_min']}) | {p['ms_median']} (min {p['ms_min']}) | "
                     f"{f['ms_median'] / i['ms_median']:.2f}x, {f['ms_min'] / i['ms_min']:.2f}x | "
                     f"{f['aten']} / {i['aten']} / {p['aten']} ({f['aten_top']} / {i['aten_top']} / {p['aten_top']}) "
                     f"| {r['same_logits']} | {r['load_after']} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines) + "\n")
    a.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
