"""The KV pool on disk in page-aligned blocks: decode at context 8192 x batch 8 under a memory bound below the
pool, InfiniGen choosing blocks vs InfiniGen choosing tokens vs full offload, and InfiniGen with the KV in RAM,
side by side from one shared prefill per process.

    python benchmarks/disk_blocks.py                          # 8176 + 16 tokens x 8, bfloat16 (minutes)
    python benchmarks/disk_blocks.py --context 4096 --batch 4 # smaller, on a busy machine
    python benchmarks/disk_blocks.py --smoke                  # tiny sizes, results in a temp dir
    python benchmarks/disk_blocks.py --rows ram,full,blocks,speculation --blocks 32 --breakdown 3
                                          # the rows that the targets name, and where each step's time goes
    ... --rows ram,full,blocks,blocks-torch,speculation,speculation-torch  # the native block selection against
                                          # the torch path's (the same blocks) in one run

The disk rows run in a child process bounded after its shared prefill (`offload_cpu.disk_child`: a cgroup
where the machine allows it), so the page cache cannot hold the pool. Per disk row: ms/step, the bytes the
store read from the pool per step (for the block layout: the units the selections named) and what the process
read from storage per step (/proc/self/io read_bytes, every thread: the kernel's own count).
Writes results/disk_blocks/disk_blocks.md and results/disk_blocks/disk_blocks.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def block_policy(ig, block: int, fetch: float | None = None, torch_path: bool = False, query: str = "auto"):
    """InfiniGen with `ig`'s calibrated settings, choosing blocks of `block` tokens (no second calibration;
    `dense_below` 0: at these lengths every row selects, and the crossing is not measured again); `fetch`: the
    blocks holding that many times the cap read, the token rule's tokens within them attended (`block_fetch`);
    `torch_path`: its blocks chosen by the torch path, not the native block selection (the same choice); `query`:
    which query selects (auto: on the disk in blocks the layer's own; corrected: the speculation one layer ahead
    prefetched, then corrected by the own query)."""
    from infinigen.policies import make_policy
    chosen = {k: getattr(ig, k) for k in ("alpha", "kv_budget", "budget_growth", "exact_first", "dense_layers",
                                          "remainder_from")}
    pol = make_policy("infinigen", block=block, block_fetch=fetch, calibrate=False, dense_below=0, query=query,
                      **chosen)
    return _on_torch_path(pol) if torch_path else pol


def _on_torch_path(pol):
    """`pol` choosing its selections with the native block selection turned off (the rows side by side in one
    process)."""
    from infinigen.kernels import block_select

    class TorchBlocks(type(pol)):
        def keep(self, layer, rows, session):
            was, block_select.enabled = block_select.enabled, False
            try:
                return super().keep(layer, rows, session)
            finally:
                block_select.enabled = was
    return TorchBlocks(**pol.requested)


ROWS = ("ram", "ram-blocks", "full", "full-blocks", "tokens-mapped", "tokens-blocks", "blocks", "corrected",
        "blocks-torch", "within", "speculation", "speculation-torch")


def systems(ig, blocks: list[int], rows=ROWS):
    """`ig`: the default InfiniGen, prepared (its calibrated settings are the block rows' too); `rows`: which of
    ROWS to run (the benchmark's rows in that order)."""
    from infinigen.bench import System
    from infinigen.policies import make_policy
    out = {"ram": [System("InfiniGen, tokens (KV in RAM)", ig, "none")],
           "ram-blocks": [System(f"InfiniGen, blocks of {blocks[0]} (KV in RAM)", block_policy(ig, blocks[0]),
                                 "none")],
           "full": [System("full offload (disk, mapped file)", make_policy("full"), "disk")],
           "full-blocks": [System(f"full offload (disk, blocks of {blocks[0]})", make_policy("full"), "disk",
                                  disk_block=blocks[0])],
           "tokens-mapped": [System("InfiniGen, tokens (disk, mapped file)", ig, "disk")],
           "tokens-blocks": [System(f"InfiniGen, tokens (disk, blocks of {blocks[0]})", ig, "disk",
                                    disk_block=blocks[0])],
           "blocks": [System(f"InfiniGen, blocks of {b} (disk, blocks of {b})", block_policy(ig, b), "disk",
                             disk_block=b) for b in blocks],
           # the same selection (the own query's), its blocks prefetched from the speculation one layer ahead
           "corrected": [System(f"InfiniGen, blocks of {b}, speculated and corrected (disk, blocks of {b})",
                                block_policy(ig, b, query="corrected"), "disk", disk_block=b) for b in blocks],
           "blocks-torch": [System(f"InfiniGen, blocks of {blocks[0]}, torch selection (disk, blocks of {blocks[0]})",
                                   block_policy(ig, blocks[0], torch_path=True), "disk", disk_block=blocks[0])],
           "within": [System(f"InfiniGen, tokens within 2x blocks of {blocks[0]} (disk, blocks of {blocks[0]})",
                             block_policy(ig, blocks[0], 2.0), "disk", disk_block=blocks[0])],
           # this one reads what was speculated alone
           "speculation": [System(f"InfiniGen, blocks of {blocks[-1]}, speculation only (disk, blocks of "
                                  f"{blocks[-1]})", block_policy(ig, blocks[-1]), "disk", disk_block=blocks[-1],
                                  correct=False)],
           "speculation-torch": [System(f"InfiniGen, blocks of {blocks[-1]}, speculation only, torch selection (disk, "
                                        f"blocks of {blocks[-1]})", block_policy(ig, blocks[-1], torch_path=True),
                                        "disk", disk_block=blocks[-1], correct=False)]}
    return [s for key in ROWS if key in rows for s in out[key]]


def markdown(payload: dict) -> str:
    m, st = payload["machine"], payload["settings"]
    bound = st.get("memory_bound") or {}
    lines = ["# The disk tier in blocks: decode under a memory bound below the pool", "",
             f"Model: {payload['model']}, {st['dtype']}. Machine: {m['cpu']}, {m['cpu_count']} cores, torch "
             f"{m['torch']} ({m['torch_threads']} threads), {m['platform']}.",
             f"Context {st['context']} (prompt {st['prompt_len']} + {st['gen_len']} generated), batch "
             f"{', '.join(map(str, st['batches']))}; decode timed over {st['gen_len'] - 1} steps from a filled cache "
             f"(prompts: consecutive pieces of {st['text']}).",
             f"Command: `{payload['command']}`; date {payload['date']}; /proc/loadavg before: "
             f"{payload['load_before']}, after: {payload['load_after']}.",
             f"Disk rows: {bound.get('mechanism', 'no bound')} {bound.get('limit_bytes', 0) / 2**20:.0f} MiB after the "
             f"shared prefill; peak charged {bound.get('group_peak_bytes', 0) / 2**20:.0f} MiB; pool "
             f"{payload.get('pool_mb', 0):.0f} MB.", "",
             "| batch | system | ms/step | x full offload (mapped) | x InfiniGen in RAM | pool MB read/step "
             "| storage MB read/step | storage / pool read | units read/step | relative KV | tokens = RAM's |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = payload["rows"]
    for b in st["batches"]:
        cell = [r for r in rows if r["batch"] == b]
        full = next((r for r in cell if r["system"] == "full offload (disk, mapped file)"), None)
        ram = next((r for r in cell if r["system"] == "InfiniGen, tokens (KV in RAM)"), None)
        for r in cell:
            ms = r["decode_ms_per_step"]
            x_full = f"{full['decode_ms_per_step'] / ms:.2f}" if full else "-"
            x_ram = f"{ram['decode_ms_per_step'] / ms:.2f}" if ram else "-"
            disk = r["kv_offload"] == "disk"
            pool = r["slow_bytes_read_per_step"] / 1e6 if disk else None
            dev = r.get("device_read_bytes_per_step")
            dev_mb = dev / 1e6 if disk and dev is not None else None
            share = f"{dev_mb / pool:.2f}" if pool and dev_mb is not None else "-"
            same = "-"
            twin = next((o for o in cell if o["kv_offload"] == "none" and o["settings"] == r["settings"]), None)
            if disk and twin is not None:
                same = "yes" if twin["tokens_sha1"] == r["tokens_sha1"] else "no"
            lines.append(f"| {b} | {r['system']} | {ms:.0f} | {x_full} | {x_ram} | "
                         f"{'-' if pool is None else f'{pool:.1f}'} | {'-' if dev_mb is None else f'{dev_mb:.1f}'} | "
                         f"{share} | {r['blocks_read_per_step']:.0f} | {100 * r['relative_kv']:.1f}% | {same} |")
    lines += ["", "Pool MB read/step: what the store read from the pool file per decoding step (mapped file: the "
              "rows, or the whole used layer where a selection touches most pages; blocks: the units named). "
              "Storage MB read/step: /proc/self/io read_bytes over the decode, per step (page-cache misses of every "
              "thread). Relative KV: entries attended over all layers. Tokens = RAM's: the greedy tokens equal "
              "those of the same policy with the KV in RAM, where one ran (a row whose layers read their own query's "
              "selection reads what RAM's reads; one reading the speculation alone need not)."]
    return "\n".join(lines + breakdown_lines(rows)) + "\n"


def breakdown_lines(rows: list[dict]) -> list[str]:
    """Where a decoding step's main-thread time goes (`--breakdown`: extra instrumented steps after the timed
    ones), summed over the layers, for the rows that have it."""
    timed = [r for r in rows if r.get("breakdown")]
    if not timed:
        return []
    cats = list(timed[0]["breakdown"]["per_block_ms"])
    details = sorted({k for r in timed for k in r["breakdown"].get("detail_ms_per_step", {})})
    lines = ["", "Where a step's time goes (ms/step over every layer; instrumented steps after the timed ones, so "
             "slower; detail: inclusive main-thread times of the correction's parts):", "",
             "| system | step | " + " | ".join(cats + details) + " | worker gather |",
             "|---|" + "---|" * (len(cats) + len(details) + 2)]
    for r in timed:
        bd = r["breakdown"]
        n = len(bd["per_layer_ms"])
        cells = [f"{bd['per_block_ms'][c] * n:.1f}" for c in cats]
        cells += [f"{bd.get('detail_ms_per_step', {}).get(k, 0.0):.1f}" for k in details]
        lines.append(f"| {r['system']} | {bd['step_ms']:.0f} | " + " | ".join(cells)
                     + f" | {bd['worker_gather_ms_per_step']:.1f} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", default="8")
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--blocks", default="16,32", help="block sizes (tokens) of the block-selecting rows")
    ap.add_argument("--text", default="prideprejudice")
    ap.add_argument("--pool-dir", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--memory-limit", default="auto", help="bound of the disk rows (auto: below the pool; none)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"which rows to run, of {','.join(ROWS)}")
    ap.add_argument("--breakdown", type=int, default=0,
                    help="extra instrumented decoding steps per row for where the time goes (0: off)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (context 160, batch 2, 4 tokens)")
    ap.add_argument("--disk-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    rows_wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows_wanted) - set(ROWS))
    if unknown or not rows_wanted:
        ap.error(f"--rows: {', '.join(unknown) or 'none given'}: not one of {', '.join(ROWS)}")
    if args.smoke:
        args.context, args.batch, args.gen_len = 160, "2", 4
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="disk-blocks-")) if args.smoke \
        else ROOT / "results" / "disk_blocks"
    out.mkdir(parents=True, exist_ok=True)

    from infinigen import bench
    from infinigen.eval.ppl import load_text
    from infinigen.loading import load
    from infinigen.membound import parse_limit
    from infinigen.placement import kv_slot_bytes
    from offload_cpu import auto_limit, disk_child
    model, tok, name = load("default", dtype=args.dtype, device="cpu")
    batches = [int(b) for b in args.batch.split(",")]
    from infinigen.policies import make_policy
    ig = make_policy("infinigen")
    ig = ig.prepare(model, tok, progress=True)
    syst = systems(ig, [int(b) for b in args.blocks.split(",")], rows_wanted)
    limit = parse_limit(args.memory_limit)
    if limit is None and args.memory_limit.strip().lower() == "auto":
        limit = auto_limit(model, syst, batches, args.context)
    disk = [s for s in syst if s.kv_offload == "disk"]
    syst = disk if args.disk_child else [s for s in syst if s not in disk] if limit else syst
    for s in syst:
        s.policy = s.policy.prepare(model, tok, progress=True)
    settings = bench.BenchSettings(prompt_lens=[args.context - args.gen_len], batch_sizes=batches,
                                   gen_len=args.gen_len, pool_dir=args.pool_dir, share_prefill=True,
                                   breakdown_steps=args.breakdown)

    def progress(msg):
        print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)

    if args.disk_child:
        return disk_child(model, tok, syst, settings, args, limit, progress)
    load_before = Path("/proc/loadavg").read_text().strip()
    rows = bench.sweep(model, syst, settings, tokenizer=tok, text=load_text(args.text), progress=progress)
    bound = None
    if limit:
        rows_file = out / "disk_blocks_rows.json"
        argv = argv if argv is not None else sys.argv[1:]
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--memory-limit", str(limit),
               "--disk-child", str(rows_file)]
        code = subprocess.run(cmd).returncode
        if code != 0:
            print(f"the disk rows' process failed with exit code {code}", file=sys.stderr)
            return 1
        child = json.loads(rows_file.read_text())
        rows_file.unlink()
        bound = child["memory_bound"]
        rows += child["rows"]
    pool = max(kv_slot_bytes(model, b, None, "disk") for b in batches) * args.context
    payload = {"model": name, "machine": bench.machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "load_before": load_before, "load_after": Path("/proc/loadavg").read_text().strip(),
               "pool_mb": pool / 1e6,
               "settings": {"context": args.context, "prompt_len": args.context - args.gen_len,
                            "gen_len": args.gen_len, "batches": batches, "text": args.text, "dtype": args.dtype,
                            "memory_bound": bound},
               "command": "python benchmarks/disk_blocks.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "rows": bench.strip_private(rows)}
    (out / "disk_blocks.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out / "disk_blocks.md").write_text(markdown(payload))
    print((out / "disk_blocks.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
