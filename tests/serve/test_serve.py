"""`infinigen serve`: continuous batching gives every request the tokens it gets alone; bad input gets
OpenAI-style errors and the server keeps serving; a client that goes away frees its KV slots."""
from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from infinigen import runtime  # noqa: E402
from infinigen.kernels import fused_select  # noqa: E402
from infinigen.runtime import attention  # noqa: E402
from infinigen.generate import Sampling, generate_ids  # noqa: E402
from infinigen.placement import Placement  # noqa: E402
from infinigen.policies import make_policy  # noqa: E402
from infinigen.serve.app import BackgroundServer, create_app  # noqa: E402
from infinigen.serve.engine import Engine, QueueFull, Request  # noqa: E402
from infinigen.errors import UserError  # noqa: E402

NAME = "tiny"


def _mats(model, seed=3):
    c = model.cfg
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(c.num_layers, c.num_kv_heads, c.head_dim, c.head_dim, generator=g,
                                       dtype=torch.float64))[0]


def _policy(name, model):
    if name == "infinigen":  # the paper's selection (a real subset on short prompts), layer 0 dense only
        return make_policy("infinigen", preset="paper", dense_layers=(0,)).with_skew(_mats(model))
    return make_policy(name)


def _alone(model, name, prompt, n, eos=frozenset(), sampling=None):
    return generate_ids(model, [prompt], n, sampling or Sampling(), _policy(name, model), eos).tokens[0]


