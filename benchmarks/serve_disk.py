"""Conversations that live on disk: N concurrent clients, each with its own D-token document and an A-token answer,
against servers that run under one memory bound (below the requests' total KV).

    python benchmarks/serve_disk.py                                      # 16 clients x 8000 tokens, 1.5 GiB
    python benchmarks/serve_disk.py --clients 4 --doc-tokens 2000 --memory-limit 1G --out results/serve_disk/serve_disk
    python benchmarks/serve_disk.py --answer-tokens 64 --alone-count 16          # the issue's answers, every one alone

Where the time goes: every system prefills every client's document (16 x 8000 tokens: minutes each on a 2-core
host), and the check against the same request alone prefills it again; full offload's decode steps read every
running request's whole KV from disk. So by default the answers are 32 tokens (the issue's: 64) and the equality
with the request alone is checked on a sample of 2 clients spread over the batch (`--alone-count`); the output
says both. Per system the phases are timed (start-up, the concurrent clients, the requests alone).

Systems, each a fresh process on a free port of 127.0.0.1 inside a fresh memory cgroup of `--memory-limit`
(made here with `infinigen.membound`, page cache charged; root needed), started and stopped by this script:

  full offload   `infinigen serve --policy full --kv-offload disk` (the pool in a memory-mapped file, its faster
                 layout for whole-layer reads: results/disk_blocks/disk_blocks.md)
  InfiniGen      `infinigen serve --policy infinigen --kv-offload disk --disk-block B --knob block=B` and the
                 default model's calibrated settings as knobs (`CALIBRATED`: no calibration at start-up, every
                 row selects): every layer selects blocks of B tokens, read with positioned reads
  llama-server   llama.cpp's server (the native build benchmarks/peer_llamacpp.py caches) with the same GGUF,
                 `-np N` slots of `-c` holding each request, its defaults otherwise (`--no-llama`: not run)
  llama-q4kv     the same with its KV cache in 4 bits (`-ctk q4_0 -ctv q4_0 -fa on`, a quarter of the bytes): not
                 its default, the form that fits a bound (only when `--systems` names it)

Our servers find the bound from the cgroup they start in (no --memory-limit flag: the cgroup's limit sets their
fast budget); --max-batch N and a queue for every client. Each system gets one warm-up request, then the N
clients at once (threads of the `openai` package, streamed chat, temperature 0), then each request again alone,
one after another, whose answer is compared with the concurrent one. Reported per system: aggregate decode
tok/s (completion tokens after each client's first, over the span from the first first token to the last
token), the decode's own rate (tokens of the server's decoding steps over their seconds, from its /metrics: the
prefills between the steps, the same dense work in every system, not counted), completion tokens/s over the
whole run, TTFT p50/max, the cgroup's peak charge (page cache included) and the server's peak RSS (VmHWM), lost
requests (errors or short answers), answers equal to the same request alone.

`--turns 2` adds the conversations' second turn: once every client has its first answer, each asks a follow-up in
the same conversation (its document, its answer, `FOLLOW_UP`), all at once. Our servers then keep the prompts'
prefixes in a prefix cache whose folder is on disk (`--prefix-cache-dir`, a temporary folder per system, bounded
at twice the documents' KV), so a second turn prefills only its answer and question (a hit writes the cached
blocks into the request's pool file a block at a time) and the turn's decode is the tier's, not the prefills'.
The prefix cache needs the pool in blocks, so full offload runs on the block layout too in that mode. The same
statistics are reported for the second turn, with its own sample of requests alone. `--keep-prefix DIR` keeps each
system's prefix folder; `--warm-prefix DIR` then runs the second turn alone on copies of them (minutes instead of
half an hour; the follow-ups carry empty answers, so it is a tool for working on the turn, not its measurement).

Writes OUT.md and OUT.json (default results/serve_disk/serve_disk).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib.util
import json
import os
import platform
import shutil
import statistics
import tempfile
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _module(name: str):
    """A sibling benchmark imported from its file (serve_load: the servers' helpers and prompts)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


# the default model's shipped calibration (the server's first lines print it), given as knobs so that choosing
# blocks does not calibrate again at start-up; dense_below 0: every row selects (the crossing is not measured)
CALIBRATED = ("calibrate=false", "alpha=7", "kv_budget=0.1354", "budget_growth=0.5", "exact_first=true",
              "remainder_from=1", "dense_layers=", "dense_below=0")
INSTRUCTION = "Read the text below, then say in a few sentences what happens in it."
FOLLOW_UP = "Now name the people in the text and say in one sentence each what they want."


def peak_rss(pid: int) -> int | None:
    from infinigen.memory import peak_rss_of
    return peak_rss_of(pid)


@contextlib.contextmanager
def bounded_server(argv: list[str], port: int, env: dict, log: Path, limit: int, ready_s: float = 1800):
    """`argv` started inside a fresh memory cgroup of `limit` bytes; yields (url, process, bound) once /health
    answers 200; SIGTERM (SIGKILL after 60 s) at the end."""

    from infinigen.membound import MemoryBound
    with MemoryBound(limit) as mb:
        if mb.group is None:
            raise RuntimeError(f"{mb.describe()} cannot hold a server started here: a cgroup is needed (root)")
        procs = str(mb.group / "cgroup.procs")

        def join():  # in the child, before exec: everything it touches is charged to the group
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        with _module("serve_load").server_process(argv, port, env, log, ready_s, preexec_fn=join) as (url, proc):
            yield url, proc, mb


def build_native(env: dict) -> None:
    """Build the runtime's native kernels into the cache now, outside any bound, as the servers will import them:
    a compiler started by a server under the bound would be charged to it (cc1plus takes 600 MB-1 GB there and has
    had the server killed before it served). Checkouts at other paths sharing the cache rebuild the same build
    (its commands name the source's path): there give the run an INFINIGEN_CACHE of its own."""
    import subprocess
    code = "from infinigen.kernels import build_native, fused_select; build_native(); print(fused_select.available())"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    print(f"serve_disk: native kernels built: {run.stdout.strip() or run.stderr.strip()[-300:]}", file=sys.stderr)


def tail(log: Path, n: int = 3000) -> str:
    return _module("serve_load")._tail(log, n)


def documents(clients: int, doc_tokens: int) -> list[list[dict]]:
    """One chat per client: the instruction and a passage of its own (consecutive pieces of the Austen texts)."""
    pr = _module("serve_load").Prompts()
    books = ("emma", "prideprejudice", "sensesensibility")
    out = []
    for i in range(clients):
        book = books[i % len(books)]
        start = (i // len(books)) * doc_tokens
        out.append(pr.chat(INSTRUCTION, book, start, doc_tokens))
    return out


def text_of(client, model, messages, answer_tokens) -> str | None:
    """The greedy answer (not streamed), or None on an error."""
    try:
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=answer_tokens, temperature=0)
        return r.choices[0].message.content
    except Exception:  # noqa: BLE001 -- counted, the run goes on
        return None


def run_system(name: str, argv: list[str], port: int, chats: list[list[dict]], args, logs: Path) -> dict:
    sl = _module("serve_load")
    env = sl.child_env(args.threads)
    row = {"system": name, "command": " ".join(argv)}
    started = time.perf_counter()
    try:
        log = logs / f"{name.split()[0].lower()}.log"
        with bounded_server(argv, port, env, log, args.memory_limit) as (url, proc, mb):
            client = sl.openai_client(url)
            model = sl.served_model(client)
            sl.warm_up(client, model)
            t0 = time.perf_counter()
            row["startup_s"] = round(t0 - started, 1)
            sample = alone_sample(len(chats), args.alone_count if args.alone else 0)
            answers = {}  # --warm-prefix: no first turn, the follow-ups carry empty answers
            if args.warm_prefix is None:
                answers, recs, wall, in_steps = timed_round(url, client, model, chats, args.answer_tokens)
                # a sample of the requests again alone (each a fresh prefill of its document, or a prefix hit)
                t1 = time.perf_counter()
                alone = {i: text_of(client, model, chats[i], args.answer_tokens) for i in sample}
                row["alone_s"] = round(time.perf_counter() - t1, 1)
                row.update(summary(recs, wall, args.answer_tokens), decode_tok_s_in_steps=in_steps)
                row["equal_alone"] = sum(alone[i] is not None and alone[i] == answers.get(i) for i in sample)
                row["compared_alone"] = len(sample)
                row["differs_alone"] = differing(sample, answers, alone)
            row["alone_sample"] = sample
            if args.turns == 2:
                row["turn2"] = second_turn(url, client, model, chats, answers, sample, args)
                row["prefix_metrics"] = prefix_metrics(url)
            row["rss_peak_mib"] = round((peak_rss(proc.pid) or 0) / 2**20)
            stats = mb.stats()
            row["cgroup_peak_mib"] = round(stats.get("peak", 0) / 2**20) if stats.get("peak") else None
            row["bound"] = mb.describe()
            row["startup"] = next((line for line in tail(log, 20000).splitlines() if "serving" in line), "")[:600]
    except RuntimeError as e:
        row["failed"] = " ".join(str(e).split())[:600]
    row["system_s"] = round(time.perf_counter() - started, 1)
    return row


def concurrent_round(client, model, chats: list[list[dict]], answer_tokens: int):
    """Every chat sent at once, streamed and greedy: (answers by client, the `Sent` records, the round's wall s)."""
    sl = _module("serve_load")
    answers = {}

    def one(i):
        rec = sl.Sent(sent=time.perf_counter())
        try:
            stream = client.chat.completions.create(
                model=model, messages=chats[i], max_tokens=answer_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True})
            parts = []
            for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].delta is not None and chunk.choices[0].delta.content:
                    rec.arrivals.append(now)
                    parts.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    rec.completion_tokens = chunk.usage.completion_tokens
            answers[i] = "".join(parts)
        except Exception as e:  # noqa: BLE001 -- counted as lost, the run goes on
            rec.error = repr(e)[:300]
        rec.done = time.perf_counter()
        return rec

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(chats)) as pool:
        recs = list(pool.map(one, range(len(chats))))
    return answers, recs, time.perf_counter() - t0


