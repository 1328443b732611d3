"""The row cache of an offloaded KV pool: InfiniGen with the KV on disk, with and
without the row cache, against full offload, all under one memory bound below the pool.

    python benchmarks/row_cache.py                               # context 8192, batch 8 (a long run on a CPU)
    python benchmarks/row_cache.py --context 2048 --batch 4      # a smaller shape
    python benchmarks/row_cache.py --smoke                       # tiny sizes, results in a temp dir

Every system decodes from one shared real prefill (run outside the bound: it holds the whole KV once);
then this process enters a memory bound (a cgroup, `infinigen.membound`) of offload_cpu.py's size for
the disk rows plus the largest row cache, so the page cache cannot hold the pool and every system runs
under the same bound. Also InfiniGen with the pool in host memory, with and without the cache: its
bytes fetched per step are what a GPU would copy over PCIe (the rows the cache lacks; no whole-layer
reads there). Writes results/row_cache/row_cache.json and results/row_cache/row_cache.md (the machine named).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def systems(shares: list[float], pool_bytes: int, tiers: list[str]):
    """(label, policy name, tier, row-cache bytes) of each row."""
    out = [("full offload (KV on disk)", "full", "disk", 0),
           ("InfiniGen (KV on disk), no row cache", "infinigen", "disk", 0)]
    for s in shares:
        out.append((f"InfiniGen (KV on disk), row cache {s:g} of the pool", "infinigen", "disk", int(s * pool_bytes)))
    out += [("InfiniGen (KV in host RAM), no row cache", "infinigen", "cpu", 0),
            (f"InfiniGen (KV in host RAM), row cache {max(shares):g} of the pool", "infinigen", "cpu",
             int(max(shares) * pool_bytes))]
    return [r for r in out if r[2] in tiers]


def markdown(payload: dict) -> str:
    m, st = payload["machine"], payload["settings"]
    mb = st["memory_bound"]
    lines = ["# The row cache: InfiniGen with the KV on disk, fetching only the rows it lacks", "",
             f"Model: {payload['model']}, {st['dtype']}. Machine: {m['cpu']}, {m['cpu_count']} cores, "
             f"torch {m['torch']} "
             f"({m['torch_threads']} threads). Shared by other jobs while measured: the times are noisy.",
             f"Context {st['context']} (prompt {st['prompt_len']} + {st['gen_len']} generated), batch {st['batch']}; "
             f"decode timed over {st['gen_len'] - 1} steps from one shared prefill.",
             f"Command: `{payload['command']}`",
             (f"Memory bound (the disk rows; the host-RAM rows run unbounded): {mb['describe']}; "
              f"peak charged {mb.get('group_peak_bytes', 0) / 2**20:.0f} MiB; " if mb else "No memory bound; ")
             + f"pool {st['pool_bytes'] / 2**20:.0f} MiB.", "",
             "| system | ms/step | x full offload | MB read from the slow tier/step | rows fetched/step | hit rate | "
             "peak fast MB | tokens = no cache |",
             "|---|---|---|---|---|---|---|---|"]
    rows = payload["rows"]
    base = {r["kv_offload"]: r for r in rows if r["policy"] == "infinigen" and not r.get("row_cache_bytes")}
    steps = st["gen_len"] - 1
    for r in rows:
        mb_step = r["bytes_moved_per_token"] * r["batch"] / 2**20
        fetched = r.get("slow_rows_fetched_per_step")
        rate = r.get("row_cache_hit_rate")
        same = "-" if r["policy"] != "infinigen" else ("yes" if r["tokens_sha1"] == base[r["kv_offload"]]["tokens_sha1"]
                                                       else "NO")
        lines.append(f"| {r['system']} | {r['decode_ms_per_step']:.0f} | {r.get('x_vs_full_offload', 0):.2f} | "
                     f"{mb_step:.1f} | {'-' if not fetched else f'{sum(fetched) / steps:.0f}'} | "
                     f"{'-' if rate is None else f'{100 * rate:.1f}%'} | {r['peak_fast_bytes'] / 2**20:.0f} | {same} |")
    lines += ["", "Hit rate per decoding step (% of the distinct selected rows the cache held; step 1 starts "
              "empty):", ""]
    for r in rows:
        if r.get("row_cache_hit_rate_per_step"):
            per = " ".join(f"{100 * h:.0f}" for h in r["row_cache_hit_rate_per_step"] if h is not None)
            lines.append(f"- {r['system']}: {per}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--shares", default="0.125,0.25", help="row cache sizes, as shares of the KV pool's bytes")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="float32: the dtype of the disk row the issue quotes (results/offload/offload.md)")
    ap.add_argument("--tiers", default="disk,cpu", help="which rows: disk (bounded), cpu (host RAM, unbounded)")
    ap.add_argument("--text", default="prideprejudice")
    ap.add_argument("--pool-dir", default=None)
    ap.add_argument("--out", default=None,
                    help="output folder (default: results/row_cache/, or a temp dir with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (context 160, batch 2, 4 tokens)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.context, args.batch, args.gen_len = 160, 2, 4
    out = Path(args.out) if args.out else (
        Path(tempfile.mkdtemp(prefix="row-cache-")) if args.smoke else ROOT / "results" / "row_cache")
    out.mkdir(parents=True, exist_ok=True)

    from offload_cpu import auto_limit

    from infinigen import bench
    from infinigen.bench.runners import SharedPrefill, run_ours
    from infinigen.loading import load
    from infinigen.membound import MemoryBound
    from infinigen.paths import load_text
    from infinigen.placement import kv_slot_bytes
    from infinigen.policies import make_policy

    progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    model, tok, name = load("default", dtype=args.dtype, device="cpu")
    prompt = args.context - args.gen_len
    policies = {"full": make_policy("full"), "infinigen": make_policy("infinigen")}
    policies = {key: p.prepare(model, tok, progress=True) for key, p in policies.items()}
    pool = kv_slot_bytes(model, args.batch, policies["infinigen"], "disk") * args.context
    shares = [float(s) for s in args.shares.split(",")]
    rows_spec = systems(shares, pool, args.tiers.split(","))
    disk = [bench.System(label, policies[pol], tier) for label, pol, tier, _ in rows_spec if tier == "disk"]
    limit = auto_limit(model, disk, [args.batch], args.context) + max(rc for *_, rc in rows_spec) if disk else None
    settings = bench.BenchSettings(prompt_lens=[prompt], batch_sizes=[args.batch], gen_len=args.gen_len,
                                   pool_dir=args.pool_dir, share_prefill=True)
    tokens = bench.prompt_tokens(tok, load_text(args.text), args.batch, prompt, model.cfg.vocab_size, settings.seed)
    progress(f"prompt {prompt} x batch {args.batch}: shared prefill")
    shared = SharedPrefill(model, tokens, args.pool_dir)
    mb = MemoryBound(limit) if disk else None
    rows, info = [], None
    try:
        for label, pol, tier, rc in rows_spec:
            # the disk rows under the bound; the host pool is itself anonymous memory (as large as the file),
            # which a bound below the pool would make thrash: those rows run unbounded
            if tier == "disk" and mb is not None and mb.home is None:
                mb.enter()
                progress(f"bounded: {mb.describe()}")
            elif tier != "disk" and mb is not None and mb.home is not None:
                mb.leave()
            progress(f"{label} ({rc / 2**20:.0f} MiB row cache)")
            system = bench.System(label, policies[pol], tier)
            row = run_ours(model, tokens, system, dataclasses.replace(settings, row_cache_bytes=rc), shared)
            rows.append(row)
            progress(f"  {row['decode_ms_per_step']:.0f} ms/step, hit rate {row.get('row_cache_hit_rate')}")
        if mb is not None:
            info = dict(mb.info(), **{f"group_{k}_bytes": v for k, v in mb.stats().items()})
    finally:
        if mb is not None:
            mb.close()
        shared.close()
    bench.add_ratios(rows)
    payload = {"model": name, "machine": bench.machine(),
               "command": "python benchmarks/row_cache.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "settings": {"context": args.context, "prompt_len": prompt, "gen_len": args.gen_len, "batch": args.batch,
                            "dtype": args.dtype, "shares": shares, "pool_bytes": pool, "memory_bound": info,
                            "prefill_s": shared.seconds},
               "rows": bench.strip_private(rows)}
    (out / "row_cache.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out / "row_cache.md").write_text(markdown(payload))
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
