"""What the correction changes: per selecting layer, decoding step and batch row, whether the selection a layer's own
query makes differs from the one speculated a layer ahead (what an offloaded tier prefetches), the rows it adds, and
the attention mass each selection holds under the layer's own query (its exact softmax over every cached key; the
token's own key, read by both, aside). The tier does not change the selections: this runs on the cpu tier.

    OMP_NUM_THREADS=1 python benchmarks/correction_changes.py --text northangerabbey --prompt 2016 --steps 16 \\
        [--batch 2] [--block 32] [--json out.json]

`--block N`: InfiniGen choosing blocks of N tokens (the default model's calibrated settings), as the disk tier in
blocks runs it; 0: tokens. Every form selects at every length (`dense_below=0`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def policy(model, tok, block: int):
    from infinigen.policies import make_policy
    from disk_blocks import block_policy
    ig = make_policy("infinigen", dense_below=0).prepare(model, tok)
    return block_policy(ig, block).prepare(model, tok) if block else ig


def measure(model, tok, prompt: torch.Tensor, steps: int, pol) -> list[dict]:
    """One record per (step, selecting layer, batch row) of the decoding steps after `prompt` [B, T]."""
    from infinigen import runtime
    from infinigen.placement import Placement
    from infinigen.selection import ALL
    planned: dict = {}
    records: list[dict] = []

    class Changes(runtime.Listener):
        def on_select(self, layer, rows, keep, s):
            plan = planned.pop(layer, None)
            if plan is None or plan is ALL or keep is ALL or rows.query is None:
                return
            n = s.store.length[layer]
            k = s.store.k[layer][:, :, :n].float()  # [B, Hkv, n, d]
            b, hkv, _, d = k.shape
            q = rows.query[:, :, 0].float().view(b, hkv, -1, d)  # [B, Hkv, G, d]
            valid = s.store.valid[layer][:, :, :n]
            scores = torch.einsum("bhgd,bhsd->bhgs", q, k) * model.scale
            p = scores.masked_fill(~valid[:, :, None], float("-inf")).softmax(-1)
            own, spec = keep[:, :, 0, :n] & valid, plan[:, :, :n] & valid
            for i in range(b):
                added = (own[i] & ~spec[i]).sum().item()
                dropped = (spec[i] & ~own[i]).sum().item()
                records.append({"layer": layer, "changed": bool(added or dropped), "own_rows": own[i].sum().item(),
                                "added": added, "dropped": dropped,
                                "own_mass": (p[i] * own[i][:, None]).sum(-1).mean().item(),
                                "spec_mass": (p[i] * spec[i][:, None]).sum(-1).mean().item()})

    sess = Placement("cpu", correct=True).new_session(model, prompt.shape[0], prompt.shape[1] + steps + 1, pol,
                                                      listeners=[Changes()])
    store = sess.store
    issue = store._issue

    def remember(layer, plan):  # what placement prefetches for `layer`: the speculated selection
        planned[layer] = plan
        issue(layer, plan)

    store._issue = remember
    try:
        logits = runtime.prefill(model, prompt, sess)
        records.clear()
        for _ in range(steps):
            logits = runtime.decode(model, logits.argmax(-1), sess)
    finally:
        store.close()
    return records


def summary(records: list[dict]) -> dict:
    mean = lambda key: statistics.mean(r[key] for r in records)  # noqa: E731
    return {"selections": len(records), "changed_share": mean("changed"),
            "added_share_of_own_rows": sum(r["added"] for r in records) / max(1, sum(r["own_rows"] for r in records)),
            "own_mass": mean("own_mass"), "spec_mass": mean("spec_mass"),
            "mass_gain": statistics.mean(r["own_mass"] - r["spec_mass"] for r in records),
            "mass_gain_p90": sorted(r["own_mass"] - r["spec_mass"] for r in records)[int(0.9 * len(records))]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="northangerabbey")
    ap.add_argument("--prompt", type=int, default=2016)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--block", default="0", help="block sizes to measure (0: token selection), comma-separated")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from infinigen.eval.ppl import token_windows
    from infinigen.loading import load
    from infinigen.paths import load_text
    model, tok, name = load("default", dtype=a.dtype, device="cpu")
    ids = token_windows(tok, load_text(a.text), a.prompt, windows=a.batch)
    out = {"model": name, "args": vars(a), "loadavg_before": open("/proc/loadavg").read().split()[:3], "rows": {}}
    with torch.no_grad():
        for block in (int(b) for b in a.block.split(",")):
            label = f"blocks of {block}" if block else "tokens"
            out["rows"][label] = summary(measure(model, tok, ids, a.steps, policy(model, tok, block)))
            print(label, json.dumps(out["rows"][label]), flush=True)
    out["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
