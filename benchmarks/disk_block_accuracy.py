"""Accuracy of the disk tier's block selection at equal KV read: InfiniGen choosing tokens, choosing blocks (read
and attended whole), and choosing blocks then attending the tokens the token rule keeps within them
(`block_fetch`), on a validation text, teacher-forced as `infinigen ppl` scores it.

    python benchmarks/disk_block_accuracy.py                       # northangerabbey, 2048 (256), blocks of 16
    python benchmarks/disk_block_accuracy.py --text prideprejudice --fetch 1,1.5,2 --budgets 0.1354,0.2
    python benchmarks/disk_block_accuracy.py --model gemma-3-270m-q4_k_m.gguf --dtype float32 \
        --knob alpha=9 --knob exact_first=false --knob remainder_from=0 --knob query=auto --knob remainder=true \
        --token-budget 0.1355 --budgets 0.1355,0.27,0.4 --fetch "" --out results/disk_blocks/block_accuracy_gemma

By default every row selects one layer ahead (`query=ahead`: what an offloaded tier does, so the same selection
as `--kv-offload disk --disk-block 16 --no-correct`, which reads the units its selection names) with the default
model's calibrated settings given as knobs, no remainder (the offloaded default's); `--knob` overrides them
(`query=auto`: each layer selects with its own query, what the corrected block pool reads). Per row: the share
of the cached entries attention attended (the `relative KV` of `infinigen ppl`) and the share the block file
reads for it (the valid entries of every block of `--block` slots holding an attended entry: what the block
layout reads from disk), both summed over every selecting layer, row and KV head. A model mixing local and
global layers (Gemma 3) selects on its global layers only; its local layers read their window's blocks, which
the "all layers" share adds (each layer's share of its cached entries, averaged over the layers).
Writes `--out`.{md,json} (default results/disk_blocks/block_accuracy_run; block_accuracy.md gathers the studies
and is written by hand, so the runner leaves it alone).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALIBRATED = dict(calibrate=False, alpha=7.0, budget_growth=0.5, exact_first=True, remainder_from=1, dense_below=0,
                  query="ahead", remainder=False)


class BlockTally:
    """Counts, over every `choose` call, the entries kept and the valid entries of the blocks they lie in; and, for
    each window in `windows` (a local layer's), what a layer with that window reads in blocks for the same rows."""

    def __init__(self, block: int, windows: tuple[int, ...] = ()):
        self.block = block
        self.windows = windows
        self.attended = self.read = self.valid = 0
        self.window_read = [0] * len(windows)

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
        lengths = valid.sum(-1)  # a row's cached entries: positions 0 .. length - 1
        for i, w in enumerate(self.windows):  # its window: the entries fewer than w positions before the row
            first = (lengths - w + 1).clamp(min=0)
            self.window_read[i] += int((lengths - first // self.block * self.block).sum())

    def all_layers(self, selecting: int) -> float:
        """The block read share averaged over `selecting` selecting layers and the local layers' windows."""
        return (selecting * self.read + sum(self.window_read)) / ((selecting + len(self.windows)) * self.valid)


def run(model, tok, tokens, base: dict, knobs: dict, block: int, prefill: int) -> dict:
    from infinigen.eval.ppl import perplexity
    from infinigen.policies import infinigen_select as select
    from infinigen.policies import make_policy
    cfg = model.cfg
    local = [i for i in range(cfg.num_layers) if cfg.local(i)]
    tally = BlockTally(block, tuple(cfg.window(i) for i in local))
    original = select.choose

    def counted(s, valid, *args, **kwargs):
        keep = original(s, valid, *args, **kwargs)
        tally.add(keep, valid)
        return keep

    select.choose = counted
    try:
        res = perplexity(model, tok, None, make_policy("infinigen", **{**base, **knobs}), prefill=prefill,
                         tokens=tokens)
    finally:
        select.choose = original
    return {"knobs": knobs, "perplexity": res.perplexity, "relative_kv": res.kv_global if local else res.kv_all,
            "attended": tally.attended / tally.valid, "block_read": tally.read / tally.valid,
            "block_read_all_layers": tally.all_layers(cfg.num_layers - len(local)), "local_layers": len(local),
            "seconds": res.seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--knob", action="append", default=[], help="NAME=VALUE over the default model's settings")
    ap.add_argument("--token-budget", type=float, default=0.1354, help="kv_budget of the token row (and fetch rows)")
    ap.add_argument("--text", default="northangerabbey")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--budgets", default="0.1354,0.2,0.27", help="kv_budget values of the block rows")
    ap.add_argument("--fetch", default="1,1.5,2,3", help="block_fetch values (at the token row's kv_budget; '' none)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "disk_blocks" / "block_accuracy_run")
    a = ap.parse_args()
    import torch

    from infinigen.eval.ppl import perplexity, token_windows
    from infinigen.commands.basic import load_model
    from infinigen.paths import load_text, resolve_text
    from infinigen.policies.knobs import knob_dict
    from infinigen.errors import UserError
    try:  # a bad knob fails here, before the model loads
        base = knob_dict("infinigen", a.knob, CALIBRATED)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    load = [Path("/proc/loadavg").read_text().split()[:3]]
    net, tok, name = load_model(a.model, a.dtype)
    tokens = token_windows(tok, load_text(resolve_text(a.text)), a.ctx, 1)
    full = perplexity(net, tok, None, None, prefill=a.prefill, tokens=tokens).perplexity
    budget = a.token_budget
    rows = [("tokens", run(net, tok, tokens, base, {"kv_budget": budget}, a.block, a.prefill))]
    for b in values(a.budgets):
        rows.append((f"blocks of {a.block}", run(net, tok, tokens, base, {"kv_budget": b, "block": a.block}, a.block,
                                                 a.prefill)))
    for f in values(a.fetch):
        rows.append((f"blocks of {a.block}, tokens within", run(
            net, tok, tokens, base, {"kv_budget": budget, "block": a.block, "block_fetch": f}, a.block, a.prefill)))
    load.append(Path("/proc/loadavg").read_text().split()[:3])
    payload = {"model": name, "dtype": a.dtype, "settings": base, "text": a.text, "ctx": a.ctx, "prefill": a.prefill,
               "block": a.block, "full": full,
               "rows": [{"selection": s, **r} for s, r in rows], "loadavg": load, "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "platform": platform.platform()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    a.out.with_suffix(".md").write_text(markdown(payload))
    print(markdown(payload))


def values(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def markdown(p: dict) -> str:
    local = any(r.get("local_layers") for r in p["rows"])
    lines = [f"Model {p['model']}, {p['text']}, context {p['ctx']} (prefill {p['prefill']}); full cache "
             f"{p['full']:.3f}. {p['date']}, torch {p['torch']}, loadavg before {' '.join(p['loadavg'][0])}, after "
             f"{' '.join(p['loadavg'][1])}.", "",
             "| selection | kv_budget | block_fetch | relative KV (ppl's) | attended | read in blocks of "
             + str(p["block"]) + (" | read, all layers" if local else "") + " | perplexity | vs full |",
             "|---|---|---|---|---|---|" + ("---|" if local else "") + "---|---|"]
    for r in p["rows"]:
        k = r["knobs"]
        every = f"{100 * r['block_read_all_layers']:.2f}% | " if local else ""
        lines.append(f"| {r['selection']} | {k['kv_budget']} | {k.get('block_fetch', '-')} | "
                     f"{100 * r['relative_kv']:.2f}% | {100 * r['attended']:.2f}% | {100 * r['block_read']:.2f}% | "
                     f"{every}{r['perplexity']:.3f} | "
                     f"{100 * (r['perplexity'] / p['full'] - 1):+.2f}% |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