def _prompts(model, lengths, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, model.cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _wait(cond, timeout=20.0):
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


# ---- concurrent greedy requests equal the same requests run alone -----------------------------------
@pytest.mark.parametrize("policy,offload", [("full", "none"), ("infinigen", "none"), ("h2o", "none"), ("full", "disk")])
def test_engine_batches_equal_alone(make_tiny, policy, offload, monkeypatch):
    """10 requests of different lengths join and leave a running batch at different steps (at most 6 at
    once): each gets exactly the tokens of `generate` run alone, and every byte it reserved comes back.
    Not batch-invariant (the padded path): at each layer of a decoding step the running requests' entries read
    in place or gathered take one attention call over every request's rows, packed rows read where they lie one
    kernel call per request (as alone)."""
    _, model = make_tiny("llama", num_hidden_layers=3)
    lengths, maxt = (5, 17, 9, 30, 3, 22, 12, 40, 7, 26), (12, 7, 20, 5, 15, 9, 11, 6, 18, 10)
    prompts = _prompts(model, lengths)
    eng = Engine(model, _policy(policy, model), Placement(kv_offload=offload), max_batch=6, batch_invariant=False)
    calls, prefills = [], [0]  # rows of each attention call of a decoding step; prefills run

    def counted(fn):
        def call(q, *args, **kwargs):
            calls.append(q.shape[0])
            return fn(q, *args, **kwargs)
        return call

    def counted_prefill(*args, **kwargs):  # a prefill's first token counts once its last layer is done
        logits = yield from prefill_in_slices(*args, **kwargs)
        prefills[0] += 1
        return logits
    prefill_in_slices = runtime.prefill_in_slices
    monkeypatch.setattr(attention, "attend_all", counted(attention.attend_all))
    monkeypatch.setattr(attention, "attend_masked", counted(attention.attend_masked))
    # one request selecting alone attends over its rows in the fused kernel, where it is built
    monkeypatch.setattr(fused_select, "attend_rows", counted(fused_select.attend_rows))
    monkeypatch.setattr(runtime, "prefill_in_slices", counted_prefill)
    batched = []

    def step():
        calls.clear()
        tokens, before = eng.counters["completion_tokens"], prefills[0]
        eng.step()
        decoded = eng.counters["completion_tokens"] - tokens - (prefills[0] - before)  # requests decoded
        # every request's row attended once per layer: in one call over all of them, or its own kernel call
        assert sum(calls) == decoded * model.cfg.num_layers and all(c in (1, decoded) for c in calls)
        batched.append(decoded)

    reqs, steps = [], 0
    for i, (p, n) in enumerate(zip(prompts, maxt)):
        reqs.append(eng.submit(Request(p, n)))
        for _ in range(i % 3):  # arrivals 0, 1 or 2 steps apart
            step()
            steps += 1
        assert len(eng.running) <= 6
    while not eng.idle():
        step()
        steps += 1
    assert steps < sum(maxt)  # decoded together, not one after the other
    assert max(batched) == 6
    monkeypatch.undo()
    for r, p, n in zip(reqs, prompts, maxt):
        assert r.finish == "length" and r.tokens == _alone(model, policy, p, n), (policy, len(p))
    s = eng.snapshot()
    assert s["reserved_fast_bytes"] == s["reserved_slow_bytes"] == s["kv_fast_bytes"] == s["kv_slow_bytes"] == 0


def test_engine_sampling_and_eos_equal_alone(make_tiny):
    """Seeded sampling draws from each request's own generator; EOS ends a request early."""
    _, model = make_tiny("llama")
    prompts = _prompts(model, (4, 11, 19, 8), seed=9)
    s = Sampling(temperature=0.9, top_p=0.9, seed=42)
    ref = [_alone(model, "full", p, 25, sampling=s) for p in prompts]
    eos = {ref[1][3]}  # request 1 stops at its 4th token
    ref = [_alone(model, "full", p, 25, eos=eos, sampling=s) for p in prompts]
    eng = Engine(model, make_policy("full"), eos=eos)
    reqs = [eng.submit(Request(p, 25, Sampling(temperature=0.9, top_p=0.9, seed=42))) for p in prompts]
    while not eng.idle():
        eng.step()
    assert [r.tokens for r in reqs] == ref
    assert reqs[1].finish == "stop" and len(reqs[1].tokens) == 4


@pytest.mark.parametrize("policy", ["full", "infinigen"])
def test_http_concurrent_requests_equal_alone(checkpoint_model, policy):
    """Ten clients arriving at different times over HTTP (completions, chat, streamed and not): each answer
    is the text and token count of the request run alone."""
    model, tok = checkpoint_model
    eos = {tok.eos_token_id}
    eng = Engine(model, _policy(policy, model), eos=eos, max_batch=8)
    prompts = _prompts(model, (6, 14, 3, 25, 9, 31, 17, 4, 21, 11), seed=7)
    maxt = [10, 20, 6, 15, 25, 8, 12, 30, 9, 16]

    def one(i):
        time.sleep(0.03 * i)
        body = {"model": NAME, "prompt": prompts[i], "max_tokens": maxt[i], "temperature": 0}
        if i % 2:
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                assert r.status_code == 200
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            return "".join(c["choices"][0]["text"] for c in chunks), None, chunks[-1]["choices"][0]["finish_reason"]
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        return out["choices"][0]["text"], out["usage"], out["choices"][0]["finish_reason"]

    with BackgroundServer(create_app(eng, tok, NAME)) as url:
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            got = list(pool.map(one, range(10)))
        for i, (text, usage, reason) in enumerate(got):
            ref = _alone(model, policy, prompts[i], maxt[i], eos=eos)
            assert text == tok.decode(ref, skip_special_tokens=True), i
            assert reason == ("stop" if ref[-1] in eos else "length")
            if usage is not None:
                assert usage == {"prompt_tokens": len(prompts[i]), "completion_tokens": len(ref),
                                 "total_tokens": len(prompts[i]) + len(ref)}
        # chat through the model's template, with the openai client when it is installed
        msgs = [{"role": "user", "content": "It is a truth universally acknowledged"}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        ref = tok.decode(_alone(model, policy, list(ids), 12, eos=eos), skip_special_tokens=True)
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": NAME, "messages": msgs, "max_tokens": 12,
                                                           "temperature": 0}, timeout=60).json()
        assert r["choices"][0]["message"] == {"role": "assistant", "content": ref}
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        stream = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref
    assert eng.idle()


