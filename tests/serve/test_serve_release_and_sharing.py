"""Serving tests that guard what test_serve.py's numbers cannot:

- a cancelled request's KV store is really gone: nothing holds its session or store (weak references die
  once collected) and, on disk, its pool files are removed when it leaves, while the request beside it
  keeps its own. (`kv_fast_bytes == 0` after the requests end holds by construction: only running
  requests are summed.)
- the default InfiniGen preset (4-bit speculation keys, one budget per layer, the 32-token floor) runs
  through the engine's batched decode and gives each request the tokens it gets alone;
- concurrent HTTP requests really share decoding steps (the engine's per-step batch sizes, exported in
  /metrics as a histogram).

Only the engine's public API is used (submit, step, cancel, snapshot, idle, batch_sizes, Request's fields),
as the HTTP layer uses it; the placement the engine is given records the sessions it opens.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import json
import os
import socket
import time
import weakref

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from support.speculation import random_skew  # noqa: E402  random orthogonal skew matrices for a tiny model

from infinigen.generate import Sampling, generate_ids  # noqa: E402
from infinigen.placement import Placement  # noqa: E402
from infinigen.policies import make_policy  # noqa: E402
from infinigen.serve.app import BackgroundServer, create_app  # noqa: E402
from infinigen.serve.engine import Engine, Request  # noqa: E402
from support.serving import random_prompts  # noqa: E402

NAME = "tiny"


@dataclasses.dataclass(frozen=True)
class Opened:
    """A session a placement opened: weak references (they die once nothing holds it) and the identities
    (device, inode) of its pool files (empty: not on disk). The files have no name in the pool folder, so
    they are found through this process's open descriptors and mappings."""
    session: weakref.ref
    store: weakref.ref
    capacity: int
    pool_files: frozenset

    def files_open(self) -> bool:
        """Whether any of its pool files is still open or mapped by this process."""
        return bool(self.pool_files & _live_files())


def _live_files() -> set:
    """(device, inode) of every file this process has open or mapped."""
    live = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        live.add((st.st_dev, st.st_ino))
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and parts[4] != "0":
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                live.add((os.makedev(major, minor), int(parts[4])))
    return live


@dataclasses.dataclass(frozen=True)
class RecordingPlacement(Placement):
    """A placement that remembers every session it opens, weakly: which are still alive, where their files are."""
    opened: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    def new_session(self, *args, **kwargs):
        sess = super().new_session(*args, **kwargs)
        tier = getattr(sess.store, "tier", None)
        files = frozenset((st.st_dev, st.st_ino) for st in tier.file_stats()) if tier is not None else frozenset()
        self.opened.append(Opened(weakref.ref(sess), weakref.ref(sess.store), sess.store.capacity, files))
        return sess

    def session_of(self, req: Request) -> Opened:
        """The session opened for `req` (its pool holds prompt + max_tokens slots, distinct per request here)."""
        mine = [o for o in self.opened if o.capacity == len(req.prompt) + req.max_tokens]
        assert len(mine) == 1, mine
        return mine[0]


