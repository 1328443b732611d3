"""CPU offloading benchmark: the default model at context 8192, batch 4 and 8, the KV
cache in RAM and on disk; InfiniGen and the baselines against transformers' DynamicCache in the same run.

    python benchmarks/offload_cpu.py                      # the real run (tens of minutes; a quiet machine), bfloat16
    python benchmarks/offload_cpu.py --dtype float32      # the table in the README
    python benchmarks/offload_cpu.py --smoke              # tiny sizes, results in a temp dir

Writes results/offload/offload.md (table, machine named, targets checked), results/offload/offload_cpu.json and
results/offload/offload_cpu.png. Targets: InfiniGen decode throughput >= 3x DynamicCache at 8192 x 8 with the
KV in RAM; with the KV on disk still faster than DynamicCache in RAM.

Every system of a (context, batch) cell decodes from one shared real prefill (`--share-prefill` of
`infinigen bench`): the prompt's per-layer queries, keys and values are replayed into each system's
store and policy, so the slow CPU prefill of 65k tokens runs once per cell for our runtime and once for
transformers. Decoding is timed over `--gen-len - 1` steps from a filled cache.

"KV in RAM" has two forms for our runtime: the pool in the fast tier itself (`none`: attention gathers
the selected rows in place) and a separate host-memory pool fetched one layer ahead by a worker thread
(`cpu`). "On disk": the pool in a memory-mapped file (`disk`); reads come through the page cache. The
disk rows run in a child process under a memory bound below the pool size (`--memory-limit`, a cgroup
where the machine allows it: `infinigen.membound`), so the page cache cannot hold the pool and reads
reach the device; the table states the mechanism and the limit.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def systems(with_paper: bool, with_baselines: bool):
    from infinigen.bench import System
    from infinigen.policies import make_policy
    out = [System("ideal (full cache in RAM)", make_policy("full"), "none"),
           System("InfiniGen (KV in RAM)", make_policy("infinigen"), "none"),
           System("InfiniGen (KV pool in host RAM, fetched ahead)", make_policy("infinigen"), "cpu"),
           System("InfiniGen (KV on disk)", make_policy("infinigen"), "disk")]
    if with_paper:
        out += [System("InfiniGen paper settings (KV in RAM)", make_policy("infinigen", preset="paper"), "none"),
                System("InfiniGen paper settings (KV on disk)", make_policy("infinigen", preset="paper"), "disk")]
    if with_baselines:
        out += [System("full offload (KV on disk)", make_policy("full"), "disk"),
                System("H2O 20% (KV in RAM)", make_policy("h2o"), "none"),
                System("INT4 (packed KV pool in host RAM)", make_policy("int4"), "cpu")]
    out.append(System("transformers DynamicCache", hf_offloading=False))
    return out


def markdown(payload: dict, context: int) -> str:
    m = payload["machine"]
    lines = [
        "# Offloading on CPU: decode throughput side by side",
        "",
        f"Model: {payload['model']}, {payload['settings'].get('dtype', 'float32')} (transformers: its defaults, "
        f"in a fresh process). Machine: {m['cpu']}, {m['cpu_count']} cores, "
        f"torch {m['torch']} ({m['torch_threads']} threads), transformers {m.get('transformers', '?')}, "
        f"{m['platform']}.",
        f"Context {context} tokens (prompt {payload['settings']['prompt_len']} "
        f"+ {payload['settings']['gen_len']} generated), "
        f"decode timed over {payload['settings']['gen_len'] - 1} steps from a filled cache; prompts are consecutive "
        f"pieces of {payload['settings']['text']}.",
        f"Command: `{payload['command']}`",
        "Disk rows: " + (f"memory bound {mb['limit_bytes'] / 2**20:.0f} MiB ({mb['describe']}; {mb['scope']}), so the "
                         f"page cache cannot hold the pool; peak charged {mb['group_peak_bytes'] / 2**20:.0f} MiB."
                         if (mb := payload["settings"].get("memory_bound")) and mb.get("group_peak_bytes") is not None
                         else f"memory bound: {mb['describe']}." if mb else
                         "no memory bound: the pool file may sit in the page cache (RAM speed)."),
        "",
        "| batch | system | ms/step | tokens/s | x DynamicCache | x ideal | MB moved/token | peak fast MB | "
        "peak slow MB | relative KV |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f2(v):
        return "-" if v is None else f"{v:.2f}"

    def mb(v):
        return "-" if v is None else f"{v / 2**20:.1f}"

    for r in payload["rows"]:
        rel = r.get("relative_kv")
        lines.append(f"| {r['batch']} | {r['system']} | {r['decode_ms_per_step']:.0f} | "
                     f"{f2(r['decode_tokens_per_s'])} | {f2(r.get('x_vs_transformers'))} | "
                     f"{f2(r.get('x_vs_ideal'))} | {mb(r.get('bytes_moved_per_token'))} | "
                     f"{mb(r.get('peak_fast_bytes'))} | {mb(r.get('peak_slow_bytes'))} | "
                     f"{'-' if rel is None else f'{100 * rel:.1f}%'} |")
    lines += ["", "Peak fast MB: weights + what the runtime holds in fast memory (the whole KV cache for in-RAM "
              "systems; staging buffers, metadata and InfiniGen's partial key cache for offloaded ones); for "
              "DynamicCache, weights + its cache. Peak slow MB: the KV pool (host buffer or file).", ""]
    lines += ["## Targets", ""]
    big = max(r["batch"] for r in payload["rows"])
    cell = [r for r in payload["rows"] if r["batch"] == big]
    hf = next((r for r in cell if r["policy"] == "transformers"), None)

    def ratio(label_part):
        r = next((r for r in cell if label_part in r["system"]), None)
        return None if r is None or hf is None else r["decode_tokens_per_s"] / hf["decode_tokens_per_s"]

    def row(label):
        return next((r for r in cell if r["system"] == label), None)

    def x(a, b):
        return None if a is None or b is None else a["decode_tokens_per_s"] / b["decode_tokens_per_s"]

    ok = lambda c: "met" if c else "NOT met"  # noqa: E731
    ideal, ram, disk = row("ideal (full cache in RAM)"), row("InfiniGen (KV in RAM)"), row("InfiniGen (KV on disk)")
    full_disk = row("full offload (KV on disk)")
    checks = [("InfiniGen, KV in RAM, vs our full cache (ideal)", x(ram, ideal), 2.0),
              ("InfiniGen, KV in RAM, vs transformers DynamicCache (fresh process)", x(ram, hf), 3.0),
              ("InfiniGen, KV on disk, vs full offload on disk (same memory bound)", x(disk, full_disk), 3.0),
              ("InfiniGen, KV on disk, vs InfiniGen with the KV in RAM", x(disk, ram), 0.8)]
    for what, v, target in checks:
        if v is not None:
            lines.append(f"- {what}, {context} x {big}: {v:.2f}x (target >= {target:g}x): {ok(v >= target)}.")
    if disk is not None and disk.get("peak_fast_bytes") and disk.get("kv_bytes_full"):
        allowed = disk["weight_bytes_fast"] + 0.16 * disk["kv_bytes_full"] + disk["staging_bytes"]
        lines.append(f"- Fast-memory peak of InfiniGen on disk: {disk['peak_fast_bytes'] / 2**20:.0f} MB "
                     "against weights + "
                     f"16% of the KV + staging = {allowed / 2**20:.0f} MB: {ok(disk['peak_fast_bytes'] <= allowed)}.")
    ig = next((r for r in cell if r["system"].startswith("InfiniGen") and r.get("breakdown")), None)
    if ig:
        blk = ig["breakdown"]["per_block_ms"]
        lines += ["", f"Per-block time of {ig['system']} at batch {big} (ms, instrumented steps): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in blk.items()) + "."]
    return "\n".join(lines) + "\n"


def auto_limit(model, syst, batches, max_len) -> int:
    """A bound below the pool: what the disk rows may need to hold in fast memory (16% of the KV for
    speculation state; four layers of staging: per parity, the fetched rows and the whole-layer buffer of
    the disk tier's sequential reads; 128 MiB of activations and kernel scratch: bfloat16 runs at the
    smoke sizes charged 87-95 MiB, over the 64 MiB this allowed before) plus slack that is a quarter of
    the pool at most, so the page cache can never hold the whole pool. The weights are not in it: they
    are loaded before the bound applies (see disk_child)."""
    from infinigen.placement import kv_slot_bytes
    pool = max(kv_slot_bytes(model, b, s.policy, "disk") * max_len for s in syst if s.kv_offload == "disk"
               for b in batches)
    layers = model.cfg.num_layers
    return int(0.16 * pool + 4 * pool / layers + (128 << 20) + min(256 << 20, pool / 4))


def disk_child(model, tok, syst, settings, args, limit, progress) -> int:
    """Run the disk rows with memory bounded from after each shared prefill (which holds the whole KV in
    RAM once, by design) to the end of the cell's decoding: the pool file's page cache, the staging and
    the speculation state all count against the limit."""
    from infinigen import bench
    from infinigen.eval.ppl import load_text
    from infinigen.membound import MemoryBound
    mb = MemoryBound(limit)
    if mb.group is None:  # systemd-run bounds a command, not this running process
        raise SystemExit(f"--memory-limit: {mb.describe()} cannot bound a running process; pass --memory-limit none")
    @contextlib.contextmanager
    def outside_bound():  # the shared prefill holds the whole KV once, by design: not charged
        mb.leave()
        yield
        mb.enter()
        progress(f"bounded: {mb.describe()}")

    try:
        rows = bench.sweep(model, syst, settings, tokenizer=tok, text=load_text(args.text), progress=progress,
                           around_prefill=outside_bound)
        info = dict(mb.info(), scope="disk rows, after the shared prefill", **{f"group_{k}_bytes": v
                                                                             for k, v in mb.stats().items()})
    finally:
        mb.close()
    if not info.get("group_peak_bytes"):  # nothing was charged: the rows ran outside the bound
        raise SystemExit("the memory bound was never applied to the disk rows (nothing charged to the group)")
    Path(args.disk_child).write_text(json.dumps({"memory_bound": info, "rows": bench.strip_private(rows)}) + "\n")
    return 0


def hf_child(model, tok, args) -> int:
    """transformers' DynamicCache in this fresh process, loaded with from_pretrained's defaults."""
    from infinigen import bench
    from infinigen.eval.ppl import load_text
    hf = bench.hf_model_for("default", "auto", "cpu")
    settings = bench.BenchSettings(prompt_lens=[args.context - args.gen_len],
                                   batch_sizes=[int(b) for b in args.batch.split(",")], gen_len=args.gen_len)
    system = bench.System("transformers DynamicCache", hf_offloading=False)
    rows = bench.sweep(model, [system], settings, tokenizer=tok, text=load_text(args.text), hf_model=hf,
                       progress=lambda m: print(m, file=sys.stderr, flush=True))
    for r in rows:
        r["dtype"] = str(hf.dtype).removeprefix("torch.")
    Path(args.hf_child).write_text(json.dumps({"rows": bench.strip_private(rows)}) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", default="4,8")
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--text", default="prideprejudice")
    ap.add_argument("--paper", action="store_true", help="also InfiniGen with the paper's settings")
    ap.add_argument("--no-baselines", action="store_true", help="skip full offload, H2O and INT4")
    ap.add_argument("--breakdown", type=int, default=2, help="instrumented steps for the per-block breakdown")
    ap.add_argument("--pool-dir", default=None, help="where the disk tier's files go")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--out", default=None, help="output folder (default: results/offload/, or a temp dir with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (context 160, batch 1,2, 4 tokens)")
    ap.add_argument("--memory-limit", default="auto",
                    help="memory bound of the disk rows' process, so the page cache cannot hold the pool: "
                         "auto (the fast tier's needs + slack, below the pool size), none, or a size (2G)")
    # bfloat16 is the default: on this AVX512-BF16 CPU it decoded faster than float32 for the full cache and
    # for InfiniGen at 8192 x 8, with a 1.6x faster prefill and half the memory (results/dtype_cpu/dtype_cpu.md)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="our runtime's dtype (weights, KV); transformers runs with its own defaults")
    # internal: run the disk rows, write JSON here
    ap.add_argument("--disk-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--hf-child", default=None, help=argparse.SUPPRESS)  # internal: run transformers, write JSON here
    ap.add_argument("--disk-only", action="store_true",
                    help="re-run only the disk rows (bounded) into the offload_cpu.json already in --out")
    args = ap.parse_args(argv)
    if args.smoke:
        args.context, args.batch, args.gen_len, args.breakdown = 160, "1,2", 4, 1
    out = (Path(args.out) if args.out
           else Path(tempfile.mkdtemp(prefix="offload-smoke-")) if args.smoke else ROOT / "results" / "offload")
    before = None
    if args.disk_only and not args.disk_child:  # checked before any work: the table the disk rows go into
        table = out / "offload_cpu.json"
        if not table.exists():
            print(f"offload_cpu: --disk-only needs an earlier run's {table}", file=sys.stderr)
            return 2
        before = json.loads(table.read_text())
        if before["settings"].get("dtype", "float32") != args.dtype:
            print(f"offload_cpu: --disk-only: the table in {out} was measured in "
                  f"{before['settings'].get('dtype', 'float32')}, "
                  f"not {args.dtype} (give --dtype)", file=sys.stderr)
            return 2
    out.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)

    from infinigen import bench
    from infinigen.eval.ppl import load_text
    from infinigen.loading import load
    model, tok, name = load("default", dtype=args.dtype, device="cpu")
    if args.hf_child:
        return hf_child(model, tok, args)
    prompt = args.context - args.gen_len
    batches = [int(b) for b in args.batch.split(",")]
    syst = systems(args.paper, not args.no_baselines)
    from infinigen.membound import parse_limit
    limit = parse_limit(args.memory_limit)
    if limit is None:
        limit = auto_limit(model, syst, batches, args.context + args.breakdown)
    disk = [s for s in syst if s.kv_offload == "disk"] if limit else []
    if args.disk_child:
        syst = disk
    elif disk:
        syst = [s for s in syst if s not in disk]
    for s in syst:
        if s.policy is not None:
            s.policy = s.policy.prepare(model, tok, progress=True)  # InfiniGen: skew from the cache, or calibrated once
    settings = bench.BenchSettings(prompt_lens=[prompt], batch_sizes=batches, gen_len=args.gen_len,
                                   pool_dir=args.pool_dir, breakdown_steps=args.breakdown, share_prefill=True)

    def progress(msg):
        print(msg, file=sys.stderr, flush=True)

    if args.disk_child:
        return disk_child(model, tok, syst, settings, args, limit, progress)
    hf_sys = [s for s in syst if not s.ours]
    if args.disk_only:  # keep the other rows of an earlier run with the same settings
        rows = [r for r in before["rows"] if r["kv_offload"] != "disk" and r["batch"] in batches]
        hf_sys = []
    else:
        rows = bench.sweep(model, [s for s in syst if s.ours], settings, tokenizer=tok, text=load_text(args.text),
                           progress=progress)
    if hf_sys:  # transformers as a user runs it: a fresh process, its default dtype and attention
        rows_file = out / "hf_rows.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:]),
               "--hf-child", str(rows_file)]
        import subprocess
        if subprocess.run(cmd).returncode != 0:
            print("the transformers process failed", file=sys.stderr)
            return 1
        rows += json.loads(rows_file.read_text())["rows"]
        rows_file.unlink()
        bench.add_ratios(rows)
    bound = None
    if disk:  # the disk rows in a child process, bounded after its prefill
        rows_file = out / "disk_rows.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:]),
               "--memory-limit", str(limit), "--disk-child", str(rows_file)]
        import subprocess
        code = subprocess.run(cmd).returncode
        if code != 0:
            print(f"the disk rows' process failed with exit code {code}"
                  + (" (killed: raise --memory-limit)" if code in (-9, 137) else ""), file=sys.stderr)
            return 1
        child = json.loads(rows_file.read_text())
        rows_file.unlink()
        bound = child["memory_bound"]
        rows += [dict(r, memory_bound=bound) for r in child["rows"]]
        bench.add_ratios(rows)
    payload = {"model": name, "machine": bench.machine(),
               "settings": {"context": args.context, "prompt_len": prompt, "gen_len": args.gen_len, "batches": batches,
                            "text": args.text, "share_prefill": True, "memory_bound": bound,
                            "dtype": args.dtype},
               "command": "python benchmarks/offload_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "rows": bench.strip_private(rows)}
    (out / "offload_cpu.json").write_text(json.dumps(payload, indent=2) + "\n")
    bench.plot(rows, out / "offload_cpu.png", title=f"{name} | {payload['machine']['cpu']} | context {args.context}")
    (out / "offload.md").write_text(markdown(payload, args.context))
    print((out / "offload.md").read_text())
    print(f"wrote {out / 'offload.md'}, offload_cpu.json, offload_cpu.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
