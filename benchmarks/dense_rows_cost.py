"""What the batch-invariant step's dense rows cost (`qlinear.rows_as_alone(dense=True)`): a model with dense weights
(the default model with `--weights bf16`), N sessions decoded together with `batch_invariant=True`, each dense
`F.linear` once per row (this) against one matmul over the rows (before: rows that round apart from alone), the two
taking turns step by step in one process. Prints one JSON line per mode: median and best ms per step.

    python benchmarks/dense_rows_cost.py [--sessions 12] [--prompt 256] [--steps 12]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    from infinigen import runtime
    from infinigen.loading import load
    from infinigen.placement import Placement
    from infinigen.policies import make_policy
    from infinigen.runtime import passes
    torch.set_grad_enabled(False)
    model, _, name = load(None, dtype="auto", weights="bf16", progress=False)
    g = torch.Generator().manual_seed(0)
    sessions = [Placement().new_session(model, 1, a.prompt + 2 * a.steps + 4, make_policy("full"))
                for _ in range(a.sessions)]
    tokens = torch.cat([runtime.prefill(model, torch.randint(3, model.cfg.vocab_size, (1, a.prompt), generator=g),
                                        s).argmax(-1) for s in sessions])
    modes = {"per row (rows_as_alone dense)": passes.has_dense_linear, "one matmul (rows round apart)": lambda m: False}
    times: dict = {k: [] for k in modes}
    try:
        for step in range(a.steps):
            for k in (list(modes) if step % 2 == 0 else list(modes)[::-1]):
                passes.has_dense_linear = modes[k]
                t0 = time.perf_counter()
                tokens = runtime.decode(model, tokens, sessions, batch_invariant=True).argmax(-1)
                times[k].append(time.perf_counter() - t0)
    finally:
        passes.has_dense_linear = modes["per row (rows_as_alone dense)"]
    for k, v in times.items():
        print(json.dumps({"model": name, "weights": "bf16 (dense)", "sessions": a.sessions, "prompt": a.prompt,
                          "threads": torch.get_num_threads(), "mode": k,
                          "median_ms": round(statistics.median(v[2:]) * 1e3, 1),
                          "best_ms": round(min(v[2:]) * 1e3, 1)}))


if __name__ == "__main__":
    main()