def _wait(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(scope="module")
def checkpoint_model(tiny_checkpoint):
    from infinigen.loading import load
    model, tok, _ = load(str(tiny_checkpoint), progress=False)
    return model, tok


# ---- a cancelled request's store is released ---------------------------------------------------------------
@pytest.mark.parametrize("offload", ["none", "disk"])
def test_cancelled_request_releases_its_store(make_tiny, offload, tmp_path):
    """Two running requests; one is cancelled mid-generation: its pool files go as it leaves, its session
    and store are collected (nothing in the engine holds them), and the other request keeps its own and
    finishes; then nothing is left."""
    _, model = make_tiny("llama")
    pl = RecordingPlacement(kv_offload=offload, pool_dir=str(tmp_path))
    eng = Engine(model, make_policy("full"), pl, max_batch=4)
    gc.collect()
    assert all(o.store() is None for o in pl.opened)  # the engine's cost probes
    a_prompt, b_prompt = random_prompts(model.cfg.vocab_size, (9, 14))
    a = eng.submit(Request(a_prompt, 40))
    eng.step()
    eng.step()
    b = eng.submit(Request(b_prompt, 41))
    while not b.tokens:  # joining a running request, b is prefilled a chunk of layers per step
        eng.step()
    sa, sb = pl.session_of(a), pl.session_of(b)
    assert a.tokens and b.tokens and sa.store() is not None and sb.store() is not None  # both running
    if offload == "disk":
        assert sa.pool_files and sa.files_open() and sb.files_open()
    before = len(b.tokens)
    eng.cancel(a)
    eng.step()
    assert a.finish == "cancelled" and b.finish is None and len(b.tokens) == before + 1
    if offload == "disk":  # removed as the request leaves, not whenever the collector runs
        assert not sa.files_open() and sb.files_open()
    gc.collect()
    assert sa.session() is None and sa.store() is None, "the cancelled request's session is still referenced"
    assert sb.store() is not None
    while not eng.idle():
        eng.step()
    assert b.finish == "length" and len(b.tokens) == 41
    gc.collect()
    assert all(o.session() is None and o.store() is None and not o.files_open() for o in pl.opened)
    assert os.listdir(tmp_path) == []


def test_disconnected_client_releases_its_store(checkpoint_model, tmp_path):
    """Over HTTP, with the pool on disk: a client reads one chunk of a long stream and goes away; its request
    is cancelled, its pool files are gone and its session and store are collected."""
    model, tok = checkpoint_model
    pl = RecordingPlacement(kv_offload="disk", pool_dir=str(tmp_path))
    eng = Engine(model, make_policy("full"), pl)
    step = eng.step
    eng.step = lambda: (time.sleep(0.02), step())[1]  # a slower model: 100 tokens take two seconds
    body = {"model": NAME, "prompt": list(range(3, 20)), "max_tokens": 100, "temperature": 0, "stream": True}
    probes = len(pl.opened)
    with BackgroundServer(create_app(eng, tok, NAME)) as url:
        host, port = url[7:].split(":")
        sock = socket.create_connection((host, int(port)))
        data = json.dumps(body).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        got = b""
        while b"data: " not in got:
            got += sock.recv(4096)
        [opened] = pl.opened[probes:]
        assert opened.store() is not None and opened.pool_files and opened.files_open()
        sock.close()
        assert _wait(lambda: eng.snapshot().get("requests_cancelled", 0) == 1)
        assert not opened.files_open()
        gc.collect()
        assert opened.session() is None and opened.store() is None
        r = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 5}, timeout=60)
        assert r.status_code == 200
    gc.collect()
    assert all(o.store() is None and not o.files_open() for o in pl.opened) and os.listdir(tmp_path) == []


