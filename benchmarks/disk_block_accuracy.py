"""Accuracy of the disk tier's block selection at equal KV read: InfiniGen choosing tokens, choosing blocks (read
and attended whole), and choosing blocks then attending the tokens the token rule keeps within them
(`block_fetch`), on a validation text, teacher-forced as `infinigen ppl` scores it.

    python benchmarks/disk_block_accuracy.py                       # northangerabbey, 2048 (256), blocks of 16
    python benchmarks/disk_block_accuracy.py --text prideprejudice --fetch 1,1.5,2 --budgets 0.1354,0.2

Every row selects one layer ahead (`query=ahead`: what an offloaded tier does, so the same selection as
`--kv-offload disk --disk-block 16`, which reads the units its selection names) with the default model's
calibrated settings given as knobs, no remainder (the offloaded default's). Per row: the share of the cached
entries attention attended (the `relative KV` of `infinigen ppl`) and the share the block file reads for it
(the valid entries of every block of `--block` slots holding an attended entry: what the block layout reads
from disk), both summed over every layer, row and KV head. Writes results/disk_blocks/block_accuracy.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALIBRATED = dict(calibrate=False, alpha=7.0, budget_growth=0.5, exact_first=True, remainder_from=1, dense_below=0,
                  query="ahead", remainder=False)


class BlockTally:
    """Counts, over every `choose` call, the entries kept and the valid entries of the blocks they lie in."""

    def __init__(self, block: int):
        self.block = block
        self.attended = self.read = self.valid = 0

    def add(self, keep, valid) -> None:
        import torch.nn.functional as F
        valid = valid.expand_as(keep)
        n = keep.shape[-1]
        pad = -n % self.block
        blocks = lambda x: F.pad(x, (0, pad)).view(*x.shape[:-1], -1, self.block)  # noqa: E731
        touched = blocks(keep).any(-1, keepdim=True)
        self.attended += int(keep.sum())
        self.read += int((touched & blocks(valid)).sum())
        self.valid += int(valid.sum())


def run(model, tok, tokens, knobs: dict, block: int, prefill: int) -> dict:
    from infinigen.eval.ppl import perplexity
    from infinigen.policies import infinigen_select as select
    from infinigen.policies import make_policy
    tally = BlockTally(block)
    original = select.choose

    def counted(s, valid, *args, **kwargs):
        keep = original(s, valid, *args, **kwargs)
        tally.add(keep, valid)
        return keep

    select.choose = counted
    try:
        res = perplexity(model, tok, None, make_policy("infinigen", **CALIBRATED, **knobs), prefill=prefill,
                         tokens=tokens)
    finally:
        select.choose = original
    return {"knobs": knobs, "perplexity": res.perplexity, "relative_kv": res.kv_all,
            "attended": tally.attended / tally.valid, "block_read": tally.read / tally.valid,
            "seconds": res.seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", default="northangerabbey")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--budgets", default="0.1354,0.2,0.27", help="kv_budget values of the block rows")
    ap.add_argument("--fetch", default="1,1.5,2,3", help="block_fetch values (at the token rows' kv_budget)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "disk_blocks" / "block_accuracy")
    a = ap.parse_args()
    import torch

    from infinigen.eval.ppl import perplexity, token_windows
    from infinigen.commands.basic import load_model
    from infinigen.paths import load_text, resolve_text
    load = [Path("/proc/loadavg").read_text().split()[:3]]
    net, tok, name = load_model("default")
    tokens = token_windows(tok, load_text(resolve_text(a.text)), a.ctx, 1)
    full = perplexity(net, tok, None, None, prefill=a.prefill, tokens=tokens).perplexity
    budget = 0.1354
    rows = [("tokens", run(net, tok, tokens, {"kv_budget": budget}, a.block, a.prefill))]
    for b in map(float, a.budgets.split(",")):
        rows.append((f"blocks of {a.block}", run(net, tok, tokens, {"kv_budget": b, "block": a.block}, a.block,
                                                 a.prefill)))
    for f in map(float, a.fetch.split(",")):
        rows.append((f"blocks of {a.block}, tokens within", run(
            net, tok, tokens, {"kv_budget": budget, "block": a.block, "block_fetch": f}, a.block, a.prefill)))
    load.append(Path("/proc/loadavg").read_text().split()[:3])
    payload = {"model": name, "text": a.text, "ctx": a.ctx, "prefill": a.prefill, "block": a.block, "full": full,
               "rows": [{"selection": s, **r} for s, r in rows], "loadavg": load, "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "platform": platform.platform()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    a.out.with_suffix(".md").write_text(markdown(payload))
    print(markdown(payload))


def markdown(p: dict) -> str:
    lines = [f"Model {p['model']}, {p['text']}, context {p['ctx']} (prefill {p['prefill']}); full cache "
             f"{p['full']:.3f}. {p['date']}, torch {p['torch']}, loadavg before {' '.join(p['loadavg'][0])}, after "
             f"{' '.join(p['loadavg'][1])}.", "",
             "| selection | kv_budget | block_fetch | relative KV (ppl's) | attended | read in blocks of "
             + str(p["block"]) + " | perplexity | vs full |", "|---|---|---|---|---|---|---|---|"]
    for r in p["rows"]:
        k = r["knobs"]
        lines.append(f"| {r['selection']} | {k['kv_budget']} | {k.get('block_fetch', '-')} | "
                     f"{100 * r['relative_kv']:.2f}% | {100 * r['attended']:.2f}% | {100 * r['block_read']:.2f}% | "
                     f"{r['perplexity']:.3f} | "
                     f"{100 * (r['perplexity'] / p['full'] - 1):+.2f}% |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
