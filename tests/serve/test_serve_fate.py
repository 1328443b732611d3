"""`infinigen serve`, every request's fate: a client that goes away cancels its request
within a step; malformed bodies and unsupported fields get 400 with OpenAI's error body and the connection
keeps serving; logprobs, top_logprobs and echo are the model's own numbers; the port and the budgets are
checked before the model loads; SIGTERM drains (exit 0), SIGINT cancels (exit 130); an error mid-stream is
the stream's last event."""
from __future__ import annotations

import concurrent.futures
import errno
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from support.cli import console, one_line_error  # noqa: E402
from infinigen import runtime  # noqa: E402
from infinigen.generate import Sampling, generate_ids  # noqa: E402
from infinigen.placement import Placement  # noqa: E402
from infinigen.policies import make_policy  # noqa: E402
from infinigen.serve import answer, routes  # noqa: E402
from infinigen.serve.app import BackgroundServer, create_app  # noqa: E402
from infinigen.serve.engine import Engine  # noqa: E402

NAME = "tiny"


@pytest.fixture(scope="module")
def checkpoint_model(tiny_checkpoint):
    from infinigen.loading import load
    model, tok, _ = load(str(tiny_checkpoint), progress=False)
    return model, tok


def _slow(eng: Engine, seconds: float = 0.02) -> Engine:
    """A slower model: each engine step takes `seconds` more, so a long request is still running when the
    test acts on it."""
    step = eng.step
    eng.step = lambda: (time.sleep(seconds), step())[1]
    return eng


def _wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _metric(url, outcome) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return float(re.search(r'infinigen_requests_total\{outcome="%s"\} (\S+)' % outcome, text).group(1))


