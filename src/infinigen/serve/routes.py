"""The server's routes, plain functions over the engine: each finds what it serves (`Served`: the engine, the
tokenizer, the model's name) on the app it was called through, `request.app.state.served`.

A completion is checked (`check_body`, `max_tokens`, `stops`), submitted to the engine with a sink that
feeds an asyncio queue from the engine's thread, and answered whole (`answer_whole`) or as server-sent events
(`answer_stream`).
"""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass, field

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from ..errors import UserError
from ..generate import Sampling
from .answer import Answer, Pieces
from .engine import Engine, QueueFull, Request
from .protocol import UNSUPPORTED, APIError, ChatBody, CompletionBody, _Body, error_body

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
CHAT_MAX_TOKENS = 512  # chat requests without max_tokens: this many, or what the context leaves
ECHO_LOGITS_BYTES = 256 << 20  # echo + logprobs: float32 logits of every prompt position, at most this many bytes
DRAIN_S = 30  # server shutdown (SIGTERM): how long running streams may go on before they are cut


@dataclass
class Served:
    """What the routes serve: the engine, its tokenizer, the name clients ask for, and the /metrics registry."""
    engine: Engine
    tokenizer: object
    model_name: str
    registry: object
    pieces: Pieces = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.pieces = Pieces(self.tokenizer)

    @property
    def context(self) -> int:
        return self.engine.model.cfg.max_position

    @property
    def vocab(self) -> int:
        return self.engine.model.cfg.vocab_size


def _served(http: HTTPRequest) -> Served:
    return http.app.state.served


# ---- GET ---------------------------------------------------------------------------------------------------
async def health(http: HTTPRequest):
    s = _served(http).engine.snapshot()
    return {"status": "ok", "running": s["running"], "waiting": s["waiting"], "pid": os.getpid()}


async def models(http: HTTPRequest):
    srv = _served(http)
    return {"object": "list", "data": [{"id": srv.model_name, "object": "model", "created": srv.created,
                                        "owned_by": "infinigen", "max_model_len": srv.context}]}


async def metrics(http: HTTPRequest):
    from prometheus_client import generate_latest
    return Response(generate_latest(_served(http).registry), media_type="text/plain; version=0.0.4; charset=utf-8")


# ---- checks every completion shares ------------------------------------------------------------------------
def check_body(srv: Served, body: _Body) -> None:
    if body.model != srv.model_name:
        raise APIError(400, f"the model {body.model!r} does not exist; this server serves {srv.model_name!r}",
                       param="model", code="model_not_found")
    for name, neutral in UNSUPPORTED.items():
        value = getattr(body, name, None)
        if value is not None and not any(value == x for x in neutral):
            raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")


def max_tokens(srv: Served, body: _Body, prompt_len: int, default: int) -> int:
    context = srv.context
    n = body.max_tokens if body.max_tokens is not None else getattr(body, "max_completion_tokens", None)
    if n is None:
        n = max(1, min(default, context - prompt_len))
    if n < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {n}", param="max_tokens", code="invalid_value")
    if prompt_len + n > context:
        raise APIError(400, f"this model's context is {context} tokens; the prompt has {prompt_len} and max_tokens "
                            f"is {n}", param="max_tokens" if prompt_len < context else "prompt",
                       code="context_length_exceeded")
    return n


def stops(body: _Body) -> list[str]:
    s = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(s) > 4 or any(not x for x in s):
        raise APIError(400, "stop takes up to 4 non-empty strings", param="stop")
    return s


# ---- POST --------------------------------------------------------------------------------------------------
def _prompt_ids(srv: Served, body: CompletionBody) -> tuple[str | list[int], list[int]]:
    """The one prompt of a completion body, as sent and as token ids."""
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise APIError(400, "one prompt per request", param="prompt")
        p = p[0]
    if isinstance(p, str):
        if not p.strip():
            raise APIError(400, "the prompt is empty", param="prompt")
        ids = list(srv.tokenizer(p)["input_ids"])
    else:
        ids = list(p)
        if any(i < 0 or i >= srv.vocab for i in ids):
            raise APIError(400, "a prompt token id is out of the vocabulary", param="prompt")
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return p, ids


async def completions(body: CompletionBody, http: HTTPRequest):
    srv = _served(http)
    check_body(srv, body)
    p, ids = _prompt_ids(srv, body)
    echo = None
    if body.echo:
        echo = p if isinstance(p, str) else srv.tokenizer.decode(ids)
        if body.logprobs is not None and len(ids) * srv.vocab * 4 > ECHO_LOGITS_BYTES:
            raise APIError(400, f"echo with logprobs keeps the logits of every prompt position: at most "
                                f"{ECHO_LOGITS_BYTES // (srv.vocab * 4)} prompt tokens with this model's vocabulary, "
                                f"the prompt has {len(ids)}", param="echo")
    n = max_tokens(srv, body, len(ids), DEFAULT_MAX_TOKENS)
    return await answer(srv, body, http, ids, n, stops(body), chat=False, logprobs=body.logprobs, echo=echo)


async def chat(body: ChatBody, http: HTTPRequest):
    srv = _served(http)
    tokenizer = srv.tokenizer
    check_body(srv, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, f"the model {srv.model_name!r} has no chat template; use /v1/completions",
                       param="messages")
    messages = []
    for m in body.messages:
        content = m.content if isinstance(m.content, str) else "".join(part.text for part in m.content)
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception as e:  # a template that refuses the roles given, say
        raise APIError(400, f"the chat template refused the messages: {e}", param="messages")
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return await answer(srv, body, http, list(ids), max_tokens(srv, body, len(ids), CHAT_MAX_TOKENS), stops(body),
                        chat=True, logprobs=logprobs)


