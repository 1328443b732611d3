"""Memory on block-file pools does not grow with decoding steps nor with requests served one after another:
the fast buffers a block store holds stop growing once a step's reads stop growing (counted in bytes, not
time), and a finished request's store, its buffers and its pool file are released, so the server's anonymous
memory after many requests is that after the first. Mechanics on a tiny model."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import torch

from infinigen import runtime
from infinigen.memory import release_free_heap
from infinigen.placement import BlockedKVStore, Placement
from infinigen.policies import make_policy
from infinigen.serve.engine import Engine, Request
from support.serving import anon_bytes, random_prompts, run_until_idle

BLOCK = 16


def _model(make_tiny):
    return make_tiny("llama", num_hidden_layers=4, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                     num_key_value_heads=4, max_position_embeddings=4096)[1]  # head_dim 64: a block is 2 pages


def test_fast_buffers_stop_growing_with_steps(make_tiny, tmp_path):
    """A session reading a bounded window per step (sinks + recent tokens) decodes 360 steps on a block file:
    the store's fast bytes (metadata, open blocks, staging and gathered rows) after step 60 are those after step
    360, well under one layer's share of the pool, and the process's anonymous memory does not grow with the
    steps by more than a small part of what they wrote to the pool."""
    model = _model(make_tiny)
    pol = make_policy("streaming", sinks=4, window=48)
    pl = Placement(kv_offload="disk", disk_block=BLOCK, pool_dir=str(tmp_path))
    prompt = torch.tensor(random_prompts(model.cfg.vocab_size, (200,), seed=3))
    steps = 360
    sess = pl.new_session(model, 1, prompt.shape[1] + steps, pol)
    store = sess.store
    assert isinstance(store, BlockedKVStore)
    logits = runtime.prefill(model, prompt, sess)
    seen = {}
    for i in range(1, steps + 1):
        logits = runtime.decode(model, logits.argmax(-1), sess)
        if i in (60, steps):
            release_free_heap()
            seen[i] = (store.buffers.fast_bytes(), anon_bytes())
    layer_pool = store.bh * store.blocks_per_head * store.unit  # one layer's share of the pool file
    assert seen[60][0] == seen[steps][0] < layer_pool
    written = store.bh * store.num_layers * 2 * store.row_bytes * (steps - 60)  # keys and values, 300 steps
    assert seen[steps][1] - seen[60][1] < max(written, 2 << 20), (seen, written)
    pl.close(sess)
    assert os.listdir(tmp_path) == []


def serve_in_sequence(make_tiny, pool_dir) -> tuple[list[int], int, int]:
    """Eight requests served one after another on block pools, each checked released as it finishes (its store
    freed, its pool file closed, the engine's count of fast and slow bytes back to 0). Returns the anonymous
    memory after each request and one request's fast and slow cost."""
    model = _model(make_tiny)
    pol = make_policy("full")
    placement = Placement(kv_offload="disk", disk_block=BLOCK, pool_dir=str(pool_dir))
    # no prefix cache: it keeps prompts' blocks in RAM on purpose, up to its own limit
    eng = Engine(model, pol, placement, max_batch=2, prefix_cache=False)
    # one length: a new shape may grow the kernels' caches once, which is not a request's memory
    prompts = random_prompts(model.cfg.vocab_size, [600] * 8, seed=11)
    fast_each, slow_each = eng.request_cost(len(prompts[0]), 8)
    after, stores = [], []
    for p in prompts:
        req = eng.submit(Request(p, 8))
        while req.session is None and req.finish is None:
            eng.step()
        stores.append(weakref.ref(req.session.store))
        run_until_idle(eng)
        assert req.finish == "length" and req.session is None
        gc.collect()
        release_free_heap()
        after.append(anon_bytes())
        snap = eng.snapshot()
        assert snap["kv_fast_bytes"] == 0 and snap["kv_slow_bytes"] == 0
        assert os.listdir(pool_dir) == []
    assert all(ref() is None for ref in stores), "a finished request's store is still alive"
    return after, fast_each, slow_each


def test_requests_in_sequence_release_their_stores(make_tiny, tmp_path):
    """Each finished request's store (and so its buffers) is freed and its pool file closed."""
    serve_in_sequence(make_tiny, tmp_path)


def test_requests_in_sequence_release_their_memory(tmp_path):
    """The anonymous memory after the last of eight requests is within two requests' fast state of that after the
    third, where kept stores would add one request's fast state each (five more): measured in a fresh interpreter,
    where nothing the other tests left in this process (threads' heaps, compiled graphs) moves it. A one-time
    growth of 7 MB at the sixth request (then flat) was seen once in a fresh clone's suite on a loaded machine."""
    code = ("import json, sys; from pathlib import Path; from support.models import build_tiny; "
            "sys.path.insert(0, 'serve'); from test_serve_disk_pool_memory import serve_in_sequence; "
            "print(json.dumps(serve_in_sequence(build_tiny, Path(sys.argv[1]))))")
    tests = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tests, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    after, fast_each, slow_each = json.loads(run.stdout.strip().splitlines()[-1])
    assert after[-1] - after[2] < max(2 * fast_each, slow_each // 4), (after, fast_each, slow_each)


FRAGMENTS = """
import sys, torch
from infinigen.memory import map_large_allocations
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) * 1024
if sys.argv[1] == "map":
    assert map_large_allocations()
warm = torch.empty(4 << 20, dtype=torch.uint8); warm.fill_(1); del warm  # glibc raises its threshold here
start, big, small = anon(), [], []
for i in range(64):  # a prompt's per-layer tensors, with small ones left between them
    t = torch.empty(2 << 20, dtype=torch.uint8); t.fill_(1); big.append(t)
    s = torch.empty(1000, dtype=torch.uint8); s.fill_(1); small.append(s)
del big
print(anon() - start)
"""


def test_large_frees_go_back_to_the_os_under_a_memory_bound():
    """A server under a bound maps its large allocations: 128 MiB of 2 MiB tensors freed between small live ones
    leave the process at once (with glibc's default, its raised threshold carves them from the heap, and the
    pages stay until a trim): measured in fresh interpreters."""
    if not sys.platform.startswith("linux"):
        return
    kept = {}
    for mode in ("default", "map"):
        run = subprocess.run([sys.executable, "-c", FRAGMENTS, mode], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        kept[mode] = int(run.stdout.split()[-1])
    assert kept["default"] > 64 << 20, kept  # the premise: without it the pages stay
    assert kept["map"] < 16 << 20, kept


def test_serve_under_a_bound_maps_large_allocations(monkeypatch):
    from infinigen import memory
    from infinigen.commands import serve as serve_cmd
    from infinigen.serve.config import ServerConfig
    calls = []
    monkeypatch.setattr(memory, "map_large_allocations", lambda *a: calls.append(a) or True)
    note = serve_cmd._budget_under_bound(ServerConfig(memory_limit=64 << 30))
    assert note is not None and calls == [()]