# ---- bad input ------------------------------------------------------------------------------------------
def _error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(checkpoint_model):
    model, tok = checkpoint_model
    eng = Engine(model, make_policy("full"), eos={tok.eos_token_id})
    ctx = model.cfg.max_position
    ok = {"model": NAME, "prompt": "Emma Woodhouse", "max_tokens": 5, "temperature": 0}
    with BackgroundServer(create_app(eng, tok, NAME)) as url:
        c = httpx.Client(base_url=url, timeout=30)
        good = c.post("/v1/completions", json=ok).json()["choices"][0]["text"]
        post = lambda body, path="/v1/completions": c.post(path, json=body)  # noqa: E731
        # malformed JSON, missing and mistyped fields
        _error(c.post("/v1/completions", content=b'{"model": "tiny", "prompt": ',
                      headers={"content-type": "application/json"}), 400)
        assert _error(post({"prompt": "hi"}), 400)["param"] == "model"
        assert _error(post({"model": NAME}), 400)["param"] == "prompt"
        assert _error(post({**ok, "max_tokens": "many"}), 400)["param"] == "max_tokens"
        assert _error(post({**ok, "temperature": "hot"}), 400)["param"] == "temperature"
        assert _error(post({**ok, "top_p": 0}), 400)["param"] == "top_p"
        assert _error(post({"model": NAME, "messages": "hi"}, "/v1/chat/completions"), 400)["param"] == "messages"
        robot = {"model": NAME, "messages": [{"role": "robot", "content": "x"}]}
        assert _error(post(robot, "/v1/chat/completions"), 400)
        # prompt over the context, max_tokens <= 0 or huge, unknown model
        assert _error(post({**ok, "prompt": list(range(3, 3 + ctx + 1))}), 400)["code"] == "context_length_exceeded"
        for n in (0, -1):
            assert _error(post({**ok, "max_tokens": n}), 400)["param"] == "max_tokens"
        assert _error(post({**ok, "max_tokens": 10 ** 12}), 400)["code"] == "context_length_exceeded"
        assert _error(post({**ok, "prompt": [model.cfg.vocab_size + 5]}), 400)["param"] == "prompt"
        assert _error(post({**ok, "model": "gpt-4"}), 400)["code"] == "model_not_found"
        assert _error(post({**ok, "prompt": "   "}), 400)["param"] == "prompt"
        # bodies over 1 MB: by Content-Length, and streamed in chunks without one
        big = json.dumps({**ok, "prompt": "x" * (1 << 20)}).encode()
        _error(c.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)
        _error(c.post("/v1/completions", content=(big[i:i + 65536] for i in range(0, len(big), 65536)),
                      headers={"content-type": "application/json"}), 413)
        assert c.get("/v1/nothing").status_code == 404
        # still serving, with the same answer
        assert c.post("/v1/completions", json=ok).json()["choices"][0]["text"] == good
        assert c.get("/health").json()["status"] == "ok"
        models = c.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [NAME]
        metrics = c.get("/metrics").text
        assert 'infinigen_requests_total{outcome="length"} 2.0' in metrics
        # the two answers' tokens after their first came from decoding steps, which took time
        assert "infinigen_decode_tokens_total 8.0" in metrics
        seconds = [line.split()[1] for line in metrics.splitlines() if line.startswith("infinigen_decode_seconds_")]
        assert float(seconds[0]) > 0
        assert "infinigen_kv_bytes{tier=\"fast\"} 0.0" in metrics and "infinigen_requests_waiting 0.0" in metrics