def _events(lines) -> list:
    """The data of every SSE event: parsed JSON, or the string "[DONE]"."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _error_shape(body: dict) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    return err


def _kv_free(eng: Engine) -> bool:
    s = eng.snapshot()
    return s["running"] == s["waiting"] == 0 and s["reserved_fast_bytes"] == s["reserved_slow_bytes"] == 0 \
        and s["kv_fast_bytes"] == s["kv_slow_bytes"] == 0


# ---- 1. a client that goes away -----------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_client_that_goes_away_cancels_its_request(checkpoint_model, stream):
    """`curl -m` on a long request whose stop string never matches: the request leaves the engine within a
    step or two of the client going away (not after its 100 tokens), its KV is freed, /metrics counts it as
    cancelled. A stop string that matches counts as `stop`, not as cancelled."""
    model, tok = checkpoint_model
    eng = _slow(Engine(model, make_policy("full")))  # no EOS: only max_tokens or a cancel ends a request
    body = {"model": NAME, "prompt": "Emma Woodhouse", "max_tokens": 100, "temperature": 0, "stop": ["qqq"],
            "stream": stream}
    with BackgroundServer(create_app(eng, tok, NAME)) as url:
        with httpx.Client(base_url=url, timeout=httpx.Timeout(0.5)) as c:
            if stream:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    next(line for line in r.iter_lines() if line.startswith("data: "))  # one chunk, then away
            else:
                with pytest.raises(httpx.ReadTimeout):
                    c.post("/v1/completions", json=body)
        gone = time.monotonic()
        assert eng.snapshot()["running"] == 1  # still decoding when the client left
        assert _wait(lambda: eng.snapshot()["running"] == 0, timeout=10)
        took = time.monotonic() - gone
        assert took < 0.5, f"the request ran {took:.2f} s after its client left"  # 100 tokens take > 2 s
        assert _wait(lambda: _kv_free(eng))
        s = eng.snapshot()
        assert s["completion_tokens"] < 60
        assert _metric(url, "cancelled") == 1 and _metric(url, "length") == 0
        # a stop string that matches ends the request as `stop`
        text = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 12}, timeout=30).json()
        assert text["choices"][0]["finish_reason"] == "length"
        words = text["choices"][0]["text"]
        stop = words[len(words) // 2:len(words) // 2 + 2]
        assert stop.strip()
        r = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 12, "stop": [stop]},
                       timeout=30).json()
        assert r["choices"][0]["finish_reason"] == "stop" and stop not in r["choices"][0]["text"]
        assert _wait(lambda: eng.snapshot()["running"] == 0)
        assert _metric(url, "stop") == 1 and _metric(url, "cancelled") == 1 and _metric(url, "length") == 1


# ---- 2 and 3. malformed bodies, unsupported fields ----------------------------------------------------------
C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": NAME, "prompt": "Emma Woodhouse", "max_tokens": 3, "temperature": 0}
OK_CHAT = {"model": NAME, "messages": [{"role": "user", "content": "Emma"}], "max_tokens": 3, "temperature": 0}
ANY = object()


def _raw(text: str) -> bytes:
    return text.encode()


def _user(content) -> dict:
    return {**OK_CHAT, "messages": [{"role": "user", "content": content}]}


MALFORMED = [  # (route, body: dict or raw bytes, the param the error names: a str, None or ANY)
    # chat content and messages
    (CHAT, _user([{"type": "text", "text": 5}]), "messages.0.content.0.text"),
    (CHAT, _user([{"type": "text"}]), "messages.0.content.0.text"),
    (CHAT, _user([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]), "messages.0.content.0.type"),
    (CHAT, _user([{"text": "hi"}]), "messages.0.content.0.type"),
    (CHAT, _user(["hi"]), "messages.0.content.0"),
    (CHAT, _user(5), "messages.0.content"),
    (CHAT, _user(None), "messages.0.content"),
    (CHAT, _user({"type": "text", "text": "hi"}), "messages.0.content"),
    (CHAT, {**OK_CHAT, "messages": [{"role": 5, "content": "x"}]}, "messages.0.role"),
    (CHAT, {**OK_CHAT, "messages": [{"role": ["user"], "content": "x"}]}, "messages.0.role"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    (CHAT, {**OK_CHAT, "messages": [{"content": "x"}]}, "messages.0.role"),
    (CHAT, {**OK_CHAT, "messages": "hi"}, "messages"),
    (CHAT, {**OK_CHAT, "messages": []}, "messages"),
    (CHAT, {**OK_CHAT, "messages": None}, "messages"),
    (CHAT, {**OK_CHAT, "messages": [5]}, "messages.0"),
    (CHAT, {**OK_CHAT, "messages": [["user", "hi"]]}, "messages.0"),
    (CHAT, _raw('{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'), "messages.0.content"),
    (CHAT, {**OK_CHAT, "logprobs": "maybe"}, "logprobs"),
    (CHAT, {**OK_CHAT, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {**OK_CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {**OK_CHAT, "max_completion_tokens": "x"}, "max_completion_tokens"),
    (CHAT, {**OK_CHAT, "echo": True}, "echo"),
    # completions prompt and fields
    (C, {**OK, "prompt": 5}, "prompt"),
    (C, {**OK, "prompt": None}, "prompt"),
    (C, {**OK, "prompt": [1.5]}, "prompt.0"),
    (C, {**OK, "prompt": [[1, 2], [3]]}, "prompt"),
    (C, {**OK, "prompt": ["a", "b"]}, "prompt"),
    (C, {**OK, "prompt": [-1]}, "prompt"),
    (C, {**OK, "prompt": {"text": "hi"}}, "prompt"),
    (C, {**OK, "prompt": []}, "prompt"),
    (C, _raw('{"model": "tiny", "prompt": "a \\udc80 b"}'), "prompt"),
    (C, {**OK, "logprobs": 6}, "logprobs"),
    (C, {**OK, "logprobs": -1}, "logprobs"),
    (C, {**OK, "logprobs": True}, "logprobs"),
    (C, {**OK, "echo": "loud"}, "echo"),
    (C, {**OK, "top_logprobs": 2}, "top_logprobs"),
    # both routes: sampling, stop, stream, model
    (C, {**OK, "max_tokens": "many"}, "max_tokens"),
    (C, {**OK, "max_tokens": 1.5}, "max_tokens"),
    (C, {**OK, "max_tokens": 0}, "max_tokens"),
    (C, _raw('{"model": "tiny", "prompt": "x", "temperature": NaN}'), "temperature"),
    (C, _raw('{"model": "tiny", "prompt": "x", "top_p": Infinity}'), "top_p"),
    (C, {**OK, "temperature": -1}, "temperature"),
    (C, {**OK, "temperature": "hot"}, "temperature"),
    (C, {**OK, "top_p": 0}, "top_p"),
    (C, {**OK, "seed": -1}, "seed"),
    (C, {**OK, "seed": 2 ** 64}, "seed"),
    (C, {**OK, "n": 2}, "n"),
    (C, {**OK, "stop": 5}, "stop"),
    (C, {**OK, "stop": [5]}, "stop.0"),
    (C, {**OK, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    (C, {**OK, "stop": [""]}, "stop"),
    (C, {**OK, "stream": "maybe"}, "stream"),
    (C, {**OK, "stream_options": 5}, "stream_options"),
    (C, {**OK, "stream_options": {"include_usage": "x"}}, "stream_options.include_usage"),
    (C, {**OK, "stream_options": {"include_tokens": True}}, "stream_options.include_tokens"),
    (C, {**OK, "model": 5}, "model"),
    (C, {**OK, "model": ["tiny"]}, "model"),
    (C, {"prompt": "x"}, "model"),
    (C, {**OK, "model": "gpt-4"}, "model"),
    (CHAT, {**OK_CHAT, "temperature": [1]}, "temperature"),
    (CHAT, {**OK_CHAT, "stop": {"a": 1}}, "stop"),
    (CHAT, {**OK_CHAT, "model": None}, "model"),
    # not a body at all
    (C, _raw("[]"), None),
    (C, _raw('"hello"'), None),
    (C, _raw("null"), ANY),
    (C, _raw("5"), None),
    (C, _raw('{"model": "tiny", "prompt": '), None),
    (C, b'{"model": "tiny", "prompt": "\xff\xfe"}', ANY),
    (CHAT, _raw("[" * 100_000 + "]" * 100_000), ANY),
    (CHAT, _raw("{}"), ANY),
]


def _connection(url):
    host, port = url[7:].split(":")
    return http.client.HTTPConnection(host, int(port), timeout=30)


def _post(conn, path, body, content_type="application/json"):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=raw, headers={"Content-Type": content_type})
    r = conn.getresponse()
    return r, r.read()


@pytest.fixture(scope="module")
def server(checkpoint_model):
    model, tok = checkpoint_model
    eng = Engine(model, make_policy("full"), eos={tok.eos_token_id})
    with BackgroundServer(create_app(eng, tok, NAME)) as url:
        yield url, eng


def test_malformed_bodies_get_400_and_the_connection_keeps_serving(server):
    """Every malformed body on either route: 400 with OpenAI's error body naming the field at fault; the
    same keep-alive connection then serves a valid request."""
    url, eng = server
    conn = _connection(url)
    good = {}
    for path, ok in ((C, OK), (CHAT, OK_CHAT)):
        r, data = _post(conn, path, ok)
        assert r.status == 200, data
        good[path] = json.loads(data)["choices"][0]
    for path, body, param in MALFORMED:
        r, data = _post(conn, path, body)
        case = f"{path} {body[:80] if isinstance(body, bytes) else body}"
        assert r.status == 400, (case, data)
        assert r.getheader("content-type") == "application/json", case
        err = _error_shape(json.loads(data))
        if param is not ANY:
            assert err["param"] == param, (case, err)
        sock = conn.sock
        assert sock is not None and not r.will_close, case  # the server kept the connection
        r, data = _post(conn, path, OK if path == C else OK_CHAT)
        assert r.status == 200 and conn.sock is sock, (case, data)
        assert json.loads(data)["choices"][0] == good[path], case
    # not JSON at all
    r, data = _post(conn, C, b"model=tiny&prompt=hi", "application/x-www-form-urlencoded")
    assert r.status == 400 and _error_shape(json.loads(data))
    conn.close()
    assert _wait(lambda: _kv_free(eng))


def test_a_bug_is_a_json_500_and_the_connection_keeps_serving(server, monkeypatch):
    """What no route turned into an answer (a bug, here injected once): a 500 with OpenAI's error body, not
    Starlette's plain text, and the keep-alive connection goes on."""
    url, _ = server
    real, calls = routes._usage, []

    def usage(ids, req):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected bug")
        return real(ids, req)
    monkeypatch.setattr(routes, "_usage", usage)
    conn = _connection(url)
    r, data = _post(conn, C, OK)
    assert r.status == 500 and r.getheader("content-type") == "application/json"
    assert _error_shape(json.loads(data))["type"] == "server_error"
    sock = conn.sock
    assert sock is not None and not r.will_close
    r, data = _post(conn, C, OK)
    assert r.status == 200 and conn.sock is sock
    conn.close()


