"""What the server's batch-invariant decoding costs per step (results/batch_invariant/batch_invariant.md).

The default model as `serve` loads it (dtype auto, its Q4_1 weights); for each policy and batch size, two
sets of sessions over the same prompts decode side by side in one process, steps interleaved: today's fast
path (the compiled step, one padded attention call over every row) and the batch-invariant one (the eager
step, each session's own attention call). Prints the median ms per step of each and their ratio.

    PYTHONPATH=src python benchmarks/batch_invariant_cost.py [--steps 24] [--batches 1,8]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    args = ap.parse_args()
    from infinigen import compiled, runtime
    from infinigen.loading import load
    from infinigen.paths import resolve_text
    from infinigen.placement import Placement
    from infinigen.policies import make_policy
    torch.set_grad_enabled(False)
    model, tok, _ = load("default", dtype="auto", progress=False)
    text = resolve_text("emma").read_text(encoding="utf-8")
    ids = tok(text[:200_000])["input_ids"]
    batches = [int(b) for b in args.batches.split(",")]
    parts = compiled.enable(model, "on")
    for b in batches:
        parts.warm(model, b)
    print(f"dtype {model.dtype}, prompt {args.prompt}, {args.steps} steps, {torch.get_num_threads()} threads")
    for name in ("full", "infinigen"):
        pol = make_policy("full") if name == "full" else make_policy("infinigen", calibrate=False, dense_below=0)
        pol = pol.prepare(model, tok, progress=False)
        for b in batches:
            prompts = [ids[i * 997:i * 997 + args.prompt] for i in range(b)]

            def opened():
                out = []
                for p in prompts:
                    s = Placement().new_session(model, 1, len(p) + args.steps + 2, pol, prompt_len=None)
                    runtime.prefill(model, torch.tensor([p]), s)
                    out.append(s)
                return out
            fast, inv = opened(), opened()
            tokens = torch.tensor([p[-1] for p in prompts])
            times = {False: [], True: []}
            for _ in range(args.steps):
                for invariant, sessions in ((False, fast), (True, inv)):
                    t0 = time.perf_counter()
                    runtime.decode(model, tokens, sessions if b > 1 else sessions[0], batch_invariant=invariant)
                    times[invariant].append(time.perf_counter() - t0)
            a, c = (statistics.median(times[k][2:]) * 1e3 for k in (False, True))
            print(f"{name:9s} batch {b}: compiled+padded {a:.1f} ms/step, invariant {c:.1f} ms/step, "
                  f"ratio {c / a:.2f}", flush=True)


if __name__ == "__main__":
    main()
