"""A server whose conversations live on disk: each request's pool is a file of page-aligned blocks
(`Placement.disk_block`, `serve --kv-offload disk --disk-block N`).

- each request gets exactly its tokens alone, and its pool file is closed (so its blocks are freed: the
  file has no name) as it finishes or is cancelled, while the requests beside it keep theirs;
- admission charges the fast budget only with what a request keeps in RAM: requests whose pools together
  exceed the fast budget run at once, and the process's anonymous memory does not grow with their pools;
- faults of the pool folder (read-only, full, removed mid-run) end the request they hit with a 5xx error body
  naming the folder, the server serves the next request, and nothing is left behind;
- a memory bound too small for the server, the weights and one request is refused before loading (exit 2).
Mechanics on tiny models, no timing.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import uuid

import pytest
import torch

from infinigen.generate import Sampling, generate_ids
from infinigen.placement import BlockedKVStore, Placement
from infinigen.policies import make_policy
from infinigen.serve.engine import Engine, Request
from support.serving import anon_bytes, random_prompts, run_until_idle

BLOCK = 16


def _open_files() -> set:
    """(device, inode) of every file this process has open."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        out.add((st.st_dev, st.st_ino))
    return out


def _pool_files(req: Request) -> frozenset:
    """(device, inode) of the pool files of a running request."""
    return frozenset((st.st_dev, st.st_ino) for st in req.session.store.tier.file_stats())


