"""The OpenAI-compatible HTTP API over an `Engine`.

Routes: GET /health, /metrics (Prometheus), /v1/models; POST /v1/completions, /v1/chat/completions
(`stream: true` answers with server-sent events, `data: {...}` chunks and a final `data: [DONE]`).
Errors carry OpenAI's body: {"error": {"message", "type", "param", "code"}}; every input error is a 400,
a body over `max_body` bytes a 413, a full waiting queue a 429.

The engine loop runs in its own thread; a request's tokens come back through an asyncio queue fed with
`loop.call_soon_threadsafe`. A client that goes away cancels its request, which frees its KV slots.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from typing import Literal, Optional, Union

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import UserError
from ..generate import Sampling
from .engine import Engine, QueueFull, Request

MAX_BODY = 1 << 20  # bytes
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
CHAT_MAX_TOKENS = 512  # chat requests without max_tokens: this many, or what the context leaves


# ---- request bodies ---------------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (user, n=1, ...)
    model: str
    max_tokens: Optional[int] = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: Optional[int] = Field(None, ge=0, le=2 ** 63 - 1)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[dict] = None
    n: int = Field(1, ge=1, le=1)


class CompletionBody(_Body):
    prompt: Union[str, list[int], list[str]]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict]]


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None


# ---- errors ------------------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status)


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit` bytes (by Content-Length, or counted as it streams in).
    The body is read before the app runs and replayed to it; later receives (the client going away)
    pass through."""

    def __init__(self, app, limit: int = MAX_BODY):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        too_big = error_response(413, f"the request body is over {self.limit} bytes", code="body_too_large")
        try:
            if length is not None and int(length) > self.limit:
                return await too_big(scope, receive, send)
        except ValueError:
            return await error_response(400, "bad Content-Length")(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.limit:
                return await too_big(scope, receive, send)
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


# ---- the app -----------------------------------------------------------------------------------------------
def create_app(engine: Engine, tokenizer, model_name: str, max_body: int = MAX_BODY) -> FastAPI:
    """The FastAPI app serving `engine` as model `model_name`. The engine thread starts with the app (or
    the first request) and stops when the app shuts down."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="infinigen", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=max_body)
    app.state.engine = engine
    created = int(time.time())
    context = engine.model.cfg.max_position
    registry = _registry(engine)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        err = (e.errors() or [{}])[0]
        if err.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", code="invalid_json")
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = err.get("msg", "invalid request")
        return error_response(400, f"{param}: {msg}" if param else msg, param=param, code=err.get("type"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error")

    @app.get("/health")
    async def health():
        s = engine.snapshot()
        return {"status": "ok", "running": s["running"], "waiting": s["waiting"], "pid": os.getpid()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "infinigen", "max_model_len": context}]}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import generate_latest
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    def check_model(body: _Body):
        if body.model != model_name:
            raise APIError(400, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def max_tokens(body: _Body, prompt_len: int, default: int) -> int:
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

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HTTPRequest):
        check_model(body)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise APIError(400, "one prompt per request", param="prompt")
            p = p[0]
        if isinstance(p, str):
            if not p.strip():
                raise APIError(400, "the prompt is empty", param="prompt")
            ids = list(tokenizer(p)["input_ids"])
        else:
            ids = list(p)
            if any(i < 0 or i >= engine.model.cfg.vocab_size for i in ids):
                raise APIError(400, "a prompt token id is out of the vocabulary", param="prompt")
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        return await serve(body, http, ids, max_tokens(body, len(ids), DEFAULT_MAX_TOKENS), stops(body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: HTTPRequest):
        check_model(body)
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"the model {model_name!r} has no chat template; use /v1/completions", param="messages")
        messages = []
        for m in body.messages:
            content = m.content if isinstance(m.content, str) else "".join(
                part.get("text", "") for part in m.content if part.get("type") == "text")
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as e:  # a template that refuses the roles given, say
            raise APIError(400, f"the chat template refused the messages: {e}", param="messages")
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return await serve(body, http, list(ids), max_tokens(body, len(ids), CHAT_MAX_TOKENS), stops(body), chat=True)

    async def serve(body: _Body, http: HTTPRequest, ids: list[int], n: int, stop: list[str], chat: bool):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(kind, value):  # engine thread -> this request's queue
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                pass

        req = Request(ids, n, Sampling(temperature=body.temperature, top_p=body.top_p, seed=body.seed), sink)
        try:
            engine.start()
            engine.submit(req)
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {e}", "rate_limit_error", code="rate_limit_exceeded")
        except UserError as e:
            raise APIError(400, str(e))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        text = _Text(tokenizer, stop)
        if body.stream:
            from sse_starlette.sse import EventSourceResponse
            usage = bool((body.stream_options or {}).get("include_usage"))
            return EventSourceResponse(stream(req, queue, text, rid, chat, usage), ping=15)
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        return Response(status_code=499)  # nobody to answer; `finally` frees the row
                    continue
                if kind == "token":
                    if text.add(value):
                        break
                elif kind == "error":
                    raise APIError(500, str(value), "server_error")
                else:
                    break
        finally:
            engine.cancel(req)  # a no-op once finished
        reason = "stop" if text.stopped or req.finish == "stop" else "length"
        return response(rid, chat, text.finish(), reason, _usage(ids, req))

    def response(rid, chat, content, reason, usage):
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                      "finish_reason": reason}
            return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                    "choices": [choice], "usage": usage}
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": 0, "text": content, "logprobs": None, "finish_reason": reason}], "usage": usage}

    def chunk(rid, chat, delta: str | None, reason=None, first=False):
        if chat:
            d = {"role": "assistant", "content": ""} if first else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
        return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model_name, "choices": [choice]}

    async def stream(req: Request, queue: asyncio.Queue, text: "_Text", rid: str, chat: bool, usage: bool):
        """SSE events; the generator is cancelled when the client goes away, which cancels the request."""
        try:
            if chat:
                yield {"data": json.dumps(chunk(rid, chat, None, first=True))}
            while True:
                kind, value = await queue.get()
                if kind == "token":
                    stopped = text.add(value)
                    delta = text.take()
                    if delta:
                        yield {"data": json.dumps(chunk(rid, chat, delta))}
                    if stopped:
                        engine.cancel(req)
                        break
                elif kind == "error":
                    yield {"data": json.dumps({"error": {"message": str(value), "type": "server_error",
                                                         "param": None, "code": None}})}
                    break
                else:
                    break
            rest = text.finish()
            if rest:
                yield {"data": json.dumps(chunk(rid, chat, rest))}
            reason = "stop" if text.stopped or req.finish == "stop" else "length"
            yield {"data": json.dumps(chunk(rid, chat, None, reason))}
            if usage:
                yield {"data": json.dumps({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                           "created": int(time.time()), "model": model_name, "choices": [],
                                           "usage": _usage(req.prompt, req)})}
            yield {"data": "[DONE]"}
        finally:
            engine.cancel(req)  # the client went away (or we are done): free the row now

    return app


def _usage(ids, req: Request) -> dict:
    return {"prompt_tokens": len(ids), "completion_tokens": len(req.tokens), "total_tokens": len(ids) + len(req.tokens)}


class _Text:
    """A request's text as tokens arrive: decoded whole (multi-token characters come out right), cut at
    the first stop string; `take` hands out what is safe to show (a possible start of a stop string and
    an incomplete character are held back)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop, self.ids = tokenizer, stop, []
        self.text, self.shown, self.stopped = "", 0, False
        self.hold = max((len(s) for s in stop), default=1) - 1

    def add(self, token: int) -> bool:
        """Add a token; True once a stop string appeared (the text then ends before it)."""
        if self.stopped:
            return True
        self.ids.append(token)
        self.text = self.tok.decode(self.ids, skip_special_tokens=True)
        cut = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if cut:
            self.text, self.stopped = self.text[:min(cut)], True
        return self.stopped

    def take(self) -> str:
        end = len(self.text) if self.stopped else len(self.text) - self.hold
        if not self.stopped:
            end = min(end, len(self.text.rstrip("\ufffd")))  # an incomplete character waits for its bytes
        if end <= self.shown:
            return ""
        out, self.shown = self.text[self.shown:end], end
        return out

    def finish(self) -> str:
        """Everything not shown yet (the whole text of a non-streamed answer)."""
        out, self.shown = self.text[self.shown:], len(self.text)
        return out


def _registry(engine: Engine):
    """A Prometheus registry of its own (several apps may live in one process) reading the engine's numbers."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    class Collector:
        def collect(self):
            s = engine.snapshot()
            c = CounterMetricFamily("infinigen_requests", "Requests by outcome", labels=["outcome"])
            for outcome in ("stop", "length", "cancelled", "error"):
                c.add_metric([outcome], s.get("requests_" + outcome, 0))
            c.add_metric(["rejected"], s.get("rejected", 0))
            yield c
            yield CounterMetricFamily("infinigen_prompt_tokens", "Prompt tokens prefilled", value=s.get("prompt_tokens", 0))
            yield CounterMetricFamily("infinigen_generation_tokens", "Tokens generated", value=s.get("completion_tokens", 0))
            yield GaugeMetricFamily("infinigen_tokens_per_second", "Tokens generated per second over the last 10 s",
                                    value=s["tokens_per_s"])
            yield GaugeMetricFamily("infinigen_requests_running", "Requests in the decoding batch", value=s["running"])
            yield GaugeMetricFamily("infinigen_requests_waiting", "Requests waiting for KV memory", value=s["waiting"])
            sizes = dict(engine.batch_sizes)  # a copy: the engine thread may add a size meanwhile
            bounds = sorted({1 << i for i in range(engine.max_batch.bit_length())} | {engine.max_batch})
            yield HistogramMetricFamily("infinigen_decode_batch_size", "Requests decoded together per step",
                                        buckets=[(str(b), sum(c for n, c in sizes.items() if n <= b)) for b in bounds]
                                        + [("+Inf", sum(sizes.values()))],
                                        sum_value=sum(n * c for n, c in sizes.items()))
            for name, what, key in (("infinigen_kv_bytes", "KV bytes held by running requests", "kv_{}_bytes"),
                                    ("infinigen_kv_reserved_bytes", "KV bytes reserved by running requests", "reserved_{}_bytes"),
                                    ("infinigen_kv_budget_bytes", "KV bytes the server admits requests up to", "{}_budget_bytes")):
                g = GaugeMetricFamily(name, what, labels=["tier"])
                for tier in ("fast", "slow"):
                    g.add_metric([tier], s[key.format(tier)])
                yield g

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return registry


class BackgroundServer:
    """uvicorn serving `app` on a thread of this process (tests, benchmarks): `with BackgroundServer(app) as url:`.
    Port 0 picks a free port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
        self.thread = None

    def __enter__(self) -> str:
        import threading
        self.thread = threading.Thread(target=self.server.run, name="infinigen-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
