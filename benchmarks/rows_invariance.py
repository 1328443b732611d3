"""Which rows of a batched linear layer differ from the same row computed alone: the weights' kernels of the
decoding step (int4/int8 GGUF weights, the head) at batch sizes N, each row of a random bfloat16 input of N rows
against that row as a batch of one. A row that differs breaks `serve --batch-invariant` (a request's greedy
tokens the same whatever runs beside it) once N requests decode together.

    python benchmarks/rows_invariance.py --batches 2,4,8,9,12,16 --json results/batch_invariant/rows_invariance.json
    python benchmarks/rows_invariance.py --as-alone ...     # inside `qlinear.rows_as_alone` (the invariant step's)
    python benchmarks/rows_invariance.py --weights bf16 ... # dense weights (a checkpoint's, or `--weights bf16`)
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--batches", default="2,4,8,9,12,16")
    ap.add_argument("--as-alone", action="store_true",
                    help="call the layers inside qlinear.rows_as_alone() (dense ones too, as the invariant step does)")
    ap.add_argument("--weights", default="auto", help="as `--weights` of the commands: auto (the GGUF's int4/int8), "
                    "bf16 or fp32 (dense weights, torch's matmul)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import contextlib

    from infinigen.commands.basic import load_model
    from infinigen.kernels.qlinear import has_dense_linear, rows_as_alone
    net, _, name = load_model(a.model, "auto", "cpu", a.weights)
    modules = dict(net.named_modules())
    torch.manual_seed(0)
    report = {"model": name, "torch": torch.__version__, "threads": torch.get_num_threads(), "as_alone": a.as_alone,
              "weights": a.weights, "rows_differing": {}}
    dense = has_dense_linear(net)
    # the first block's projections (their names differ between the fused GGUF and a dense checkpoint), then the head
    projections = [n for n, m in modules.items() if n.startswith("layers.0.") and hasattr(m, "in_features")]
    for layer in (*projections, "head"):
        f = net.head if layer == "head" else modules[layer]
        k = net.cfg.hidden_size if layer == "head" else modules[layer].in_features
        kind = type(net.lm_head if layer == "head" else modules[layer]).__name__
        for n in (int(x) for x in a.batches.split(",")):
            x = torch.randn(n, 1, k).to(torch.bfloat16)
            alone = rows_as_alone(dense) if a.as_alone else contextlib.nullcontext()
            with torch.inference_mode(), alone:
                batched = f(x)
                rows = [i for i in range(n) if not torch.equal(f(x[i:i + 1]), batched[i:i + 1])]
            report["rows_differing"][f"{layer} ({kind}), batch {n}"] = rows
            print(f"{layer:28s} {kind:12s} batch {n:3d}: {len(rows)} of {n} rows differ from alone {rows}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