def follow_ups(chats: list[list[dict]], answers: dict) -> list[list[dict]]:
    """Each conversation's second turn: its first prompt, its answer (empty where it had none) and FOLLOW_UP."""
    return [chat + [{"role": "assistant", "content": answers.get(i) or ""}, {"role": "user", "content": FOLLOW_UP}]
            for i, chat in enumerate(chats)]


def second_turn(url, client, model, chats, answers, sample, args) -> dict:
    """The follow-ups sent at once, then the sample again alone: the same statistics as the first turn."""
    chats2 = follow_ups(chats, answers)
    answers2, recs, wall, in_steps = timed_round(url, client, model, chats2, args.answer_tokens)
    t1 = time.perf_counter()
    alone = {i: text_of(client, model, chats2[i], args.answer_tokens) for i in sample}
    out = {"alone_s": round(time.perf_counter() - t1, 1), **summary(recs, wall, args.answer_tokens),
           "decode_tok_s_in_steps": in_steps}
    out["equal_alone"] = sum(alone[i] is not None and alone[i] == answers2.get(i) for i in sample)
    out["compared_alone"] = len(sample)
    out["differs_alone"] = differing(sample, answers2, alone)
    return out


def differing(sample: list[int], answers: dict, alone: dict) -> list[dict]:
    """The sampled clients whose concurrent answer differs from the same request alone: both texts, to read."""
    return [{"client": i, "concurrent": answers.get(i), "alone": alone[i]} for i in sample
            if alone[i] is None or alone[i] != answers.get(i)]