def test_full_queue_answers_429(checkpoint_model):
    """One running request (the KV budget holds one) and one waiting: the third gets 429, the others finish."""
    model, tok = checkpoint_model
    probe = Engine(model, make_policy("full"))
    fast, _ = probe.request_cost(8, 60)
    eng = Engine(model, make_policy("full"), fast_bytes=int(fast * 1.5), max_queue=1, cost=probe.cost)
    step = eng.step
    eng.step = lambda: (time.sleep(0.02), step())[1]  # a slower model: the first request runs for a second
    body = {"model": NAME, "prompt": list(range(3, 11)), "max_tokens": 60, "temperature": 0}
    with BackgroundServer(create_app(eng, tok, NAME)) as url:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
            assert _wait(lambda: eng.snapshot()["running"] == 1)
            second = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
            assert _wait(lambda: eng.snapshot()["waiting"] == 1)
            err = _error(httpx.post(f"{url}/v1/completions", json=body, timeout=60), 429)
            assert err["code"] == "rate_limit_exceeded"
            assert first.result().status_code == second.result().status_code == 200
        # a request that could never fit, even alone: 400, not a wait
        assert _error(httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 110}, timeout=60), 400)
    with pytest.raises(QueueFull):
        eng2 = Engine(model, make_policy("full"), max_batch=1, max_queue=0, cost=probe.cost)
        eng2.submit(Request([5, 6], 3))
        eng2.submit(Request([5, 6], 3))


def _files_open_in(folder) -> list[str]:
    """This process's open files in `folder` (the disk pool's files have no name there)."""
    import os
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        out += [target] if target.startswith(f"{folder}/") else []
    return out


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_disconnect_mid_stream_frees_the_row(checkpoint_model, offload, tmp_path):
    """A client reads one chunk of a long stream and closes the connection: its request is cancelled and
    its KV bytes (and, on disk, its pool files) go; another request is served meanwhile and after."""
    model, tok = checkpoint_model
    eng = Engine(model, make_policy("full"), Placement(kv_offload=offload, pool_dir=str(tmp_path)))
    step = eng.step
    eng.step = lambda: (time.sleep(0.02), step())[1]  # a slower model: 100 tokens take two seconds
    body = {"model": NAME, "prompt": list(range(3, 20)), "max_tokens": 100, "temperature": 0, "stream": True}
    with BackgroundServer(create_app(eng, tok, NAME)) as url:
        host, port = url[7:].split(":")
        sock = socket.create_connection((host, int(port)))
        data = json.dumps(body).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        got = b""
        while b"data: " not in got:
            got += sock.recv(4096)
        assert eng.snapshot()["running"] == 1 and eng.snapshot()["reserved_fast_bytes"] > 0
        assert bool(_files_open_in(tmp_path)) == (offload == "disk")  # the request's pool files
        other = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 5}, timeout=60)
        sock.close()
        assert other.status_code == 200
        assert _wait(lambda: eng.snapshot()["running"] == 0)
        s = eng.snapshot()
        assert s["reserved_fast_bytes"] == s["reserved_slow_bytes"] == s["kv_fast_bytes"] == s["kv_slow_bytes"] == 0
        assert s.get("requests_cancelled", 0) == 1 and s["completion_tokens"] < 100
        assert not list(tmp_path.iterdir()) and not _files_open_in(tmp_path)
        r = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 5}, timeout=60)
        assert r.status_code == 200