UNSUPPORTED = [  # (route, field, value): refused, naming the field
    (CHAT, "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    (CHAT, "tool_choice", "auto"),
    (CHAT, "functions", [{"name": "f"}]),
    (CHAT, "function_call", "auto"),
    (CHAT, "parallel_tool_calls", True),
    (CHAT, "response_format", {"type": "json_object"}),
    (CHAT, "logit_bias", {"5": 10}),
    (CHAT, "presence_penalty", 0.5),
    (CHAT, "frequency_penalty", -1),
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "prediction", {"type": "content", "content": "x"}),
    (CHAT, "reasoning_effort", "low"),
    (CHAT, "web_search_options", {}),
    (CHAT, "top_k", 5),
    (CHAT, "repetition_penalty", 1.1),
    (C, "best_of", 2),
    (C, "suffix", "the end"),
    (C, "logit_bias", {"5": -100}),
    (C, "presence_penalty", 1),
    (C, "tools", [{"type": "function"}]),
    (C, "response_format", {"type": "json_object"}),
    (C, "min_p", 0.1),
    (C, "ignore_eos", True),
    (C, "n", 3),
]
NEUTRAL = [  # OpenAI fields at their no-op value, and fields that do not change the answer: accepted
    (CHAT, {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": {},
            "presence_penalty": 0, "frequency_penalty": 0.0, "n": 1, "user": "u1", "metadata": {"a": "b"},
            "store": False, "service_tier": "auto", "modalities": ["text"], "top_p": None, "stream": False,
            "stop": None, "seed": None, "stream_options": {"include_obfuscation": False}}),
    (C, {"best_of": 1, "suffix": "", "logit_bias": {}, "presence_penalty": 0, "echo": False, "logprobs": None}),
]