def server_metrics(url: str, start: str) -> dict:
    """The server's /metrics samples whose names start with `start`, each named without "infinigen_"; or
    {"error": ...} where there is no /metrics to read (llama-server without --metrics)."""
    import urllib.request
    try:
        text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    except OSError as e:
        return {"error": str(e)[:200]}
    out = {}
    for line in text.splitlines():
        if line.startswith(start) and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.removeprefix("infinigen_")] = float(value)
    return out


def prefix_metrics(url: str) -> dict:
    """The server's prefix-cache counters (hits, tokens not prefilled again, the folder's)."""
    return server_metrics(url, "infinigen_prefix_cache")


def timed_round(url: str, client, model, chats: list[list[dict]], answer_tokens: int):
    """`concurrent_round`, and the decode's own rate over it from our server's counters: tokens sampled by
    decoding steps over the seconds spent in them (the prefills between them not counted; None for llama-server)."""
    before = server_metrics(url, "infinigen_decode_")
    answers, recs, wall = concurrent_round(client, model, chats, answer_tokens)
    after = server_metrics(url, "infinigen_decode_")
    tokens, seconds = (after.get(k, 0) - before.get(k, 0) for k in ("decode_tokens_total", "decode_seconds_total"))
    rate = round(tokens / seconds, 2) if "error" not in after and seconds > 0 else None
    return answers, recs, wall, rate