# ---- Ray Serve -------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ray_serve_two_replicas(tiny_checkpoint, checkpoint_model, monkeypatch):
    """Two replicas behind Ray Serve's proxy on a local cluster this test starts and stops: the same routes,
    both replicas answer, and every answer is the request's tokens run alone."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    # Ray Serve's controller kills a proxy that is not ready within 5 s (10 s for a health check): on 2 busy cores
    # it may take longer to start, which is not what this test asks (the cluster's processes inherit these)
    for check in ("READY_CHECK", "HEALTH_CHECK"):
        monkeypatch.setenv(f"RAY_SERVE_PROXY_{check}_TIMEOUT_S", "120")
    import functools

    from infinigen.commands.serve import build
    from infinigen.serve.ray import deployment
    model, tok = checkpoint_model
    from infinigen.serve.config import ServerConfig
    config = ServerConfig(model=str(tiny_checkpoint), policy="full", max_batch=8, max_queue=16, served_model_name=NAME,
                          device="cpu", dtype="float32", fast_bytes=1 << 28)
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(functools.partial(build, config), 2, num_cpus=0.5), name="infinigen", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"] == NAME
        prompts = _prompts(model, (5, 12, 20, 8, 15, 3), seed=11)
        eos = {tok.eos_token_id}

        def one(i):
            body = {"model": NAME, "prompt": prompts[i], "max_tokens": 12, "temperature": 0, "stream": bool(i % 2)}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            if not body["stream"]:
                return r.json()["choices"][0]["text"]
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            got = list(pool.map(one, range(6)))
        for i, text in enumerate(got):
            assert text == tok.decode(_alone(model, "full", prompts[i], 12, eos=eos), skip_special_tokens=True)
        assert _error(httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30), 400)
        pids = {httpx.get(f"{url}/health", timeout=30).json()["pid"] for _ in range(40)}
        assert len(pids) == 2
    finally:
        serve.shutdown()
        ray.shutdown()


def test_serve_command_checks_options_before_loading(capsys):
    from infinigen.cli import main
    from infinigen.commands.serve import parse_bytes
    assert parse_bytes("512M") == 512 << 20 and parse_bytes("2GiB") == 2 << 30 and parse_bytes("1000") == 1000
    for argv in (["--kv-offload", "ssd"], ["--pool-bytes", "lots"], ["--fast-bytes", "0"], ["--max-batch", "0"],
                 ["--max-queue", "-1"], ["--port", "70000"], ["--replicas", "0"], ["--knob", "nope=1"],
                 ["--decode-threads", "0"]):
        assert main(["serve", "--model", "/nonexistent", *argv]) == 2, argv
        assert capsys.readouterr().err.startswith("infinigen: error:")


def test_a_request_cancelled_between_admission_and_prefill_leaves_the_others_decoding(make_tiny, monkeypatch):
    """Found by benchmarks/serve_soak.py: a client that went away while an earlier request of the same step
    was being prefilled left a request with no token in the batch, and the step failed for everyone
    ("decode failed: list index out of range")."""
    _, model = make_tiny("llama", num_hidden_layers=2)
    eng = Engine(model, make_policy("full"), max_batch=4)
    first, second = (Request(prompt=p, max_tokens=5) for p in _prompts(model, (6, 9)))
    prefill = eng._prefill

    def prefill_then_the_other_client_leaves(req):
        prefill(req)
        if req is first:
            eng.cancel(second)
    monkeypatch.setattr(eng, "_prefill", prefill_then_the_other_client_leaves)
    eng.submit(first)
    eng.submit(second)
    while eng.step():
        pass
    assert first.finish == "length" and first.tokens == _alone(model, "full", first.prompt, 5)
    assert second.finish == "cancelled" and second.session is None
    assert eng.counters["requests_error"] == 0 and eng.reserved == [0, 0]


def test_the_engine_gives_freed_heap_back_once_requests_finish(make_tiny, monkeypatch):
    """Under a mixed load the server's RSS grew ~1 MiB/s with no leaked object (benchmarks/serve_soak.py):
    glibc keeps freed pages. The engine's loop trims the heap after requests finish, at most every 2 s."""
    import infinigen.serve.engine as engine_module
    from infinigen.memory import release_free_heap
    assert release_free_heap() is True  # glibc: the call exists and runs
    trims = []
    monkeypatch.setattr(engine_module, "release_free_heap", lambda: trims.append(time.monotonic()))
    _, model = make_tiny("llama", num_hidden_layers=2)
    eng = Engine(model, make_policy("full"), max_batch=2).start()
    try:
        reqs = [eng.submit(Request(prompt=p, max_tokens=3)) for p in _prompts(model, (5, 7))]
        assert _wait(lambda: all(r.finish for r in reqs)) and _wait(lambda: trims)
        n = len(trims)
        time.sleep(0.3)
        assert len(trims) == n  # nothing finished since: no more trimming, even though the loop ran
    finally:
        eng.stop()