def test_unsupported_fields_are_refused_by_name(server):
    url, eng = server
    conn = _connection(url)
    for path, field, value in UNSUPPORTED:
        r, data = _post(conn, path, {**(OK if path == C else OK_CHAT), field: value})
        assert r.status == 400, (path, field, data)
        err = _error_shape(json.loads(data))
        assert err["param"] == field and field in err["message"], (path, field, err)
    for path, extra in NEUTRAL:
        base = OK if path == C else OK_CHAT
        r, data = _post(conn, path, {**base, **extra})
        assert r.status == 200, (path, data)
        r2, plain = _post(conn, path, base)
        assert json.loads(data)["choices"] == json.loads(plain)["choices"]
    conn.close()


# ---- 3. logprobs, top_logprobs, echo -------------------------------------------------------------------------
def _reference(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position of `ids` (one dense prefill: row j predicts
    token j + 1), computed here without the server."""
    sess = Placement().new_session(model, 1, len(ids), make_policy("full"))
    try:
        logits = runtime.prefill(model, torch.tensor([ids]), sess, all_logits=True)[0]
    finally:
        sess.store.close()
    return torch.log_softmax(logits.float(), dim=-1)


def _greedy(model, prompt, n, eos):
    return generate_ids(model, [prompt], n, Sampling(), make_policy("full"), eos).tokens[0]


def test_token_pieces_match_the_tokenizer(checkpoint_model):
    """Each token's bytes: its own text where that text is whole characters; special tokens as their text."""
    _, tok = checkpoint_model
    pieces = answer.Pieces(tok)
    partial = 0
    for i in range(len(tok)):
        b = pieces.bytes(i)
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            partial += 1
            assert pieces.text(i) == "bytes:" + "".join(f"\\x{x:02x}" for x in b)
            continue
        assert text == (tok.convert_ids_to_tokens(i) if i in tok.all_special_ids else tok.decode([i])), i
        assert pieces.text(i) == text
    assert partial > 0  # byte-level BPE: the bytes of a multi-byte character alone are not text


def test_completion_logprobs_are_the_models(server, checkpoint_model):
    """Greedy tokens' logprobs and top_logprobs (logprobs=3) equal log_softmax of the model's logits computed
    directly; streamed chunks carry the same numbers; text_offset points into the text."""
    url, _ = server
    model, tok = checkpoint_model
    eos = {tok.eos_token_id}
    prompt = list(range(40, 52))
    ids = _greedy(model, prompt, 10, eos)
    ref = _reference(model, prompt + ids[:-1])
    body = {"model": NAME, "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 3}
    out = httpx.post(f"{url}{C}", json=body, timeout=30).json()["choices"][0]
    lp = out["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    kept = [t for t in ids if t not in eos]  # an EOS is not part of the text
    assert len(lp["tokens"]) == len(kept)
    pieces = answer.Pieces(tok)
    for i, t in enumerate(kept):
        row = ref[len(prompt) - 1 + i]
        assert lp["tokens"][i] == pieces.text(t)
        assert lp["token_logprobs"][i] == pytest.approx(float(row[t]), abs=1e-4)
        top = row.topk(3)
        alts = lp["top_logprobs"][i]
        assert sorted(alts.values(), reverse=True) == pytest.approx(top.values.tolist(), abs=1e-4)
        assert set(alts) == {pieces.text(a) for a in top.indices.tolist()}  # greedy: the token is the top one
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert out["text"] == tok.decode(ids, skip_special_tokens=True)
    # streamed: the chunks' logprobs put together are the same
    with httpx.stream("POST", f"{url}{C}", json={**body, "stream": True}, timeout=30) as r:
        events = _events(r.iter_lines())
    assert events[-1] == "[DONE]"
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events[:-1]:
        for k, v in (e["choices"][0]["logprobs"] or {}).items():
            merged[k] += v
    assert merged["tokens"] == lp["tokens"] and merged["text_offset"] == lp["text_offset"]
    assert merged["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-5)
    # logprobs=0: the sampled token's only
    zero = httpx.post(f"{url}{C}", json={**body, "logprobs": 0}, timeout=30).json()["choices"][0]["logprobs"]
    assert [list(a) for a in zero["top_logprobs"]] == [[t] for t in lp["tokens"]]
    # no logprobs asked: none computed
    assert httpx.post(f"{url}{C}", json={**body, "logprobs": None}, timeout=30).json()["choices"][0]["logprobs"] is None


def test_chat_logprobs_are_the_models(server, checkpoint_model):
    url, _ = server
    model, tok = checkpoint_model
    eos = {tok.eos_token_id}
    msgs = [{"role": "user", "content": "It is a truth universally acknowledged"}]
    prompt = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    ids = _greedy(model, prompt, 12, eos)
    ref = _reference(model, prompt + ids[:-1])
    body = {"model": NAME, "messages": msgs, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    out = httpx.post(f"{url}{CHAT}", json=body, timeout=30).json()["choices"][0]
    content = out["logprobs"]["content"]
    kept = [t for t in ids if t not in eos]
    assert len(content) == len(kept)
    for i, (t, e) in enumerate(zip(kept, content)):
        row = ref[len(prompt) - 1 + i]
        assert e["logprob"] == pytest.approx(float(row[t]), abs=1e-4)
        assert [a["logprob"] for a in e["top_logprobs"]] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
        assert e["top_logprobs"][0]["bytes"] == e["bytes"]  # greedy: the token is the likeliest
        assert bytes(e["bytes"]).decode("utf-8", "replace") == tok.decode([t]) or e["token"].startswith("bytes:")
    assert b"".join(bytes(e["bytes"]) for e in content) == tok.decode(kept).encode("utf-8") or \
        any(e["token"].startswith("bytes:") for e in content)
    # logprobs without top_logprobs: empty alternatives; streamed: the same entries
    plain = httpx.post(f"{url}{CHAT}", json={**body, "top_logprobs": None}, timeout=30).json()["choices"][0]
    assert [e["top_logprobs"] for e in plain["logprobs"]["content"]] == [[]] * len(content)
    with httpx.stream("POST", f"{url}{CHAT}", json={**body, "stream": True}, timeout=30) as r:
        events = _events(r.iter_lines())
    streamed = [e for ev in events[:-1] for e in ((ev["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-5)


def test_echo_with_logprobs_scores_the_prompt(server, checkpoint_model, monkeypatch):
    """echo: the prompt's text before the completion; with logprobs, the prompt tokens' logprobs from the
    prefill's logits (the first one null); the completion is the one without echo."""
    url, _ = server
    model, tok = checkpoint_model
    prompt = list(range(60, 75))
    ref = _reference(model, prompt)
    body = {"model": NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2}
    plain = httpx.post(f"{url}{C}", json=body, timeout=30).json()["choices"][0]
    out = httpx.post(f"{url}{C}", json={**body, "echo": True}, timeout=30).json()["choices"][0]
    echo = tok.decode(prompt)
    assert out["text"] == echo + plain["text"]
    lp, n = out["logprobs"], len(prompt)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, n):
        assert lp["token_logprobs"][j] == pytest.approx(float(ref[j - 1, prompt[j]]), abs=1e-4)
        top = sorted(lp["top_logprobs"][j].values(), reverse=True)[:2]
        assert top == pytest.approx(ref[j - 1].topk(2).values.tolist(), abs=1e-4)
    # the same completion (its first token's numbers from a prefill that kept every position's logits)
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
    for mine, theirs in zip(lp["top_logprobs"][n:], plain["logprobs"]["top_logprobs"]):
        assert mine == pytest.approx(theirs, abs=1e-5)
    assert lp["text_offset"][n:] == [len(echo) + x for x in plain["logprobs"]["text_offset"]]
    assert lp["text_offset"][:n] == sorted(lp["text_offset"][:n]) and lp["text_offset"][0] == 0
    # streamed: the prompt comes first, with its logprobs
    with httpx.stream("POST", f"{url}{C}", json={**body, "echo": True, "stream": True}, timeout=30) as r:
        events = _events(r.iter_lines())
    first = events[0]["choices"][0]
    assert first["text"] == echo and first["logprobs"]["token_logprobs"] == lp["token_logprobs"][:n]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == out["text"]
    # echo of a text prompt, without logprobs: the prompt as sent
    text = httpx.post(f"{url}{C}", json={**OK, "echo": True}, timeout=30).json()["choices"][0]
    assert text["text"].startswith(OK["prompt"]) and text["logprobs"] is None
    # echo + logprobs keeps every prompt position's logits: bounded
    monkeypatch.setattr(routes, "ECHO_LOGITS_BYTES", (n - 1) * model.cfg.vocab_size * 4)
    err = _error_shape(httpx.post(f"{url}{C}", json={**body, "echo": True}, timeout=30).json())
    assert err["param"] == "echo"


# ---- 5. an error mid-stream -----------------------------------------------------------------------------------
def _read_stream(url, path, body, first: threading.Event | None = None):
    events = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            events += _events([line])
            if first is not None and events:
                first.set()
    return events


def _ends_with_error(events) -> dict:
    """The stream's last event is the error; no finish chunk or [DONE] after it."""
    assert events and isinstance(events[-1], dict) and "error" in events[-1], events[-3:]
    assert "[DONE]" not in events
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    return _error_shape(events[-1])


@pytest.fixture
def pool_filler(tmp_path, monkeypatch):
    """(pool folder, fill()): after fill(), no new pool file fits. A 1 MiB tmpfs really filled when this runs
    as root; else the reservation of the pool file fails with ENOSPC."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode == 0:
        def fill():
            fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
            try:
                while os.write(fd, b"\0" * 4096):
                    pass
            except OSError:
                pass
            finally:
                os.close(fd)
        try:
            yield mnt, fill
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        return
    real = os.posix_fallocate
    full = threading.Event()

    def fallocate(fd, offset, length):
        if full.is_set():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, offset, length)
    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    yield mnt, full.set


def test_pool_that_fills_up_ends_that_stream_with_an_error(checkpoint_model, pool_filler):
    """--kv-offload disk, the pool folder fills up while a stream runs: the next request's stream (its first
    chunk already sent) ends with the error event and nothing after; the running stream finishes."""
    model, tok = checkpoint_model
    folder, fill = pool_filler
    eng = _slow(Engine(model, make_policy("full"), Placement(kv_offload="disk", pool_dir=str(folder))), 0.01)
    long = {"model": NAME, "prompt": list(range(3, 20)), "max_tokens": 60, "temperature": 0, "stream": True}
    chat = {**OK_CHAT, "max_tokens": 20, "stream": True}
    with BackgroundServer(create_app(eng, tok, NAME)) as url:
        started = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(_read_stream, url, C, long, started)
            assert started.wait(30)
            fill()
            events = _read_stream(url, CHAT, chat)
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            err = _ends_with_error(events)
            assert "No space left" in err["message"] or "cannot reserve" in err["message"]
            other = running.result(timeout=60)
        assert other[-1] == "[DONE]" and other[-2]["choices"][0]["finish_reason"] == "length"
        text = "".join(e["choices"][0]["text"] for e in other[:-1])
        ref = _greedy(model, long["prompt"], 60, set())
        assert text == tok.decode(ref, skip_special_tokens=True)
        assert _wait(lambda: _kv_free(eng))
        assert _metric(url, "error") == 1 and _metric(url, "length") == 1


def test_error_in_a_step_ends_that_stream_only(checkpoint_model, monkeypatch):
    """An exception while the engine samples one request's token (mid-stream, after some text was sent): that
    stream's last event is the error; a greedy stream decoded in the same steps goes on to [DONE] with the
    tokens it gets alone; the server keeps serving."""
    import infinigen.serve.engine as engine_module
    model, tok = checkpoint_model
    eng = _slow(Engine(model, make_policy("full")), 0.01)
    real, calls = engine_module.sample, []

    def sample(logits, s, generator):
        if s.seed == 13:
            calls.append(1)
            if len(calls) == 6:
                raise RuntimeError("injected sampling failure")
        return real(logits, s, generator)
    monkeypatch.setattr(engine_module, "sample", sample)
    greedy = {"model": NAME, "prompt": list(range(3, 20)), "max_tokens": 40, "temperature": 0, "stream": True}
    doomed = {"model": NAME, "prompt": list(range(30, 40)), "max_tokens": 40, "temperature": 0.9, "seed": 13,
              "stream": True}
    with BackgroundServer(create_app(eng, tok, NAME)) as url:
        started = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(_read_stream, url, C, greedy, started)
            assert started.wait(30)
            events = _read_stream(url, C, doomed)
            other = running.result(timeout=60)
        err = _ends_with_error(events)
        assert "injected sampling failure" in err["message"] and err["type"] == "server_error"
        assert len(calls) == 6 and len(events) >= 2  # text was streamed before the failure
        assert other[-1] == "[DONE]"
        text = "".join(e["choices"][0]["text"] for e in other[:-1])
        assert text == tok.decode(_greedy(model, greedy["prompt"], 40, set()), skip_special_tokens=True)
        assert httpx.post(f"{url}{C}", json={**OK}, timeout=30).status_code == 200
        assert _wait(lambda: _kv_free(eng))
        assert _metric(url, "error") == 1


# ---- 4. the command: port and budgets before loading, signals --------------------------------------------------
@pytest.fixture
def no_model_load(monkeypatch):
    """Loading the model fails the test: the error had to come before it."""
    import infinigen.commands.basic as basic

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the bad input was noticed")
    monkeypatch.setattr(basic, "load_model", refuse)


def test_busy_or_unbindable_port_fails_before_loading(cli, tiny_checkpoint, no_model_load):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        one_line_error(*cli("serve", "--model", tiny_checkpoint, "--port", port)[::2], f"127.0.0.1:{port}", "in use")
    one_line_error(*cli("serve", "--model", tiny_checkpoint, "--host", "192.0.2.1", "--port", 0)[::2], "192.0.2.1")
    one_line_error(*cli("serve", "--model", tiny_checkpoint, "--host", "no-such-host.invalid", "--port", 0)[::2],
                   "no-such-host.invalid")


def test_budgets_that_cannot_hold_a_token_fail_before_loading(cli, tiny_checkpoint, no_model_load):
    """The tiny model's token is 2 layers x 2 KV heads x 8 x (K, V) x 4 bytes = 256 bytes in float32."""
    m = ["serve", "--model", tiny_checkpoint, "--port", 0, "--dtype", "float32"]
    one_line_error(*cli(*m, "--kv-offload", "disk", "--pool-bytes", "100")[::2], "--pool-bytes", "256 bytes")
    one_line_error(*cli(*m, "--fast-bytes", "200")[::2], "--fast-bytes", "256 bytes")
    one_line_error(*cli(*m, "--pool-bytes", "255")[::2], "--pool-bytes")


def test_budgets_checked_after_loading_too(tiny_checkpoint):
    """A budget that holds a token's KV but not a whole request (the store's positions, the policy state):
    still refused before serving, in one line after the warm-up's progress lines (a subprocess: a server that
    started would not return)."""
    r = subprocess.run(console("serve", "--model", tiny_checkpoint, "--port", 0, "--fast-bytes", "300"),
                       capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    progress = [line for line in r.stderr.splitlines() if line.startswith("infinigen: loading: ")]
    assert progress, r.stderr
    rest = "".join(line + "\n" for line in r.stderr.splitlines() if line not in progress)
    one_line_error(r.returncode, rest, "one prompt token and one new token")


def _start(tiny_checkpoint, *extra):
    """`infinigen serve` in a subprocess on a port the system picks; (process, url) once it answers."""
    argv = console("serve", "--model", tiny_checkpoint, "--served-model-name", NAME, "--port", 0, *extra)
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = []
    for line in p.stderr:
        lines.append(line)
        m = re.search(r"serving \S+ on (http://[^/]+)/v1", line)
        if m:
            url = m.group(1)
            break
    else:
        p.wait(timeout=30)
        pytest.fail(f"the server did not start ({p.returncode}): {''.join(lines)}")
    assert _wait(lambda: _answers(url), timeout=60)
    return p, url


def _answers(url) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_busy_port_in_the_console_script(tiny_checkpoint):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = subprocess.run(console("serve", "--model", tiny_checkpoint, "--port", port), capture_output=True,
                           text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr
    expected = f"infinigen: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert r.stderr.strip().splitlines() == [expected]


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signals_stop_the_console_script(tiny_checkpoint, sig, code):
    """A served request, then the signal: SIGTERM exits 0, SIGINT 130 ("interrupted"), no traceback, and the
    port is free again."""
    p, url = _start(tiny_checkpoint)
    try:
        r = httpx.post(f"{url}{C}", json={**OK, "max_tokens": 5}, timeout=60)
        assert r.status_code == 200
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == code, err
    assert "Traceback" not in err
    assert ("interrupted" in err) == (sig == signal.SIGINT)
    host, port = url[7:].split(":")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, int(port)))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_or_cancels_running_requests(checkpoint_model, sig):
    """The command's serving loop in this process (its main thread), a slowed engine, a stream and a plain
    request running when the signal comes: SIGTERM lets both finish (the stream ends with [DONE], the plain
    request gets its answer); SIGINT cancels both at once (an error event ends the stream, the plain request
    gets a 503), and the loop reports which signal stopped it."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals need the main thread")
    from infinigen.commands.serve import _listen, _serve
    model, tok = checkpoint_model
    eng = _slow(Engine(model, make_policy("full")), 0.02)  # 80 tokens: about 2 s
    app = create_app(eng, tok, NAME)
    listener = _listen("127.0.0.1", 0)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    body = {"model": NAME, "prompt": list(range(3, 20)), "max_tokens": 80, "temperature": 0}
    results: dict = {}

    def client():
        try:
            assert _wait(lambda: _answers(url), timeout=30)
            started = threading.Event()
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                stream = pool.submit(_read_stream, url, C, {**body, "stream": True}, started)
                plain = pool.submit(httpx.post, f"{url}{C}", json=body, timeout=60)
                assert started.wait(30) and _wait(lambda: eng.snapshot()["running"] == 2)
                results["signalled"] = time.monotonic()
                os.kill(os.getpid(), sig)
                results["stream"] = stream.result(timeout=60)
                results["plain"] = plain.result(timeout=60)
                results["done"] = time.monotonic()
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            results["error"] = e
        finally:
            time.sleep(0.5)
            if "signalled" not in results:
                os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=client, daemon=True)
    t.start()
    stopped_by = _serve(app, listener, "127.0.0.1", listener.getsockname()[1])
    t.join(timeout=60)
    if "error" in results:
        raise results["error"]
    assert stopped_by == sig
    events, plain = results["stream"], results["plain"]
    if sig == signal.SIGTERM:
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 80
    else:
        assert _ends_with_error(events)["code"] == "server_shutting_down"
        assert plain.status_code == 503 and _error_shape(plain.json())["code"] == "server_shutting_down"
        assert results["done"] - results["signalled"] < 1.0  # not the 1.6 s the rest of the tokens take
    assert eng.idle()