def alone_sample(clients: int, count: int | None) -> list[int]:
    """`count` clients spread evenly over the batch (None or more than there are: every one)."""
    if count is None or count >= clients:
        return list(range(clients))
    return sorted({(2 * i + 1) * clients // (2 * count) for i in range(count)})


def summary(recs, wall: float, answer_tokens: int) -> dict:
    # lost: an error, or a stream that ended without its usage (an answer may be empty: EOS first)
    lost = [r for r in recs if r.error or r.completion_tokens is None]
    ok = [r for r in recs if r not in lost and r.arrivals]
    ttft = [r.arrivals[0] - r.sent for r in ok]
    after_first = sum(max(0, (r.completion_tokens or len(r.arrivals)) - 1) for r in ok)
    span = (max(r.arrivals[-1] for r in ok) - min(r.arrivals[0] for r in ok)) if ok else 0.0
    # while every client was decoding: from the last first token to the first client's last token
    lo = max((r.arrivals[0] for r in ok), default=0.0)
    hi = min((r.arrivals[-1] for r in ok), default=0.0)
    together = sum(sum(lo < t <= hi for t in r.arrivals) for r in ok)
    each = [{"ttft_s": round(r.arrivals[0] - r.sent, 2) if r.arrivals else None,
             "completion_tokens": r.completion_tokens, "error": r.error} for r in recs]
    return {"requests": len(recs), "lost": len(lost), "errors": [r.error for r in lost][:3], "each": each,
            "completion_tokens": sum(r.completion_tokens or len(r.arrivals) for r in ok),
            "decode_tok_s": round(after_first / span, 2) if span > 0 else None,
            "decode_tok_s_all_running": round(together / (hi - lo), 2) if hi > lo and together else None,
            "tok_s_wall": round(sum(r.completion_tokens or len(r.arrivals) for r in ok) / wall, 2),
            "ttft_p50_s": round(statistics.median(ttft), 2) if ttft else None,
            "ttft_max_s": round(max(ttft), 2) if ttft else None, "wall_s": round(wall, 1)}


def llama_bin() -> Path | None:
    """The cached build of llama.cpp tuned for this CPU (benchmarks/peer_llamacpp.py builds it), or None."""
    peer = _module("peer_llamacpp")
    variant = peer.tuning(peer.default_kind(peer.cpu_flags()), peer.cpu_flags())[0]
    return peer.cached_build(None, variant)


def markdown(d: dict) -> str:
    a = d["args"]
    lines = [f"# Conversations on disk: {a['clients']} clients x {a['doc_tokens']}-token documents, "
             f"{a['answer_tokens']}-token answers, under {a['memory_limit'] / 2**30:.2f} GiB", "",
             f"Command: `{d['command']}`; date {d['date']}; machine: {d['machine']}; "
             f"/proc/loadavg before: {d['load_before']}, after: {d['load_after']}; whole run {d.get('run_s')} s.", "",
             f"Answers of {a['answer_tokens']} tokens; each answer compared with the same request sent alone on "
             f"{'every client' if a['alone_count'] is None or a['alone_count'] >= a['clients'] else 'a sample'}"
             f" (`--alone-count {a['alone_count']}`{'' if a['alone'] else ', off: --no-alone'}).", "",
             "| system | lost | decode tok/s (aggregate) | decode tok/s (all running) "
             "| decode tok/s (in decoding steps) | tok/s (whole run) | TTFT p50 s | TTFT max s | cgroup peak MiB "
             "| server RSS peak MiB "
             "| answers = alone (clients) | clients s | alone s | system s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        if "failed" not in r and "requests" not in r:  # --warm-prefix: no first turn
            lines.append(f"| {r['system']} | no first turn (--warm-prefix) | | | | | | | {r['cgroup_peak_mib']} | "
                         f"{r['rss_peak_mib']} | | | | {r.get('system_s')} |")
            continue
        if "failed" in r:
            lines.append(f"| {r['system']} | failed: {r['failed'][:300]} | | | | | | | | | | | | {r.get('system_s')} |")
            continue
        lines.append(f"| {r['system']} | {r['lost']} of {r['requests']} | {r['decode_tok_s']} | "
                     f"{r.get('decode_tok_s_all_running')} | {r.get('decode_tok_s_in_steps')} | {r['tok_s_wall']} | "
                     f"{r['ttft_p50_s']} | {r['ttft_max_s']} | {r['cgroup_peak_mib']} | {r['rss_peak_mib']} | "
                     f"{r['equal_alone']} of {r['compared_alone']} ({', '.join(map(str, r.get('alone_sample', [])))}) "
                     f"| {r['wall_s']} | {r.get('alone_s')} | {r.get('system_s')} |")
    lines += ["", "Decode tok/s (aggregate): completion tokens after each client's first over the span from the first "
              "first token to the last token; (all running): tokens over the span while every client was decoding "
              "(the last first token to the first client's last token); (in decoding steps): tokens sampled by the "
              "server's decoding steps over the seconds spent in them, from its /metrics (the prefills between the "
              "steps not counted; llama-server: not reported). Clients s: the concurrent clients' wall time; "
              "alone s: the sample's requests alone; system s: start-up to shut-down."]
    turn2 = [r for r in d["rows"] if "turn2" in r]
    if turn2:
        lines += ["", "## The second turn: every client's follow-up at once, its document's prefix cached on disk", "",
                  "| system | lost | decode tok/s (aggregate) | decode tok/s (all running) "
                  "| decode tok/s (in decoding steps) | tok/s (whole turn) | TTFT p50 s | TTFT max s | answers = alone "
                  "| turn s | prefix tokens reused (memory, folder) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in turn2:
            t, m = r["turn2"], r.get("prefix_metrics", {})
            reused = (f"{m.get('prefix_cache_hit_tokens_total', m.get('prefix_cache_hit_tokens'))}, "
                      f"{m.get('prefix_cache_disk_hit_tokens_total', m.get('prefix_cache_disk_hit_tokens'))}")
            lines.append(f"| {r['system']} | {t['lost']} of {t['requests']} | {t['decode_tok_s']} | "
                         f"{t.get('decode_tok_s_all_running')} | {t.get('decode_tok_s_in_steps')} | "
                         f"{t['tok_s_wall']} | {t['ttft_p50_s']} | {t['ttft_max_s']} | "
                         f"{t['equal_alone']} of {t['compared_alone']} | {t['wall_s']} "
                         f"| {reused} |")
    lines += ["", "Commands:"] + [f"- {r['system']}: `{r['command']}`" for r in d["rows"]]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    from infinigen.sizes import parse_bytes
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--doc-tokens", type=int, default=8000)
    p.add_argument("--answer-tokens", type=int, default=32, help="tokens per answer (the issue's scenario: 64)")
    p.add_argument("--memory-limit", default="1.5G")
    p.add_argument("--disk-block", type=int, default=16)
    p.add_argument("--block-fetch", type=float, default=None,
                   help="InfiniGen: read blocks holding this many times its cap, attend the tokens within them")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--no-alone", dest="alone", action="store_false", help="skip the requests alone")
    p.add_argument("--alone-count", type=int, default=2,
                   help="compare N requests, spread over the clients, with the same request alone (>= --clients: "
                        "every one)")
    p.add_argument("--turns", type=int, choices=(1, 2), default=1,
                   help="2: each conversation's follow-up after its first answer, the documents' prefixes cached in "
                        "a folder on disk (see above)")
    p.add_argument("--systems", default="full,infinigen,llama")
    p.add_argument("--prefix-dir", default=None,
                   help="where the second turn's prefix-cache folders go (default: the system's temporary folder)")
    p.add_argument("--keep-prefix", default=None,
                   help="--turns 2: keep each system's prefix-cache folder in this folder (as KEY/, hard links)")
    p.add_argument("--warm-prefix", default=None,
                   help="the second turn only, each system's prefix-cache folder starting as KEY/ of this folder (a "
                        "--keep-prefix of a run with the same model, clients and documents); the follow-ups carry "
                        "empty answers: for working on the second turn, not a run to report")
    p.add_argument("--out", default="results/serve_disk/serve_disk")
    args = p.parse_args(argv)
    args.memory_limit = parse_bytes(args.memory_limit, "memory-limit")
    if args.prefix_dir is not None and not Path(args.prefix_dir).is_dir():
        p.error(f"--prefix-dir {args.prefix_dir}: no such folder")
    if args.warm_prefix is not None:
        if not Path(args.warm_prefix).is_dir():
            p.error(f"--warm-prefix {args.warm_prefix}: no such folder")
        args.turns = 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    sl = _module("serve_load")
    out = Path(args.out)
    logs = Path(tempfile.mkdtemp(prefix="serve-disk-logs-"))  # each server's output, named on failure
    load_before = Path("/proc/loadavg").read_text().strip()
    run_started = time.perf_counter()
    chats = documents(args.clients, args.doc_tokens)
    n, b = args.clients, args.disk_block
    common = ["--max-batch", str(n), "--max-queue", str(4 * n), "--host", "127.0.0.1", "--kv-offload", "disk"]
    full_layout, full_name = [], "full offload (disk, mapped file)"
    if args.turns == 1:  # every client's document is its own: a prefix cache would only churn, in the bound's RAM
        common += ["--no-prefix-cache"]
    else:  # the second turn reuses each document's prefix, which a prefix cache keeps for block pools only
        full_layout, full_name = ["--disk-block", str(b)], f"full offload (disk, blocks of {b})"
    folders = tempfile.TemporaryDirectory(prefix="serve-disk-prefix-", dir=args.prefix_dir)

    def prefix_folder(key: str) -> list[str]:
        if args.turns == 1:
            return []
        # twice the documents' KV (23040 B per token: the default model in bfloat16) holds every document's blocks
        limit = 2 * n * (args.doc_tokens + 2 * args.answer_tokens + 64) * 23040
        folder = Path(folders.name) / key
        if args.warm_prefix is not None and not folder.exists():
            shutil.copytree(Path(args.warm_prefix) / key, folder, copy_function=os.link)
        return ["--prefix-cache-dir", str(folder), "--prefix-cache-dir-bytes", str(limit)]
    ours = [sys.executable, "-m", "infinigen.cli", "serve"]
    fetch = [f"block_fetch={args.block_fetch}"] if args.block_fetch is not None else []
    within = f", tokens within {args.block_fetch}x" if fetch else ""
    systems = {
        "full": (full_name, lambda port: ours + ["--policy", "full", *common, *full_layout, *prefix_folder("full"),
                                                 "--port", str(port)]),
        "infinigen": (f"InfiniGen (disk, blocks of {b}{within})", lambda port: ours + [
            "--policy", "infinigen", *[x for k in (*CALIBRATED, f"block={b}", *fetch) for x in ("--knob", k)], *common,
            "--disk-block", str(b), *prefix_folder("infinigen"), "--port", str(port)]),
    }
    binary = None if args.no_llama else llama_bin()
    if binary is not None:
        slot = sl.ctx_per_slot(args.doc_tokens + args.answer_tokens + 64)
        gguf = _module("peer_llamacpp").default_gguf()
        systems["llama"] = (f"llama-server ({n} slots of {slot})",
                            lambda port: sl.llama_server_command(binary, gguf, args.threads, n, slot, port))
        # llama.cpp at its best under a bound: its KV cache in 4 bits (flash attention, which that needs)
        systems["llama-q4kv"] = (f"llama-server ({n} slots of {slot}, KV in q4_0)",
                                 lambda port: [*sl.llama_server_command(binary, gguf, args.threads, n, slot, port),
                                               "-ctk", "q4_0", "-ctv", "q4_0", "-fa", "on"])
    build_native(sl.child_env(args.threads))
    rows = []
    for key in args.systems.split(","):
        if key not in systems:
            continue
        name, command = systems[key]
        port = sl.free_port()
        print(f"serve_disk: {name}", file=sys.stderr, flush=True)
        rows.append(run_system(name, command(port), port, chats, args, logs))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    d = {"args": {**vars(args)}, "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
         "command": "python benchmarks/serve_disk.py " + " ".join(argv if argv is not None else sys.argv[1:]),
         "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
         "load_before": load_before, "load_after": Path("/proc/loadavg").read_text().strip(),
         "run_s": round(time.perf_counter() - run_started, 1)}
    if args.keep_prefix is not None:
        for key in Path(folders.name).iterdir():
            shutil.copytree(key, Path(args.keep_prefix) / key.name, copy_function=os.link, dirs_exist_ok=True)
    folders.cleanup()
    out.with_suffix(".json").write_text(json.dumps(d, indent=1))
    out.with_suffix(".md").write_text(markdown(d))
    print(markdown(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