@pytest.mark.parametrize("policy", ["full", "infinigen", "h2o"])
def test_a_joining_prompt_is_prefilled_a_chunk_of_layers_per_step(make_tiny, policy):
    """Chunked prefill: a prompt that joins a running request advances `prefill_chunk_layers` layers per
    engine step (`prefill_share` 0: no further chunks in the time the decode step took), and the running request
    decodes a token at every one of those steps (its pace holds); both get exactly their tokens alone. Alone, a
    prompt is prefilled in one step; chunk 0: in one step. With an unbounded share the joining prompt's chunks
    all run in its first step, the running request still decoding at that step."""
    _, model = make_tiny("llama", num_hidden_layers=4)
    running_prompt, joining_prompt = _prompts(model, (7, 40))
    for chunk, share, steps_to_first_token in ((1, 0, 4), (2, 0, 2), (0, 0, 1), (1, 1e12, 1)):
        eng = Engine(model, _policy(policy, model), max_batch=4, prefill_chunk_layers=chunk, prefill_share=share)
        a = eng.submit(Request(prompt=running_prompt, max_tokens=12))
        eng.step()
        assert len(a.tokens) == 2  # alone: prefilled (first token) and decoded in the first step
        b = eng.submit(Request(prompt=joining_prompt, max_tokens=3))
        steps = 0
        while not b.tokens:
            before = len(a.tokens)
            eng.step()
            steps += 1
            assert len(a.tokens) == before + 1  # the running request decoded at every step of b's prefill
        assert steps == steps_to_first_token, (chunk, share, steps)
        while not eng.idle():
            eng.step()
        assert a.tokens == _alone(model, policy, running_prompt, 12)
        assert b.tokens == _alone(model, policy, joining_prompt, 3)
        assert eng.reserved == [0, 0]


def test_the_engine_decodes_on_its_decode_threads_and_prefills_on_all(make_tiny, monkeypatch):
    """`decode_threads`: a decoding step's torch ops run on that many threads, a prompt's prefill (joining running
    requests too) on the engine thread's own count, which every step leaves as it found it; each request's tokens
    are those it gets alone on every thread. A server on a CPU takes every thread but one by default."""
    from infinigen.serve.config import ServerConfig
    from infinigen.serve.engine import default_decode_threads
    _, model = make_tiny("llama", num_hidden_layers=2)
    prompts = _prompts(model, (9, 30, 14))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = {"prefill": [], "decode": []}
        prefill_in_slices, decode = runtime.prefill_in_slices, runtime.decode

        def spied_prefill(*args, **kwargs):
            seen["prefill"].append(torch.get_num_threads())
            logits = yield from prefill_in_slices(*args, **kwargs)
            seen["prefill"].append(torch.get_num_threads())
            return logits

        def spied_decode(*args, **kwargs):
            seen["decode"].append(torch.get_num_threads())
            return decode(*args, **kwargs)
        monkeypatch.setattr(runtime, "prefill_in_slices", spied_prefill)
        monkeypatch.setattr(runtime, "decode", spied_decode)
        eng = Engine(model, _policy("infinigen", model), max_batch=3, decode_threads=1)
        seen["decode"].clear()  # the engine's cost probes
        reqs = [eng.submit(Request(prompts[0], 12))]
        eng.step()
        reqs += [eng.submit(Request(p, 8)) for p in prompts[1:]]  # they join a running request
        while not eng.idle():
            eng.step()
            assert torch.get_num_threads() == 2
        monkeypatch.undo()
        assert set(seen["prefill"]) == {2} and len(seen["prefill"]) == 6 and set(seen["decode"]) == {1}, seen
        for r, p in zip(reqs, prompts):
            assert r.tokens == _alone(model, "infinigen", p, r.max_tokens)
        assert default_decode_threads("cpu") == 1 and default_decode_threads("meta") is None
        assert Engine.from_config(model, make_policy("full"), ServerConfig()).decode_threads == 1
        assert Engine.from_config(model, make_policy("full"), ServerConfig(decode_threads=2)).decode_threads == 2
        torch.set_num_threads(1)
        assert default_decode_threads("cpu") == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(UserError, match="decode_threads"):
        Engine(model, make_policy("full"), decode_threads=0)
