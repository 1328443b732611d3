"""A prefix-cache hit on a block pool (`serve --kv-offload disk --disk-block 16`): what the hit costs in time and
memory when the cached prefix is written into the request's pool file a cached block at a time (the server's
way), against restoring it as one copy of the whole prefix per layer (the RAM copy), and against no hit (the
whole prompt prefilled). One process, the steps a server's engine takes, side by side per document length.

    python benchmarks/prefix_disk_pool.py                        # 1024, 2048, 4096-token documents
    python benchmarks/prefix_disk_pool.py --lengths 512 --smoke  # a quick look, results in a temp dir

Per length: time to the first token (miss: the whole prompt; hit: restore + the rest's prefill), the growth of the
process's peak resident set (VmHWM, reset before each hit, freed heap handed back first) and whether the greedy
answer equals the miss's. Writes results/serve_disk/prefix_hits.md and .json.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _answer(model, sess, logits, n):
    from infinigen import runtime
    out = [int(logits.argmax(-1))]
    for _ in range(n - 1):
        out.append(int(runtime.decode(model, torch.tensor([out[-1]]), sess).argmax(-1)))
    return out


def one_length(model, pol, placement, cache, doc_len: int, answer: int, seed: int) -> dict:
    """The miss, then the two hits, for a document of `doc_len` random tokens and an 8-token question."""
    from infinigen import runtime
    from infinigen.memory import MemoryProbe, release_free_heap
    from infinigen.serve.engine import open_session
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, model.cfg.vocab_size, (doc_len + 8,), generator=g).tolist()
    probe = MemoryProbe(torch.device("cpu"))
    row = {"doc_tokens": doc_len}
    sess = open_session(model, placement, pol, len(prompt) + answer)
    t0 = time.perf_counter()
    logits = runtime.prefill(model, torch.tensor([prompt]), sess)
    row["miss_ttft_s"] = time.perf_counter() - t0
    cache.insert(prompt, sess.store)
    miss = _answer(model, sess, logits, answer)
    sess.store.close()
    row["prefix_kv_bytes"] = cache.bytes
    for how in ("blocks", "ram_copy"):
        release_free_heap()
        probe.reset()
        base = probe.peak()
        t0 = time.perf_counter()
        sess = open_session(model, placement, pol, len(prompt) + answer)
        if how == "blocks":  # what the engine does
            cached, blocks = cache.lookup_blocks(prompt)
            for i, block in enumerate(blocks):
                sess.restore_prefix(block.keys, block.values, at=i * cache.block_tokens)
        else:
            cached, keys, values = cache.lookup(prompt)
            sess.restore_prefix(keys, values)
            del keys, values
        logits = runtime.prefill(model, torch.tensor([prompt[cached:]]), sess, cached=cached)
        row[f"{how}_ttft_s"] = time.perf_counter() - t0
        row[f"{how}_peak_growth_bytes"] = probe.peak() - base
        row["cached_tokens"] = cached
        row[f"{how}_equal"] = _answer(model, sess, logits, answer) == miss
        sess.store.close()
    return row


def markdown(payload: dict) -> str:
    m = payload["machine"]
    mib = 2 ** 20
    lines = ["# Prefix-cache hits on a block pool: written a block at a time vs copied whole", "",
             f"Command: `{payload['command']}`; date {payload['date']}; machine: {m['cpu']}, {m['cpu_count']} "
             f"cores, torch {m['torch']} ({m['torch_threads']} threads), {m['platform']}; /proc/loadavg before: "
             f"{payload['load_before']}, after: {payload['load_after']}.", "",
             f"Model {payload['model']} ({payload['dtype']}), policy full, KV pool on disk in blocks of "
             f"{payload['disk_block']} tokens, prefix cache in memory in blocks of {payload['prefix_block']} tokens. "
             "Documents of random tokens + an 8-token question; the answer is "
             f"{payload['answer']} greedy tokens.", "",
             "| document tokens | prefix KV MiB (all layers) | miss TTFT s | hit TTFT s (blocks) "
             "| hit TTFT s (RAM copy) | peak RSS growth MiB (blocks) | peak RSS growth MiB (RAM copy) "
             "| answers = miss (blocks, RAM copy) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        lines.append(f"| {r['doc_tokens']} | {r['prefix_kv_bytes'] / mib:.1f} | {r['miss_ttft_s']:.2f} | "
                     f"{r['blocks_ttft_s']:.2f} | {r['ram_copy_ttft_s']:.2f} | "
                     f"{r['blocks_peak_growth_bytes'] / mib:.1f} | {r['ram_copy_peak_growth_bytes'] / mib:.1f} | "
                     f"{r['blocks_equal']}, {r['ram_copy_equal']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--answer", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="results in a temp dir")
    ap.add_argument("--out", default=str(ROOT / "results" / "serve_disk"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from infinigen.bench.report import machine
    from infinigen.loading import load
    from infinigen.placement import Placement
    from infinigen.policies import make_policy
    from infinigen.serve.prefix import PrefixCache
    load_before = Path("/proc/loadavg").read_text().strip()
    model, _, name = load("default", progress=False)
    pol = make_policy("full")
    rows = []
    with tempfile.TemporaryDirectory() as pool:
        placement = Placement(kv_offload="disk", disk_block=16, pool_dir=pool)
        for i, n in enumerate(args.lengths):
            cache = PrefixCache(8 << 30, 256)
            rows.append(one_length(model, pol, placement, cache, n, args.answer, seed=i))
            print(json.dumps(rows[-1]), file=sys.stderr)
    payload = {"model": name, "dtype": str(model.dtype).replace("torch.", ""), "disk_block": 16, "prefix_block": 256,
               "answer": args.answer, "machine": machine(), "load_before": load_before,
               "load_after": Path("/proc/loadavg").read_text().strip(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": " ".join(["python benchmarks/prefix_disk_pool.py",
                                    *(sys.argv[1:] if argv is None else argv)]),
               "rows": rows}
    out = Path(tempfile.mkdtemp()) if args.smoke else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix_hits.json").write_text(json.dumps(payload, indent=1))
    (out / "prefix_hits.md").write_text(markdown(payload))
    print(out / "prefix_hits.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