# ---- answering ---------------------------------------------------------------------------------------------
async def answer(srv: Served, body: _Body, http: HTTPRequest, ids: list[int], n: int, stop: list[str], chat: bool,
                 logprobs: int | None = None, echo: str | None = None):
    """Submit the request to the engine; answer whole, or as a stream of events."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def sink(kind, value):  # engine thread -> this request's queue
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    sampling = Sampling(temperature=1.0 if body.temperature is None else body.temperature,
                        top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed)
    scores_prompt = echo is not None and logprobs is not None
    req = Request(ids, n, sampling, sink, logprobs=logprobs, prompt_logprobs=scores_prompt)
    try:
        srv.engine.start()
        srv.engine.submit(req)
    except QueueFull as e:
        raise APIError(429, f"the server is busy: {e}", "rate_limit_error", code="rate_limit_exceeded")
    except UserError as e:
        raise APIError(400, str(e))
    out = Answer(req, srv.tokenizer, srv.pieces, stop, chat, echo)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    if body.stream:
        from sse_starlette.sse import EventSourceResponse
        usage = bool(body.stream_options and body.stream_options.include_usage)
        # sse-starlette cuts every stream as soon as uvicorn is told to exit; a draining server lets them end
        return EventSourceResponse(answer_stream(srv, req, queue, out, rid, usage), ping=15,
                                   shutdown_grace_period=DRAIN_S)
    return await answer_whole(srv, http, req, queue, out, rid)


async def answer_whole(srv: Served, http: HTTPRequest, req: Request, queue: asyncio.Queue, out: Answer, rid: str):
    """A non-streamed answer: the tokens gathered until the request ends (or its text reaches a stop string)."""
    watcher = asyncio.create_task(cancel_on_disconnect(srv.engine, http, req))
    try:
        while True:
            kind, value = await queue.get()
            if kind == "token":
                if out.text.add(value):
                    srv.engine.cancel(req, "stop")
                    break
            elif kind == "error":
                raise APIError(500, str(value), "server_error")
            elif value == "cancelled":  # the client went away (nobody reads this), or the server is stopping
                raise APIError(503, "the request was cancelled: the server is shutting down", "server_error",
                               code="server_shutting_down")
            else:
                break
    finally:
        watcher.cancel()
        srv.engine.cancel(req)  # a no-op once finished
    text = (out.echo or "") + out.text.finish()
    lp = out.logprobs(len(out.text.text), prompt=out.echo is not None)
    if out.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                  "finish_reason": out.reason()}
    else:
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": out.reason()}
    return {"id": rid, "object": "chat.completion" if out.chat else "text_completion", "created": int(time.time()),
            "model": srv.model_name, "choices": [choice], "usage": _usage(req.prompt, req)}


async def cancel_on_disconnect(engine: Engine, http: HTTPRequest, req: Request):
    """A non-streamed request: the client going away (http.disconnect on the ASGI receive channel, once the
    body is read) cancels it at once; the engine drops it before its next step."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    engine.cancel(req)


def _chunk(srv: Served, rid: str, chat: bool, delta: str | None, reason=None, first=False, logprobs=None):
    if chat:
        d = {"role": "assistant", "content": ""} if first else ({} if delta is None else {"content": delta})
        choice = {"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": delta or "", "logprobs": logprobs, "finish_reason": reason}
    return {"data": json.dumps({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                "created": int(time.time()), "model": srv.model_name, "choices": [choice]})}


async def answer_stream(srv: Served, req: Request, queue: asyncio.Queue, out: Answer, rid: str, usage: bool):
    """SSE events; the generator is cancelled when the client goes away, which cancels the request. An error
    ends the stream: its event is the last (no finish chunk, no [DONE])."""
    chat, text = out.chat, out.text
    try:
        if chat:
            yield _chunk(srv, rid, chat, None, first=True)
        while True:
            kind, value = await queue.get()
            if kind == "error":
                yield {"data": json.dumps(error_body(str(value), "server_error"))}
                return
            if kind == "done" and value == "cancelled":  # not the client (its generator is gone): a shutdown
                yield {"data": json.dumps(error_body("the request was cancelled: the server is shutting down",
                                                     "server_error", code="server_shutting_down"))}
                return
            if out.echo is not None and not out.echoed:  # the prompt's log-probabilities came with the first token
                out.echoed = True
                yield _chunk(srv, rid, chat, out.echo, logprobs=out.logprobs(0, prompt=True))
            if kind == "done":
                break
            stopped = text.add(value)
            delta = text.take()
            if delta:
                yield _chunk(srv, rid, chat, delta, logprobs=out.logprobs(text.shown))
            if stopped:
                srv.engine.cancel(req, "stop")
                break
        rest = text.finish()
        lp = out.logprobs(len(text.text))
        if rest or out.has_entries(lp):
            yield _chunk(srv, rid, chat, rest, logprobs=lp)
        yield _chunk(srv, rid, chat, None, out.reason())
        if usage:
            yield {"data": json.dumps({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                       "created": int(time.time()), "model": srv.model_name, "choices": [],
                                       "usage": _usage(req.prompt, req)})}
        yield {"data": "[DONE]"}
    finally:
        srv.engine.cancel(req)  # the client went away (or we are done): free the row now


def _usage(ids, req: Request) -> dict:
    return {"prompt_tokens": len(ids), "completion_tokens": len(req.tokens), "total_tokens": len(ids) + len(req.tokens)}
