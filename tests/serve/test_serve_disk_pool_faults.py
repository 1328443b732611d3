"""A failing pool file fails only its request: requests decoded together on block-file pools
(`serve --kv-offload disk --disk-block N`), one request's file turns unreadable or unwritable mid-run (its
descriptor replaced by one the kernel refuses the read or the write on). That request ends with one error line
naming the pool folder; the others, in the same decoding steps, go on and get exactly their tokens alone (each
request attending alone, `batch_invariant`, or all decoded together in one attention call: the failing one is
dropped from it); the next request is served and nothing is left in the folder. Mechanics on a tiny model, no timing."""
from __future__ import annotations

import os

import pytest

from infinigen.generate import Sampling, generate_ids
from infinigen.placement import Placement
from infinigen.policies import make_policy
from infinigen.serve.engine import Engine, Request
from support.serving import random_prompts, run_until_idle

BLOCK = 16


def _open_file(fd: int):
    """(device, inode) of an open descriptor's file (None once it is closed)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _break_file(req: Request, kind: str, elsewhere) -> None:
    """Make the request's pool file refuse reads ("read") or writes ("write") from now on: its descriptor now
    opens a copy of it that the kernel lets this process only write, or only read."""
    store = req.session.store
    other = elsewhere / f"not-the-pool-{kind}"
    other.write_bytes(os.pread(store.fd, os.fstat(store.fd).st_size, 0))
    fd = os.open(other, os.O_WRONLY if kind == "read" else os.O_RDONLY)
    try:
        os.dup2(fd, store.fd)
    finally:
        os.close(fd)
        other.unlink()


@pytest.mark.parametrize("invariant", [True, False], ids=["batch-invariant", "decoded-together"])
@pytest.mark.parametrize("kind,policy", [("read", "full"), ("write", "streaming")])
def test_a_failing_pool_file_fails_only_its_request(make_tiny, tmp_path, kind, policy, invariant):
    _, model = make_tiny("llama", num_hidden_layers=3)
    pol = make_policy(policy) if policy == "full" else make_policy(policy, sinks=4, window=20)
    pool = tmp_path / "pool"
    placement = Placement(kv_offload="disk", disk_block=BLOCK, pool_dir=str(pool))
    eng = Engine(model, pol, placement, max_batch=4, batch_invariant=invariant)
    lengths, maxt = (40, 57, 33), (30, 30, 30)
    prompts = random_prompts(model.cfg.vocab_size, lengths)
    errors: list[str] = []
    reqs = [eng.submit(Request(p, n, sink=lambda k, v: errors.append(v) if k == "error" else None))
            for p, n in zip(prompts, maxt)]
    while not all(len(r.tokens) >= 3 for r in reqs):
        eng.step()
    victim = reqs[1]
    _break_file(victim, kind, tmp_path)
    broken = _open_file(victim.session.store.fd)
    together = eng.batch_sizes[3]
    run_until_idle(eng)
    assert victim.finish == "error" and len(errors) == 1, errors
    assert broken not in {_open_file(int(fd)) for fd in os.listdir("/proc/self/fd")}, "its file is still open"
    assert errors[0].startswith("decode failed: cannot " + kind) and str(pool) in errors[0] and "\n" not in errors[0]
    assert len(victim.tokens) < maxt[1]
    assert eng.batch_sizes[2] > 0 and eng.batch_sizes[3] > together  # the fault came in a step of all three
    for r, p, n in zip(reqs, prompts, maxt):
        if r is not victim:
            alone = generate_ids(model, [p], n, Sampling(), pol, placement=placement).tokens[0]
            assert r.finish == "length" and r.tokens == alone, len(p)
    after = eng.submit(Request(prompts[1], 8))
    run_until_idle(eng)
    m = min(8, len(victim.tokens))
    assert after.finish == "length" and after.tokens[:m] == victim.tokens[:m]
    assert os.listdir(pool) == [] and eng.snapshot()["kv_slow_bytes"] == 0


def test_over_http_the_failing_request_gets_a_500_and_the_other_its_answer(tiny_checkpoint, tmp_path):
    """Two completions decode together on block pools; one's file turns unreadable once both have tokens (from
    the engine's thread, between two steps): it gets a 500 whose OpenAI error body names the folder, the other
    a 200 with the answer it gets alone, and the server serves on."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    import threading

    from infinigen.loading import load
    from infinigen.serve.app import BackgroundServer, create_app
    model, tok, _ = load(str(tiny_checkpoint), progress=False)
    pool = tmp_path / "pool"
    eng = Engine(model, make_policy("full"), Placement(kv_offload="disk", disk_block=BLOCK, pool_dir=str(pool)))
    victim_prompt, other_prompt = list(range(3, 30)), list(range(40, 61))
    take, broken = eng._take, []

    def take_then_break(reqs, logits):
        take(reqs, logits)
        both = len(eng.running) == 2 and all(len(r.tokens) >= 2 for r in eng.running)
        victim = next((r for r in eng.running if r.prompt == victim_prompt), None)
        if both and victim is not None and not broken:
            _break_file(victim, "read", tmp_path)
            broken.append(victim)

    step, gate = eng.step, threading.Event()

    def both_queued_first():  # the engine starts once both requests wait: they are admitted in one step
        if not gate.is_set() and len(eng.waiting) < 2:
            return False
        gate.set()
        return step()

    eng._take, eng.step = take_then_break, both_queued_first
    bodies = [{"model": "tiny", "prompt": p, "max_tokens": 60, "temperature": 0} for p in (victim_prompt, other_prompt)]
    with BackgroundServer(create_app(eng, tok, "tiny")) as url:
        answers = [None, None]

        def post(i):
            answers[i] = httpx.post(f"{url}/v1/completions", json=bodies[i], timeout=120)

        threads = [threading.Thread(target=post, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert broken, "the two requests never decoded together"
        failed, served = answers
        assert failed.status_code == 500, failed.text
        err = failed.json()["error"]
        assert err["type"] == "server_error" and str(pool) in err["message"] and "\n" not in err["message"]
        assert served.status_code == 200, served.text
        alone = httpx.post(f"{url}/v1/completions", json=bodies[1], timeout=120)
        assert alone.status_code == 200 and served.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    eng.stop()
    assert os.listdir(pool) == []
