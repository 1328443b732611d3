"""Soak test of `infinigen serve` as a user runs it: one server process, mixed clients for a while.

    python benchmarks/serve_soak.py                      # 30 minutes, InfiniGen, KV in RAM
    python benchmarks/serve_soak.py --minutes 2          # a short try
    python benchmarks/serve_soak.py --kv-offload disk    # the KV pool on disk

The server is started the way a user starts it (`infinigen serve --port P --policy ...`, its own process,
127.0.0.1). `--clients` threads send, back to back, a random mix of:
  - streamed and non-streamed completions and chat completions (greedy, some with logprobs or echo),
  - clients that go away: a stream closed after a few chunks, a non-streamed request whose client times out,
  - malformed bodies (bad JSON, wrong types, unknown fields, n=2, an empty prompt): each must get a 4xx with
    OpenAI's error body.
Every `--sample-s` seconds the server's RSS (/proc/PID/status) and its /metrics KV bytes are sampled.

Pass conditions, checked at the end and written to results/serve_soak/serve_soak.md (+ .json):
  - no answer that is not the client's fault: no 5xx, no dropped connection on a well-formed request, no
    malformed body answered 2xx, every 4xx body is OpenAI's error object;
  - RSS flat after warm-up: the last quarter's median RSS within `--rss-slack-mib` of the median of the
    samples just after warm-up (the first `--warmup-s` seconds are excluded);
  - once the clients stop and the server is idle, KV bytes held and reserved are zero and no request runs.
Exit status 1 when a condition fails, so it can gate a release.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the letter was read again by candlelight and every line of it seemed to say more than its writer "
         "meant the morning brought rain and a visit that nobody expected").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample of Prometheus text, e.g. metric(t, "infinigen_kv_bytes", 'tier="fast"')."""
    pat = r"^" + re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else r"(?:\{\})?") + r"\s+(\S+)"
    m = re.search(pat, text, re.M)
    return float(m.group(1)) if m else float("nan")


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Tally:
    """What happened, by kind; `faults` are answers that are not the client's fault."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.faults: list[str] = []

    def add(self, kind: str, fault: str | None = None) -> None:
        with self.lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            if fault is not None and len(self.faults) < 200:
                self.faults.append(f"{kind}: {fault}")


def is_openai_error(resp: httpx.Response) -> bool:
    try:
        body = resp.json()
    except ValueError:
        return False
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err


MALFORMED = [  # each gets the served model's name added (a missing "model" would be the only fault otherwise)
    ("/v1/completions", b"{not json"),
    ("/v1/completions", {"prompt": 5, "max_tokens": 4}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "n": 2}),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": "hot"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}],
     "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": "hello", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
     "tools": [{"type": "function", "function": {"name": "f"}}]}),
]


def one_request(client: httpx.Client, rng: random.Random, tally: Tally, model: str, max_tokens: int,
                max_words: int) -> None:
    kind = rng.choices(["complete", "stream", "chat", "chat_stream", "logprobs", "echo", "gone_stream",
                        "gone_wait", "malformed"], weights=[3, 3, 2, 2, 1, 1, 1, 1, 2])[0]
    n = rng.randint(4, max_tokens)
    text = prompt(rng, rng.randint(8, max_words))
    if kind == "malformed":
        path, body = rng.choice(MALFORMED)
        body = body if isinstance(body, bytes) else json.dumps({"model": model, **body}).encode()
        try:
            r = client.post(path, content=body, headers={"content-type": "application/json"}, timeout=60)
        except httpx.HTTPError as e:
            return tally.add(kind, f"{type(e).__name__} on a malformed body")
        if not 400 <= r.status_code < 500:
            return tally.add(kind, f"HTTP {r.status_code} for {body[:60]!r}")
        return tally.add(kind, None if is_openai_error(r) else f"4xx without OpenAI's error body: {r.text[:80]!r}")
    chat = kind.startswith("chat")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    req: dict = {"model": model, "max_tokens": n, "temperature": 0}
    if chat:
        req["messages"] = [{"role": "user", "content": text}]
    else:
        req["prompt"] = text
    if kind == "logprobs":
        req["logprobs"] = 2
    if kind == "echo":
        req.update(echo=True, max_tokens=min(n, 4))
    streamed = kind in ("stream", "chat_stream", "gone_stream")
    try:
        if kind == "gone_wait":  # the client gives up long before the answer: the server must cancel it
            try:
                client.post(path, json={**req, "max_tokens": max_tokens * 4, "stop": ["qqqq"]}, timeout=0.5)
            except httpx.TimeoutException:
                pass
            return tally.add(kind)
        if streamed:
            req["stream"] = True
            with client.stream("POST", path, json=req, timeout=300) as r:
                if r.status_code != 200:
                    return tally.add(kind, f"HTTP {r.status_code}")
                chunks = 0
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if '"error"' in line:
                            return tally.add(kind, f"error event: {line[:100]}")
                        chunks += 1
                        if kind == "gone_stream" and chunks >= 2:
                            return tally.add(kind)  # leaving the `with` closes the connection mid-stream
            return tally.add(kind, None if chunks else "a stream with no chunk")
        r = client.post(path, json=req, timeout=300)
        if r.status_code == 429:  # the queue is full: the client's load, answered as the API says
            return tally.add("rejected_429")
        if r.status_code != 200:
            return tally.add(kind, f"HTTP {r.status_code}: {r.text[:100]!r}")
        choice = r.json()["choices"][0]
        if kind == "logprobs" and not (choice.get("logprobs") or {}).get("tokens"):
            return tally.add(kind, "logprobs asked for, none returned")
        tally.add(kind)
    except httpx.HTTPError as e:
        tally.add(kind, f"{type(e).__name__}: {e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--policy", default="infinigen")
    ap.add_argument("--kv-offload", default="none", choices=["none", "disk"])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24, help="the largest max_tokens a client asks for")
    ap.add_argument("--max-words", type=int, default=300, help="the longest prompt, in words")
    ap.add_argument("--warmup-s", type=float, default=120.0)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--rss-slack-mib", type=float, default=64.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "results" / "serve_soak"),
                    help="folder for serve_soak.md and serve_soak.json")
    a = ap.parse_args(argv)
    if a.minutes <= 0 or a.clients < 1 or a.max_tokens < 4 or a.max_words < 8:
        ap.error("--minutes must be > 0, --clients >= 1, --max-tokens >= 4, --max-words >= 8")
    warmup = min(a.warmup_s, a.minutes * 60 / 4)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    port = free_port()
    cmd = [sys.executable, "-m", "infinigen.cli", "serve", "--port", str(port), "--policy", a.policy,
           "--kv-offload", a.kv_offload]  # the server's own thread count: what a user gets
    log = open(out / "serve_soak.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    samples: list[tuple[float, float, float]] = []  # (seconds since start, RSS MiB, KV fast bytes)
    tally = Tally()
    try:
        deadline = time.monotonic() + 600
        while True:  # the model loads first
            if server.poll() is not None:
                print(f"the server exited with {server.returncode}; see {out / 'serve_soak.log'}", file=sys.stderr)
                return 1
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not come up in 10 minutes")
            time.sleep(1)
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        start = time.monotonic()
        stop_at = start + a.minutes * 60
        stop = threading.Event()

        def client_loop(i: int) -> None:
            rng = random.Random(a.seed * 1000 + i)
            with httpx.Client(base_url=base) as client:
                while not stop.is_set() and time.monotonic() < stop_at:
                    one_request(client, rng, tally, model, a.max_tokens, a.max_words)

        threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(a.clients)]
        for t in threads:
            t.start()
        while time.monotonic() < stop_at and server.poll() is None:
            time.sleep(min(a.sample_s, max(0.0, stop_at - time.monotonic())))
            try:
                kv = metric(httpx.get(base + "/metrics", timeout=30).text, "infinigen_kv_bytes", 'tier="fast"')
            except httpx.HTTPError:
                kv = float("nan")
            samples.append((time.monotonic() - start, rss_mib(server.pid), kv))
            print(f"{samples[-1][0]:7.0f} s  RSS {samples[-1][1]:7.1f} MiB  KV {kv / 2**20:7.1f} MiB  "
                  f"{sum(tally.counts.values())} requests, {len(tally.faults)} faults", flush=True)
        stop.set()
        for t in threads:
            t.join(timeout=400)
        # idle: the cancelled and finished requests must have let go of everything
        idle_deadline = time.monotonic() + 120
        while True:
            m = httpx.get(base + "/metrics", timeout=30).text
            held = {k: metric(m, k, 'tier="fast"') + metric(m, k, 'tier="slow"')
                    for k in ("infinigen_kv_bytes", "infinigen_kv_reserved_bytes")}
            running = metric(m, "infinigen_requests_running") + metric(m, "infinigen_requests_waiting")
            if (running == 0 and not any(held.values())) or time.monotonic() > idle_deadline:
                break
            time.sleep(1)
        outcomes = {o: metric(m, "infinigen_requests_total", f'outcome="{o}"')
                    for o in ("stop", "length", "cancelled", "error", "rejected")}
        alive = server.poll() is None
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                server.kill()
        log.close()

    after = [s for s in samples if s[0] >= warmup]
    early = [s[1] for s in after[:max(1, len(after) // 4)]]
    late = [s[1] for s in after[-max(1, len(after) // 4):]]
    rss_growth = statistics.median(late) - statistics.median(early) if after else float("nan")
    checks = {
        "no fault that is not the client's": not tally.faults,
        "server alive to the end": alive,
        f"RSS flat after warm-up (growth <= {a.rss_slack_mib:g} MiB)": rss_growth <= a.rss_slack_mib,
        "KV bytes and reservations zero when idle": running == 0 and not any(held.values()),
        "server exit 0 on SIGTERM": server.returncode == 0,
    }
    report = {"command": " ".join(cmd[2:]), "minutes": a.minutes, "clients": a.clients, "requests": tally.counts,
              "faults": tally.faults, "server_outcomes": outcomes, "samples": samples,
              "rss_growth_mib": rss_growth, "held_when_idle": held, "checks": checks,
              "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
              "date": time.strftime("%Y-%m-%d %H:%M")}
    (out / "serve_soak.json").write_text(json.dumps(report, indent=1))
    lines = [f"# Soak: `infinigen {report['command']}`, {a.minutes:g} minutes, {a.clients} clients",
             "", f"{report['date']}, {platform.platform()}, {os.cpu_count()} cores. "
             "Written by `python benchmarks/serve_soak.py` (its docstring says what each client does).", "",
             "| check | result |", "|---|---|"]
    lines += [f"| {k} | {'pass' if v else 'FAIL'} |" for k, v in checks.items()]
    lines += ["", "| client request kind | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(tally.counts.items())]
    lines += ["", "Server's own count (/metrics `infinigen_requests_total`): "
              + ", ".join(f"{k} {v:g}" for k, v in outcomes.items()) + ".", "",
              f"RSS after warm-up ({warmup:g} s): first quarter median {statistics.median(early):.1f} MiB, "
              f"last quarter {statistics.median(late):.1f} MiB (growth {rss_growth:+.1f} MiB); "
              f"{len(samples)} samples every {a.sample_s:g} s." if after else "RSS: no sample after warm-up."]
    if tally.faults:
        lines += ["", "Faults (first ones):", ""] + [f"- {f}" for f in tally.faults[:20]]
    (out / "serve_soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
