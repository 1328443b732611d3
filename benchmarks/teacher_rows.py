"""Teacher-forced rows (perplexity, calibration) read as a decoding step reads: each row's kept entries packed and
attended by the step's fused kernel (`runtime.attention.attend_rows`), against the padded reference that served
before (`tests/support/padded_reference.attend_teacher_rows`: every row scored against every key), side by side in
one process.

    PYTHONPATH=src python benchmarks/teacher_rows.py [--text northangerabbey] [--ctx 2048] [--prefill 256]
        [--rounds 2] [--policy infinigen] [--layer-only] [--all-past] [--out results/teacher_rows/teacher_rows.json]

Two parts. (1) One layer's rows alone: random q, k, v of the default model's shape (3 KV heads, 9 query heads,
head_dim 64), the rows after a 256-token prompt of a 2048-token window, each keeping 20% of its past at random,
with a remainder: the padded reference, the packed rows through the C++ kernel and through its torch twin
(`attend_packed_rows`), float32, the best of 3; and the same rows keeping all their past (a layer that does not
select: one causal SDPA call now). With `--all-past`, only rows keeping all their past, in bfloat16, at three shapes
(SmolLM2's at 2048 and 8192, Gemma 3's head_dim 256 with one KV head at 8192): the padded reference, the packed
kernel (the causal call bypassed) and the causal call, the best of 2. (2) `infinigen ppl` of the default model
(its defaults: bfloat16, the GGUF's int4 weights) under `--policy` (the default InfiniGen preset, or the full
cache) on one window of `--text`, the variants alternating per round (A B, B A): wall and CPU seconds of the pass,
the perplexity and the KV share read.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402

import infinigen  # noqa: E402
from infinigen.codecs import KVCodec  # noqa: E402
from infinigen.eval.ppl import perplexity  # noqa: E402
from infinigen.kernels import fused_select  # noqa: E402
from infinigen.policies import make_policy  # noqa: E402
from infinigen.runtime import attention  # noqa: E402
from infinigen.selection import Remainder  # noqa: E402
from support.padded_reference import attend_teacher_rows  # noqa: E402


def _best(f, n: int = 3) -> float:
    f()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def one_layer(ctx: int, prefill: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    hkv, g, d = 3, 3, 64
    r = ctx - prefill
    q = torch.randn(1, hkv * g, r, d, generator=gen)
    k, v = torch.randn(1, hkv, ctx, d, generator=gen), torch.randn(1, hkv, ctx, d, generator=gen)
    past = torch.arange(ctx)[None] < torch.arange(prefill, ctx)[:, None]
    keep = (torch.rand(1, hkv, r, ctx, generator=gen) < 0.2) & past
    rem = Remainder(torch.randn(1, hkv, g, r, generator=gen))
    args = (q, k, v, keep, prefill, KVCodec(), d ** -0.5, rem)
    out = {"padded reference s": _best(lambda: attend_teacher_rows(*args))}
    if fused_select.available():
        out["packed, C++ kernel s"] = _best(lambda: attention.attend_rows(*args))
    fused_select.enabled = False
    try:
        out["packed, torch twin s"] = _best(lambda: attention.attend_rows(*args), 1)
    finally:
        fused_select.enabled = True
    every = (past[None, None].expand(1, hkv, r, ctx).clone(), prefill, KVCodec(), d ** -0.5, rem)
    out["all past: padded reference s"] = _best(lambda: attend_teacher_rows(q, k, v, *every))
    out["all past: now (one causal call) s"] = _best(lambda: attention.attend_rows(q, k, v, *every))
    return out


def all_past() -> list[dict]:
    out = []
    for hkv, g, d, t, first in [(3, 3, 64, 2048, 256), (3, 3, 64, 8192, 1024), (1, 4, 256, 8192, 1024)]:
        gen = torch.Generator().manual_seed(0)
        r = t - first
        q = torch.randn(1, hkv * g, r, d, generator=gen).bfloat16()
        k, v = (torch.randn(1, hkv, t, d, generator=gen).bfloat16() for _ in range(2))
        past = torch.arange(t)[None] < torch.arange(first, t)[:, None]
        args = (q, k, v, past[None, None], first, KVCodec(), d ** -0.5)
        row = {"kv heads": hkv, "query heads": hkv * g, "head_dim": d, "tokens": t,
               "padded reference s": _best(lambda: attend_teacher_rows(*args), 2)}
        keeps_all = attention._keeps_all_past
        attention._keeps_all_past = lambda *a: False  # the packed kernel over every past entry
        try:
            row["packed kernel s"] = _best(lambda: attention.attend_rows(*args), 2)
        finally:
            attention._keeps_all_past = keeps_all
        row["one causal call s"] = _best(lambda: attention.attend_rows(*args), 2)
        print(row, flush=True)
        out.append(row)
    return out


def ppl_rounds(text: str, ctx: int, prefill: int, rounds: int, policy_name: str) -> list[dict]:
    model, tok, _ = infinigen.load()
    policy = make_policy(policy_name).prepare(model, tok)
    packed = attention.attend_rows
    runs = []
    for rnd in range(rounds):
        order = ["packed", "padded"] if rnd % 2 == 0 else ["padded", "packed"]
        for name in order:
            attention.attend_rows = packed if name == "packed" else attend_teacher_rows
            try:
                wall, cpu = time.perf_counter(), time.process_time()
                res = perplexity(model, tok, text, policy, ctx=ctx, prefill=prefill)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            finally:
                attention.attend_rows = packed
            got = res.to_dict()
            runs.append({"policy": policy.name, "round": rnd, "variant": name, "wall s": wall, "cpu s": cpu,
                         "ppl": got["perplexity"], "kv share": got["kv_all"]})
            print(runs[-1], flush=True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="northangerabbey")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--policy", default="infinigen", choices=["infinigen", "full"])
    ap.add_argument("--layer-only", action="store_true")
    ap.add_argument("--all-past", action="store_true", help="only rows keeping all their past, at three shapes")
    ap.add_argument("--out", default=str(REPO / "results/teacher_rows/teacher_rows.json"))
    a = ap.parse_args()
    if a.all_past:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        record = {"threads": torch.get_num_threads(), "all past": all_past()}
        Path(a.out).write_text(json.dumps(record, indent=1) + "\n")
        return
    record = {"threads": torch.get_num_threads(), "layer": one_layer(a.ctx, a.prefill)}
    print(record["layer"], flush=True)
    if not a.layer_only:
        record["ppl"] = ppl_rounds(a.text, a.ctx, a.prefill, a.rounds, a.policy)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