# ---- the default InfiniGen preset through the batched decode ------------------------------------------------
def _alone(model, policy, prompt, n, eos=frozenset()):
    g = generate_ids(model, [prompt], n, Sampling(), policy, eos)
    return g.tokens[0], g.stats.overall()


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["invariant", "padded"])
def test_default_infinigen_batched_equals_alone(make_tiny, batch_invariant):
    """`make_policy("infinigen")` (the default preset: layers 0 and 1 dense, 4-bit speculation keys, one
    budget per layer, at least 32 tokens per KV head) with random orthogonal skew matrices on a 4-layer
    model: requests of different lengths join and leave a running batch; each gets exactly its tokens
    alone, the longer ones reading a real subset of their KV, and requests shared decoding steps."""
    _, model = make_tiny("llama", num_hidden_layers=4)
    policy = make_policy("infinigen").with_skew(random_skew(model))
    assert policy.preset == "default" and policy.key_mode == "int4" and policy.budget == "layer"
    lengths, maxt = (40, 120, 70, 33, 95, 150), (12, 7, 16, 9, 11, 8)
    prompts = random_prompts(model.cfg.vocab_size, lengths, seed=8)
    alone = [_alone(model, policy, p, n) for p, n in zip(prompts, maxt)]
    assert sum(kv < 0.75 for _, kv in alone) >= 3  # the longer prompts read a subset in layers 2 and 3
    eng = Engine(model, policy, max_batch=4, batch_invariant=batch_invariant)
    reqs = []
    for i, (p, n) in enumerate(zip(prompts, maxt)):
        reqs.append(eng.submit(Request(p, n)))
        for _ in range(i % 3):  # arrivals 0, 1 or 2 steps apart
            eng.step()
    while not eng.idle():
        eng.step()
    for r, (ref, _), p in zip(reqs, alone, prompts):
        assert r.finish == "length" and r.tokens == ref, len(p)
    sizes = eng.batch_sizes
    assert max(sizes) == 4 and sum(c for n, c in sizes.items() if n > 1) > 0
    # every token after a request's first (which its prefill gives) came from a decoding step
    assert sum(n * c for n, c in sizes.items()) == sum(len(r.tokens) - 1 for r in reqs)


# ---- concurrent HTTP requests share decoding steps ---------------------------------------------------------
def _batch_histogram(metrics_text: str) -> tuple[dict, float, float]:
    """The decode batch-size histogram of /metrics: ({upper bound: steps}, step count, sum of sizes)."""
    from prometheus_client.parser import text_string_to_metric_families
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name == "infinigen_decode_batch_size":
            buckets = {float(s.labels["le"]): s.value for s in fam.samples if s.name.endswith("_bucket")}
            count = next(s.value for s in fam.samples if s.name.endswith("_count"))
            total = next(s.value for s in fam.samples if s.name.endswith("_sum"))
            return buckets, count, total
    raise AssertionError("no infinigen_decode_batch_size in /metrics")


def test_http_concurrent_requests_share_decode_steps(checkpoint_model):
    """Five clients at once (completions, streamed and not) with InfiniGen's default preset (layer 1 selects:
    the checkpoint has two layers): the engine starts once all five wait, so they are prefilled together
    and decoded in shared steps, which /metrics shows; each answer is the request's text alone."""
    model, tok = checkpoint_model
    eos = {tok.eos_token_id}
    policy = make_policy("infinigen", dense_layers=(0,)).with_skew(random_skew(model))
    prompts = random_prompts(model.cfg.vocab_size, (20, 45, 70, 90, 38), seed=7)
    maxt = [14, 9, 20, 12, 6]
    eng = Engine(model, policy, eos=eos, max_batch=8)
    step, gate = eng.step, [True]

    def gated_step():  # the first step waits for every client: they must overlap, whatever the timing
        if gate[0]:
            assert _wait(lambda: eng.snapshot()["waiting"] == len(prompts))
            gate[0] = False
        return step()
    eng.step = gated_step

    def one(i):
        body = {"model": NAME, "prompt": prompts[i], "max_tokens": maxt[i], "temperature": 0}
        if i % 2:
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                assert r.status_code == 200
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with BackgroundServer(create_app(eng, tok, NAME)) as url:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(one, range(len(prompts))))
        buckets, steps, decoded = _batch_histogram(httpx.get(f"{url}/metrics", timeout=30).text)
        snap = eng.snapshot()
    refs = [_alone(model, policy, p, n, eos)[0] for p, n in zip(prompts, maxt)]
    for i, (text, ref) in enumerate(zip(got, refs)):
        assert text == tok.decode(ref, skip_special_tokens=True), i
    assert steps > 0 and steps - buckets[1.0] > 0, buckets  # steps that decoded two requests or more
    assert buckets[4.0] < steps  # ... and all five at once: the first step
    assert buckets[float("inf")] == steps
    assert decoded == sum(len(r) - 1 for r in refs) == snap["completion_tokens"] - len(prompts)
