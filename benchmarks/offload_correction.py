"""Speculation with correction on an offloaded tier (`Placement.correct`): accuracy and cost against the in-RAM
form and the speculation-only form, the default model, one process.

    OMP_NUM_THREADS=1 python benchmarks/offload_correction.py --text northangerabbey --ctx 2048 --prefill 256 \\
        --decode-prompt 2016 --steps 32 --rounds 2 --json results/recall/correction.json
    OMP_NUM_THREADS=1 python benchmarks/offload_correction.py --kv-offload disk --disk-block 16 --knob block=16 ...

`--kv-offload disk --disk-block N`: the offloaded forms on the disk tier in blocks of N tokens (`BlockedKVStore`:
the prefetch reads the units of the speculated selection, the correction the units it missed); `--knob`: knobs of
every InfiniGen form (e.g. `block=16` to select blocks, `block_fetch=2` for tokens within them).

Every InfiniGen form selects at every length (`dense_below=0`: the crossing measured on a machine would make the
in-RAM form read short contexts densely).

1. Perplexity (`infinigen ppl`'s scoring, teacher-forced) of the full cache, InfiniGen in RAM, InfiniGen offloaded
   (cpu) without and with the correction: the perplexity's change against the full cache and the share of the KV
   read.
2. Decoding (greedy, batch 1) after a `--decode-prompt`-token prompt of the same text, the InfiniGen forms
   taking turns for `--rounds` rounds: ms per step, and on the offloaded forms the rows prefetched and the rows
   fetched on demand (those the layers' own selections read that the prefetch missed) as shares of the used KV
   per step (the rows the prefetch missed that the layer's recent steps missed too come from fast memory, where
   the store held them: `held`; the rows held after each step: `holding`; the variant "nothing held" fetches
   every missed row from the slow tier, "held one step" holds only the last step's misses and prefetches no wider
   speculation for a layer holding nothing), the rows read from the slow tier (prefetched and fetched on demand),
   and the time fetching them; on blocks, the units read per step and those read on demand. The tokens of the
   corrected forms against the in-RAM form's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


TIER = {"kv_offload": "cpu", "disk_block": 0, "pool_dir": None}  # the offloaded forms' tier (`--kv-offload`)
KNOBS: dict = {}  # every InfiniGen form's knobs (`--knob`)


def forms():
    from infinigen.placement import Placement
    return {"in RAM": Placement("none"), "offloaded, speculation only": Placement(**TIER, correct=False),
            "offloaded, corrected": Placement(**TIER, correct=True)}


NOT_HELD = "offloaded, corrected, nothing held"  # decoding only: every missed row from the slow tier
ONE_STEP = "offloaded, corrected, held one step"  # decoding only: the last step's misses held, no prefetch margin
# decoding only: store attributes of the corrected variants (the default: `OffloadedKVStore`'s class values)
VARIANTS = {NOT_HELD: {"holds_missed": False}, ONE_STEP: {"hold_steps": 1, "first_margin": 1.0}}


def decode_forms():
    """The forms decoded: `forms()` and the corrected variants (`VARIANTS`) on the same tier."""
    return forms() | {name: forms()["offloaded, corrected"] for name in VARIANTS}


def infinigen():
    from infinigen.policies import make_policy
    return make_policy("infinigen", **({"dense_below": 0} | KNOBS))


def perplexities(model, tok, ids, prefill: int) -> dict:
    from infinigen.eval.ppl import perplexity
    from infinigen.policies import make_policy
    out = {"full": perplexity(model, tok, None, make_policy("full"), prefill=prefill, tokens=ids)}
    for name, placement in forms().items():
        out[name] = perplexity(model, tok, None, infinigen(), prefill=prefill, tokens=ids, placement=placement)
    full = out["full"].perplexity
    return {k: {"perplexity": r.perplexity, "vs_full": r.perplexity / full - 1, "kv_read": r.kv_all}
            for k, r in out.items()}


def decode_once(model, tok, prompt, steps: int, placement, attrs: dict | None = None) -> dict:
    from infinigen import runtime
    pol = infinigen().prepare(model, tok)
    sess = placement.new_session(model, 1, prompt.shape[1] + steps + 1, pol)
    for k, v in (attrs or {}).items():
        if hasattr(sess.store, k):
            setattr(sess.store, k, v)
    held = []  # per step: missed rows taken from fast memory (held since the layer's recent steps)
    holding = []  # per step: rows held in fast memory after it, over every layer (a held unit: its slots)
    try:
        logits = runtime.prefill(model, prompt, sess)
        stats = getattr(sess.store, "stats", None)
        if stats is not None:
            stats.reset()
            stats.steps.clear()
        out = []
        t0 = time.perf_counter()
        for _ in range(steps):
            t = logits.argmax(-1)
            out.append(int(t))
            before = getattr(stats, "held", 0)
            logits = runtime.decode(model, t, sess)
            held.append(getattr(stats, "held", 0) - before)
            rows_each = getattr(sess.store, "block", 0) or 1  # the block pool holds units of `block` slots
            holding.append(rows_each * sum(h[0].numel() for h in getattr(sess.store, "_held", {}).values()))
        seconds = time.perf_counter() - t0
        store = sess.store
        block = getattr(store, "block", 0)
        used_units = sum(store.bh * -(-n // block) for n in store.length) if block else 0
    finally:
        sess.store.close()
    row = {"ms_per_step": 1e3 * seconds / steps, "tokens": out}
    if block:  # units read per step from the file: all of them, those read on demand; the used layers' units
        row.update(units_per_step=stats.blocks / steps, ondemand_units_per_step=stats.missed_blocks / steps,
                   used_units=used_units, mb_read_per_step=stats.bytes_moved / steps / 1e6)
    if stats is not None:
        shares = stats.missed_shares()
        wanted = [(m + h) / kv for (_, m, kv, _), h in zip(stats.steps, held)]  # missed, fetched or held
        row.update(prefetched_share=statistics.mean(p / kv for p, _, kv, _ in stats.steps),
                   missed_share_mean=statistics.mean(shares), missed_share_max=max(shares),
                   held_share_mean=statistics.mean(h / kv for (_, _, kv, _), h in zip(stats.steps, held)),
                   not_prefetched_share_mean=statistics.mean(wanted), not_prefetched_share_max=max(wanted),
                   read_share_mean=statistics.mean((p + m) / kv for p, m, kv, _ in stats.steps),
                   read_share_max=max((p + m) / kv for p, m, kv, _ in stats.steps),
                   holding_share_mean=statistics.mean(n / kv for (_, _, kv, _), n in zip(stats.steps, holding)),
                   holding_share_max=max(n / kv for (_, _, kv, _), n in zip(stats.steps, holding)),
                   ondemand_ms_per_step=1e3 * stats.ondemand_s / steps)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--text", default="northangerabbey")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--decode-prompt", type=int, default=2016)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--kv-offload", default="cpu", choices=["cpu", "disk"])
    ap.add_argument("--disk-block", type=int, default=0)
    ap.add_argument("--pool-dir", default=None)
    ap.add_argument("--knob", action="append", default=[], help="NAME=VALUE for every InfiniGen form")
    ap.add_argument("--forms", default=None,
                    help="decode only these forms (names separated by ';', e.g. 'corrected;corrected, held one step'; "
                         "the in-RAM form always: the tokens are compared with it)")
    a = ap.parse_args(argv)
    chosen = list(decode_forms())
    if a.forms is not None:
        asked = {f.strip() for f in a.forms.split(";") if f.strip()}
        unknown = asked - {n.removeprefix("offloaded, ") for n in chosen}
        if unknown:
            ap.error(f"--forms: unknown {'; '.join(sorted(unknown))}; choose among "
                     + "; ".join(n.removeprefix("offloaded, ") for n in chosen))
        chosen = [n for n in chosen if n == "in RAM" or n.removeprefix("offloaded, ") in asked]
    from infinigen.policies.knobs import knob_dict
    TIER.update(kv_offload=a.kv_offload, disk_block=a.disk_block, pool_dir=a.pool_dir)
    KNOBS.update(knob_dict("infinigen", a.knob))
    from infinigen.commands.basic import load_model
    from infinigen.eval.ppl import token_windows
    from infinigen.paths import load_text
    model, tok, _ = load_model(a.model, "float32", "cpu")
    ids = token_windows(tok, load_text(a.text), a.ctx)
    result = {"args": vars(a), "loadavg_before": open("/proc/loadavg").read().split()[:3]}
    with torch.no_grad():
        if not a.skip_ppl:
            result["ppl"] = perplexities(model, tok, ids, a.prefill)
            print(json.dumps(result["ppl"], indent=1), flush=True)
        prompt = ids[:, :a.decode_prompt]
        runs: dict = {name: [] for name in chosen}
        for _ in range(a.rounds):
            for name, placement in decode_forms().items():
                if name not in runs:
                    continue
                runs[name].append(decode_once(model, tok, prompt, a.steps, placement, VARIANTS.get(name)))
                print(name, {k: v for k, v in runs[name][-1].items() if k != "tokens"}, flush=True)
    decode = {}
    for name, rows in runs.items():
        decode[name] = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "tokens"}
        decode[name]["same_tokens_as_in_RAM"] = rows[0]["tokens"] == runs["in RAM"][0]["tokens"]
    result["decode"] = decode
    result["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
    print(json.dumps(decode, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