# ---- the engine's thread ----------------------------------------------------------------------------------------
def test_the_engine_computes_on_the_threads_of_its_maker_beside_fetch_workers(make_tiny, tmp_path):
    """Each request's store on disk has a fetch worker whose torch ops run on one thread; `torch.set_num_threads`
    there also sets the count a thread takes at its first parallel op in torch or in one of our kernels, so
    unless the store sets it back (`transfer.fetch_worker`) the engine's thread computes on one thread once a
    worker has started (the engine's cost probes, each request). It computes on as many as its maker's."""
    _, model = make_tiny("llama", num_hidden_layers=2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        placement = Placement(kv_offload="disk", disk_block=BLOCK, pool_dir=str(tmp_path))
        eng = Engine(model, make_policy("full"), placement)
        seen, done = [], threading.Event()

        def sink(kind, value):  # the engine's thread, after each token
            seen.append(torch.get_num_threads())
            if kind in ("done", "error"):
                done.set()
        eng.start()
        try:
            for prompt in random_prompts(model.cfg.vocab_size, (20, 33), seed=1):
                done.clear()
                eng.submit(Request(prompt, 4, sink=sink))
                assert done.wait(900)  # a generous bound: a busy machine only slows it
        finally:
            eng.stop()
        assert torch.get_num_threads() == 2 and len(seen) == 10 and set(seen) == {2}, seen
    finally:
        torch.set_num_threads(before)


# ---- requests on block files: their tokens, their files ------------------------------------------------------
@pytest.mark.parametrize("policy", ["full", "streaming"])
def test_block_pool_requests_equal_alone_and_close_their_files(make_tiny, policy, tmp_path):
    """Requests of different lengths join and leave on block-file pools; one is cancelled mid-run. Each
    finished request's tokens are those of the same request alone on the same placement; the cancelled
    one's file is closed as it leaves while the others' stay open; at the end no pool file is open and the
    folder is empty."""
    _, model = make_tiny("llama", num_hidden_layers=3)
    pol = make_policy(policy) if policy == "full" else make_policy(policy, sinks=4, window=20)
    placement = Placement(kv_offload="disk", disk_block=BLOCK, pool_dir=str(tmp_path))
    eng = Engine(model, pol, placement, max_batch=4)
    lengths, maxt = (40, 75, 23, 60), (12, 30, 9, 14)
    prompts = random_prompts(model.cfg.vocab_size, lengths, seed=3)
    reqs = [eng.submit(Request(p, n)) for p, n in zip(prompts, maxt)]
    while not all(r.tokens for r in reqs):
        eng.step()
    assert all(isinstance(r.session.store, BlockedKVStore) for r in reqs)
    files = [_pool_files(r) for r in reqs]
    assert all(f and f <= _open_files() for f in files)
    victim = reqs[1]
    eng.cancel(victim)
    eng.step()
    assert victim.finish == "cancelled" and victim.session is None
    still = _open_files()
    assert not files[1] & still, "the cancelled request's pool file is still open"
    assert all(f <= still for f, r in zip(files, reqs) if r.finish is None)
    run_until_idle(eng)
    assert not any(f & _open_files() for f in files)
    assert os.listdir(tmp_path) == [] and eng.snapshot()["kv_slow_bytes"] == 0
    for r, p, n in zip(reqs, prompts, maxt):
        if r is victim:
            continue
        alone = generate_ids(model, [p], n, Sampling(), pol, placement=placement).tokens[0]
        assert r.finish == "length" and r.tokens == alone, len(p)


# ---- admission by what stays in RAM; RSS flat under the pools -------------------------------------------------
def test_pools_beyond_the_fast_budget_run_together_and_rss_stays_flat(make_tiny, tmp_path):
    """Four long requests whose pools (on disk, in blocks of exactly two pages: no padding) total many times
    the fast budget run in the same decoding steps: admission charged the fast budget only with what each
    keeps in RAM (metadata, the blocks being filled, the rows a step reads). The process's live anonymous
    memory (after each step, freed heap handed back as the engine's loop does) grows by a small part of the
    pools' total while they run, and so does the engine's own count of the fast bytes."""
    from infinigen.memory import release_free_heap
    _, model = make_tiny("llama", num_hidden_layers=8, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=4, max_position_embeddings=4096)  # head_dim 64: a block is 2 pages
    pol = make_policy("streaming", sinks=4, window=32)
    placement = Placement(kv_offload="disk", disk_block=BLOCK, pool_dir=str(tmp_path))
    lengths, maxt = (1900, 2000, 2100, 1950), 6
    probe = Engine(model, pol, placement)
    fast_each, slow_each = zip(*(probe.request_cost(n, maxt) for n in lengths))
    budget = sum(fast_each) + (1 << 20)
    assert sum(slow_each) > 8 * budget  # the pools could never run together if they were charged as RAM
    eng = Engine(model, pol, placement, max_batch=4, fast_bytes=budget)
    warm = eng.submit(Request(random_prompts(model.cfg.vocab_size, (64,), seed=3)[0], 2))
    run_until_idle(eng)
    assert warm.finish == "length"
    release_free_heap()
    base = peak = anon_bytes()
    reqs = [eng.submit(Request(p, maxt)) for p in random_prompts(model.cfg.vocab_size, lengths, seed=9)]
    pools = fast = 0
    while not eng.idle():
        eng.step()
        release_free_heap()
        peak = max(peak, anon_bytes())
        snap = eng.snapshot()
        pools, fast = max(pools, snap["kv_slow_bytes"]), max(fast, snap["kv_fast_bytes"])
    assert all(r.finish == "length" for r in reqs)
    assert eng.batch_sizes[4] >= maxt - 2  # all four decoded together
    assert pools >= 100 << 20 and pools >= sum(slow_each) * 0.9
    assert fast < pools / 16, (fast, pools)
    assert peak - base < pools / 4, (peak - base, pools)
    assert os.listdir(tmp_path) == []


# ---- faults of the pool folder --------------------------------------------------------------------------------
@contextlib.contextmanager
def _tmpfs(path, size: str):
    """A tmpfs of `size` mounted at `path` (root only; skipped where it cannot be mounted)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", f"infinigen-test-{uuid.uuid4().hex[:8]}",
                           str(path)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _remount(path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


def _post(url, body):
    import httpx
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


@pytest.fixture
def served_tiny(tiny_checkpoint):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from infinigen.loading import load
    model, tok, _ = load(str(tiny_checkpoint), progress=False)
    return model, tok


def test_read_only_pool_folder_fails_the_request_not_the_server(served_tiny, tmp_path):
    """The pool folder turns read-only under a running server: a request gets a 500 error body naming the
    folder; once it is writable again the next request is served; nothing is left in it."""
    from infinigen.serve.app import BackgroundServer, create_app
    model, tok = served_tiny
    with _tmpfs(tmp_path / "pool", "16m") as pool:
        eng = Engine(model, make_policy("full"), Placement(kv_offload="disk", disk_block=BLOCK, pool_dir=str(pool)))
        body = {"model": "tiny", "prompt": list(range(3, 30)), "max_tokens": 5, "temperature": 0}
        with BackgroundServer(create_app(eng, tok, "tiny")) as url:
            _remount(pool, "ro")
            try:
                r = _post(url, body)
            finally:
                _remount(pool, "rw")
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["type"] == "server_error" and str(pool) in err["message"] and "\n" not in err["message"]
            again = _post(url, body)
            assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 5
        eng.stop()
        assert os.listdir(pool) == []


def test_full_disk_fails_the_request_that_does_not_fit(make_tiny, tmp_path):
    """The pool folder's disk (a 4 MiB tmpfs) fills up under a running server: a request whose block file can no
    longer be reserved fails with an error naming the folder, the small request beside it gets its tokens
    alone, and no pool file is left."""
    _, model = make_tiny("llama", num_hidden_layers=2, max_position_embeddings=4096)
    pol = make_policy("full")
    with _tmpfs(tmp_path / "pool", "4m") as pool:
        placement = Placement(kv_offload="disk", disk_block=BLOCK, pool_dir=str(pool))
        eng = Engine(model, pol, placement, max_batch=4)  # the slow budget: half the free space, 2 MiB
        small, big = random_prompts(model.cfg.vocab_size, (30, 1500), seed=3)
        assert eng.request_cost(len(big), 8)[1] > 1 << 20
        filler = pool / "filler"
        filler.write_bytes(b"x" * (3 << 20))  # someone else fills the disk: under 1 MiB stays free
        a = eng.submit(Request(small, 8))
        errors = []
        b = eng.submit(Request(big, 8, sink=lambda kind, value: errors.append(value) if kind == "error" else None))
        run_until_idle(eng)
        assert b.finish == "error" and len(errors) == 1
        assert str(pool) in errors[0] and "cannot reserve" in errors[0]
        assert a.finish == "length"
        assert a.tokens == generate_ids(model, [small], 8, Sampling(), pol, placement=placement).tokens[0]
        assert os.listdir(pool) == ["filler"]
        filler.unlink()
        assert shutil.disk_usage(pool).used == 0


def test_pool_folder_removed_mid_run(make_tiny, tmp_path):
    """The pool folder is removed while a request decodes: the running request keeps its file (it has no name
    there) and finishes with its tokens alone; the next request is served (the folder is made again); nothing
    is left behind."""
    _, model = make_tiny("llama", num_hidden_layers=2)
    pol = make_policy("full")
    pool = tmp_path / "pool"
    placement = Placement(kv_offload="disk", disk_block=BLOCK, pool_dir=str(pool))
    eng = Engine(model, pol, placement)
    first, second = random_prompts(model.cfg.vocab_size, (50, 35), seed=3)
    a = eng.submit(Request(first, 20))
    while len(a.tokens) < 5:
        eng.step()
    files = _pool_files(a)
    shutil.rmtree(pool)
    run_until_idle(eng)
    assert a.finish == "length" and not files & _open_files()
    b = eng.submit(Request(second, 6))
    run_until_idle(eng)
    assert b.finish == "length" and os.listdir(pool) == []
    for req, prompt in ((a, first), (b, second)):
        alone = generate_ids(model, [prompt], len(req.tokens), Sampling(), pol, placement=placement).tokens[0]
        assert req.tokens == alone


# ---- a memory bound too small -----------------------------------------------------------------------------------
def test_memory_bound_below_the_weights_is_refused_before_loading(cli, default_model):
    """`serve --memory-limit` below what the server, the weights and one request need: one line saying how
    much is needed, exit 2, before the model is loaded (no 'loading' line) and before any cgroup is made."""
    code, out, err = cli("serve", "--memory-limit", "64M", "--kv-offload", "disk", "--disk-block", "16",
                         "--port", "0")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "--memory-limit of 64 MiB cannot hold the server: it needs at least" in lines[0]
    assert "model's weights" in lines[0] and "loading" not in err


def test_read_only_pool_folder_is_refused_before_loading(cli, tmp_path):
    """`serve --kv-offload disk --pool-dir` on a read-only file system: one line naming the folder, exit 2,
    before the model is loaded."""
    with _tmpfs(tmp_path / "pool", "1m") as pool:
        _remount(pool, "ro")
        try:
            code, out, err = cli("serve", "--kv-offload", "disk", "--disk-block", "16", "--pool-dir", str(pool),
                                 "--port", "0")
        finally:
            _remount(pool, "rw")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and str(pool) in lines[0] and "loading" not in err, err


def test_memory_limit_reruns_the_server_inside_a_bound_and_sigterm_stops_it(default_model, tmp_path):
    """`serve --memory-limit`: the server runs in a child inside a memory cgroup, sets its fast budget from the
    bound (said on its serving line), answers a request from a block-file pool; SIGTERM to the command reaches
    the child, which drains and exits 0, and the group and the pool folder are left empty."""
    import signal
    import sys
    import time

    import httpx
    pool = tmp_path / "pool"
    argv = [sys.executable, "-m", "infinigen.cli", "serve", "--memory-limit", "1.5G", "--kv-offload", "disk",
            "--disk-block", "16", "--pool-dir", str(pool), "--port", "0"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "infinigen: serving" in line:
                break
        text = "".join(lines)
        if proc.poll() == 2 and "cannot bound memory" in text:
            pytest.skip(text.strip().splitlines()[-1])
        assert "infinigen: running under" in text and "under --memory-limit of 1.50 GiB" in lines[-1], text
        url = lines[-1].split(" on ", 1)[1].split("/v1", 1)[0]
        group = text.split("infinigen: running under", 1)[1].split("(", 1)[1].split(")", 1)[0]
        r = httpx.post(f"{url}/v1/completions", json={"model": lines[-1].split()[2], "prompt": "Once upon a time",
                                                      "max_tokens": 4, "temperature": 0}, timeout=300)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not os.path.exists(group), "the memory cgroup was left behind"
    assert os.listdir(pool) == []
