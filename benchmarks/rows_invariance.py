"""Which rows of a batched linear layer differ from the same row computed alone: the weights' kernels of the
decoding step (int4/int8 GGUF weights, the head) at batch sizes N, each row of a random bfloat16 input of N rows
against that row as a batch of one. A row that differs breaks `serve --batch-invariant` (a request's greedy
tokens the same whatever runs beside it) once N requests decode together.

    python benchmarks/rows_invariance.py --batches 2,4,8,9,12,16 --json results/batch_invariant/rows_invariance.json
    python benchmarks/rows_invariance.py --as-alone ...     # inside `qlinear.rows_as_alone` (the invariant step's)
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

LAYERS = ("layers.0.attn.q_proj", "layers.0.attn.o_proj", "layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--batches", default="2,4,8,9,12,16")
    ap.add_argument("--as-alone", action="store_true", help="call the layers inside qlinear.rows_as_alone()")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import contextlib

    from infinigen.commands.basic import load_model
    from infinigen.kernels.qlinear import rows_as_alone
    net, _, name = load_model(a.model, "auto", "cpu", "auto")
    modules = dict(net.named_modules())
    torch.manual_seed(0)
    report = {"model": name, "torch": torch.__version__, "threads": torch.get_num_threads(), "as_alone": a.as_alone,
              "rows_differing": {}}
    for layer in (*LAYERS, "head"):
        f = net.head if layer == "head" else modules[layer]
        k = net.cfg.hidden_size if layer == "head" else modules[layer].in_features
        kind = type(net.lm_head if layer == "head" else modules[layer]).__name__
        for n in (int(x) for x in a.batches.split(",")):
            x = torch.randn(n, 1, k).to(torch.bfloat16)
            with torch.inference_mode(), rows_as_alone() if a.as_alone else contextlib.nullcontext():
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
