"""The OpenAI-compatible HTTP API over an `Engine`.

Routes: GET /health, /metrics (Prometheus), /v1/models; POST /v1/completions, /v1/chat/completions
(`stream: true` answers with server-sent events, `data: {...}` chunks and a final `data: [DONE]`).

Errors carry OpenAI's body: {"error": {"message", "type", "param", "code"}}. Every malformed body is a 400
whose `param` names the field at fault; so is a field OpenAI does not know, and an OpenAI field this server
does not implement (`UNSUPPORTED`: tools, response_format, logit_bias, ...) unless it holds its no-op value.
A body over `max_body` bytes is a 413, a full waiting queue a 429; a bug is a JSON 500, and the connection
serves on.

`logprobs` / `top_logprobs` (both routes) and `echo` (completions) are OpenAI's shapes; the numbers are the
model's own log-probabilities (log_softmax of the raw logits, before temperature and top_p). echo with
logprobs scores the prompt from a prefill that keeps every position's logits (`ECHO_LOGITS_BYTES` bounds it).

The engine loop runs in its own thread; a request's tokens come back through an asyncio queue fed with
`loop.call_soon_threadsafe`. A client that goes away cancels its request before the engine's next step,
which frees its KV: a stream's generator is cancelled, a plain request watches the ASGI receive channel for
`http.disconnect`. An error ends a stream: its error event is the last one. A server told to stop at once
(SIGINT) cancels the running requests: their clients get a 503, or an error event.
"""
from __future__ import annotations

import asyncio
import codecs
import json
import logging
import os
import re
import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, field_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import UserError
from ..generate import Sampling
from .engine import Engine, QueueFull, Request

log = logging.getLogger("infinigen.serve")

MAX_BODY = 1 << 20  # bytes
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
CHAT_MAX_TOKENS = 512  # chat requests without max_tokens: this many, or what the context leaves
ECHO_LOGITS_BYTES = 256 << 20  # echo + logprobs: float32 logits of every prompt position, at most this many bytes
DRAIN_S = 30  # server shutdown (SIGTERM): how long running streams may go on before they are cut


# ---- request bodies ---------------------------------------------------------------------------------------
def _unicode(text: str) -> str:
    """JSON's \ud800 escapes decode to lone surrogates, which no tokenizer (or UTF-8 encoder) takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError("invalid_unicode", "the text holds a lone surrogate (not valid Unicode)")
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # OpenAI refuses arguments it does not know; so do we


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None
    include_obfuscation: Optional[bool] = None  # accepted and ignored: padding against length side channels


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: Text

    @field_validator("type")
    @classmethod
    def _only_text(cls, v: str) -> str:
        if v != "text":
            raise PydanticCustomError("unsupported_content", "content parts of type '{t}' are not supported; only "
                                      "'text' parts are", {"t": v})
        return v


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients replay whole messages (name, refusal: null, ...)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[Text, list[TextPart]]


# OpenAI fields this server does not implement: refused (400 naming the field) unless null or their no-op value
UNSUPPORTED = {"tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
               "parallel_tool_calls": (), "response_format": ({"type": "text"},), "logit_bias": ({},),
               "presence_penalty": (0,), "frequency_penalty": (0,), "best_of": (1,), "suffix": ("",),
               "audio": (), "modalities": (["text"],), "prediction": (), "reasoning_effort": (),
               "web_search_options": ()}


class _Body(_Strict):
    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    seed: Optional[int] = Field(None, ge=0, le=2 ** 63 - 1)
    stop: Union[Text, list[Text], None] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = Field(None, ge=1, le=1)
    # accepted and ignored: they do not change the answer
    user: Optional[str] = None
    metadata: Optional[dict] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    # refused unless neutral (UNSUPPORTED)
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None


class CompletionBody(_Body):
    prompt: Union[Text, list[int], list[Text], list[list[int]]]
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=5)
    echo: Optional[bool] = None
    best_of: Any = None
    suffix: Any = None


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None


def _field_names(*models) -> frozenset:
    """Every field name of these body models and the models inside them (what an error's `param` may name)."""
    names, todo = set(), list(models)
    while todo:
        m = todo.pop()
        for name, f in m.model_fields.items():
            names.add(name)
            todo += [t for t in _types(f.annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
    return frozenset(names)


def _types(tp) -> list:
    args = getattr(tp, "__args__", None) or ()
    return [tp] + [x for a in args for x in _types(a)]


FIELDS = _field_names(CompletionBody, ChatBody)


# ---- errors ------------------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                   headers: dict | None = None):
    # ASCII-escaped: a message quoting the client's text is sent whatever that text holds
    return Response(json.dumps(error_body(message, type_, param, code)), status_code=status,
                    media_type="application/json", headers=headers)


def validation_error(errors: list[dict]) -> APIError:
    """One 400 for a body that does not validate: the most specific error of the first field at fault. Its
    `param` is the path of field names and list indices (pydantic's union branch labels left out)."""
    if not errors:
        return APIError(400, "invalid request")

    def path(err):
        loc = [x for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "extra_forbidden":  # the unknown name itself is the last element
            return [x for x in loc[:-1] if isinstance(x, int) or x in FIELDS] + loc[-1:]
        return [x for x in loc if isinstance(x, int) or x in FIELDS]

    first = path(errors[0])[:1]
    err = max((e for e in errors if path(e)[:1] == first), key=lambda e: len(e.get("loc", ())))  # first of the deepest
    param = ".".join(str(x) for x in path(err)) or None
    if err.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    if err.get("type") == "extra_forbidden":
        return APIError(400, f"unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    msg = err.get("msg", "invalid request")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code=err.get("type"))


class ServerErrors:
    """ASGI middleware: an exception the routes did not turn into an answer is logged and answered with a JSON
    500 (OpenAI's body), and the connection stays usable (Starlette's own handler re-raises, and uvicorn then
    drops the connection). After the response started (a stream), the stream just ends."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(msg):
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            log.exception("unhandled error serving %s", scope.get("path"))
            if not started:
                await error_response(500, "internal server error", "server_error")(scope, receive, send)


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
    app.add_middleware(ServerErrors)  # added last: outside BodyLimit
    app.state.engine = engine
    created = int(time.time())
    context, vocab = engine.model.cfg.max_position, engine.model.cfg.vocab_size
    registry = _registry(engine)
    pieces = _Pieces(tokenizer)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        return await _api_error(request, validation_error(e.errors()))

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

    def check_body(body: _Body):
        if body.model != model_name:
            raise APIError(400, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        for name, neutral in UNSUPPORTED.items():
            value = getattr(body, name, None)
            if value is not None and not any(value == x for x in neutral):
                raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")

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
        check_body(body)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "one prompt per request", param="prompt")
            p = p[0]
        if isinstance(p, str):
            if not p.strip():
                raise APIError(400, "the prompt is empty", param="prompt")
            ids = list(tokenizer(p)["input_ids"])
        else:
            ids = list(p)
            if any(i < 0 or i >= vocab for i in ids):
                raise APIError(400, "a prompt token id is out of the vocabulary", param="prompt")
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        echo = None
        if body.echo:
            echo = p if isinstance(p, str) else tokenizer.decode(ids)
            if body.logprobs is not None and len(ids) * vocab * 4 > ECHO_LOGITS_BYTES:
                raise APIError(400, f"echo with logprobs keeps the logits of every prompt position: at most "
                                    f"{ECHO_LOGITS_BYTES // (vocab * 4)} prompt tokens with this model's vocabulary, "
                                    f"the prompt has {len(ids)}", param="echo")
        n = max_tokens(body, len(ids), DEFAULT_MAX_TOKENS)
        return await serve(body, http, ids, n, stops(body), chat=False, logprobs=body.logprobs, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: HTTPRequest):
        check_body(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"the model {model_name!r} has no chat template; use /v1/completions", param="messages")
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
        return await serve(body, http, list(ids), max_tokens(body, len(ids), CHAT_MAX_TOKENS), stops(body), chat=True,
                           logprobs=logprobs)

    async def serve(body: _Body, http: HTTPRequest, ids: list[int], n: int, stop: list[str], chat: bool,
                    logprobs: int | None = None, echo: str | None = None):
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
            engine.start()
            engine.submit(req)
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {e}", "rate_limit_error", code="rate_limit_exceeded")
        except UserError as e:
            raise APIError(400, str(e))
        out = _Answer(req, tokenizer, pieces, stop, chat, echo)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if body.stream:
            from sse_starlette.sse import EventSourceResponse
            usage = bool(body.stream_options and body.stream_options.include_usage)
            # sse-starlette cuts every stream as soon as uvicorn is told to exit; a draining server lets them end
            return EventSourceResponse(stream(req, queue, out, rid, usage), ping=15, shutdown_grace_period=DRAIN_S)
        watcher = asyncio.create_task(cancel_on_disconnect(http, req))
        try:
            while True:
                kind, value = await queue.get()
                if kind == "token":
                    if out.text.add(value):
                        engine.cancel(req, "stop")
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
            engine.cancel(req)  # a no-op once finished
        text = (echo or "") + out.text.finish()
        lp = out.logprobs(len(out.text.text), prompt=echo is not None)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                      "finish_reason": out.reason()}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": out.reason()}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model_name, "choices": [choice], "usage": _usage(ids, req)}

    async def cancel_on_disconnect(http: HTTPRequest, req: Request):
        """A non-streamed request: the client going away (http.disconnect on the ASGI receive channel, once the
        body is read) cancels it at once; the engine drops it before its next step."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        engine.cancel(req)

    def chunk(rid, chat, delta: str | None, reason=None, first=False, logprobs=None):
        if chat:
            d = {"role": "assistant", "content": ""} if first else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": logprobs, "finish_reason": reason}
        return {"data": json.dumps({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                    "created": int(time.time()), "model": model_name, "choices": [choice]})}

    async def stream(req: Request, queue: asyncio.Queue, out: "_Answer", rid: str, usage: bool):
        """SSE events; the generator is cancelled when the client goes away, which cancels the request. An error
        ends the stream: its event is the last (no finish chunk, no [DONE])."""
        chat, text = out.chat, out.text
        try:
            if chat:
                yield chunk(rid, chat, None, first=True)
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
                    yield chunk(rid, chat, out.echo, logprobs=out.logprobs(0, prompt=True))
                if kind == "done":
                    break
                stopped = text.add(value)
                delta = text.take()
                if delta:
                    yield chunk(rid, chat, delta, logprobs=out.logprobs(text.shown))
                if stopped:
                    engine.cancel(req, "stop")
                    break
            rest = text.finish()
            lp = out.logprobs(len(text.text))
            if rest or out.has_entries(lp):
                yield chunk(rid, chat, rest, logprobs=lp)
            yield chunk(rid, chat, None, out.reason())
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


class _Pieces:
    """Each token's own bytes (a byte-level BPE token is a byte sequence; a SentencePiece one a piece or a
    <0xNN> byte) and its text as OpenAI shows it: "bytes:\\xe2\\x80" for a piece of a character."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        decoder = repr(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None))
        self.bytes_of_char = None
        if "ByteLevel" in decoder:
            from transformers.convert_slow_tokenizer import bytes_to_unicode
            self.bytes_of_char = {c: b for b, c in bytes_to_unicode().items()}
        self.metaspace = "Metaspace" in decoder or "▁" in decoder
        self.added = {i: t.content for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token: int) -> bytes:
        b = self._bytes.get(token)
        if b is None:
            b = self._bytes[token] = self._find_bytes(token)
        return b

    def _find_bytes(self, token: int) -> bytes:
        if token in self.added:
            return self.added[token].encode("utf-8")
        piece = self.tok.convert_ids_to_tokens(token)
        if not isinstance(piece, str):
            return self.tok.decode([token]).encode("utf-8")
        if self.bytes_of_char is not None and all(c in self.bytes_of_char for c in piece):
            return bytes(self.bytes_of_char[c] for c in piece)
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if self.metaspace:
            return piece.replace("▁", " ").encode("utf-8")
        return self.tok.decode([token]).encode("utf-8")

    def text(self, token: int) -> str:
        b = self.bytes(token)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

    def offsets(self, tokens: list[int]) -> list[int]:
        """Character offset of each token in the text the tokens spell (a character split over tokens counts
        at the token that completes it)."""
        dec, n, out = codecs.getincrementaldecoder("utf-8")("replace"), 0, []
        for t in tokens:
            out.append(n)
            n += len(dec.decode(self.bytes(t)))
        return out


class _Answer:
    """A request's answer as it is sent: its text (`_Text`) and the log-probabilities of the tokens whose
    text has been sent (a token is in once its text starts before what was shown; the tokens of a stop
    string and the tokens after it never are)."""

    def __init__(self, req: Request, tokenizer, pieces: _Pieces, stop: list[str], chat: bool, echo: str | None):
        self.req, self.pieces, self.chat, self.echo = req, pieces, chat, echo
        self.text = _Text(tokenizer, stop)
        self.echoed = False
        self.sent = 0  # tokens whose log-probabilities went out

    def reason(self) -> str:
        return "stop" if self.text.stopped or self.req.finish == "stop" else "length"

    def logprobs(self, shown: int, prompt: bool = False) -> dict | None:
        """The log-probabilities not sent yet of the tokens whose text starts before character `shown` of the
        answer (and, with `prompt`, of the echoed prompt's tokens first); None when the request asked for none."""
        req = self.req
        if req.logprobs is None:
            return None
        t = self.text
        end = self.sent
        while end < len(t.starts) and end < len(req.token_logprobs) and t.starts[end] < shown:
            end += 1
        ids, entries = t.ids[self.sent:end], req.token_logprobs[self.sent:end]
        base = len(self.echo) if self.echo is not None else 0
        offsets = [base + x for x in t.starts[self.sent:end]]
        self.sent = end
        if prompt and req.prompt_token_logprobs is not None:
            ids, entries = req.prompt + ids, req.prompt_token_logprobs + entries
            offsets = self.pieces.offsets(req.prompt) + offsets
        p = self.pieces
        if self.chat:
            def alt(tok, lp):
                return {"token": p.text(tok), "logprob": lp, "bytes": list(p.bytes(tok))}
            return {"content": [{**alt(tok, lp), "top_logprobs": [alt(a, v) for a, v in top]}
                                for tok, (lp, top) in zip(ids, entries)], "refusal": None}
        out = {"tokens": [p.text(tok) for tok in ids], "token_logprobs": [], "top_logprobs": [], "text_offset": offsets}
        for tok, e in zip(ids, entries):
            if e is None:  # the first prompt token: nothing before it predicts it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            lp, top = e
            alts = {p.text(a): v for a, v in top}
            alts.setdefault(p.text(tok), lp)  # OpenAI: the top `logprobs`, and the sampled token always
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(alts)
        return out

    @staticmethod
    def has_entries(lp: dict | None) -> bool:
        return bool(lp) and bool(lp.get("content") or lp.get("tokens"))


class _Text:
    """A request's text as tokens arrive: decoded whole (multi-token characters come out right), cut at
    the first stop string; `take` hands out what is safe to show (a possible start of a stop string and
    an incomplete character are held back). `starts[i]`: where token i's text begins."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop, self.ids, self.starts = tokenizer, stop, [], []
        self.text, self.shown, self.stopped = "", 0, False
        self.hold = max((len(s) for s in stop), default=1) - 1

    def add(self, token: int) -> bool:
        """Add a token; True once a stop string appeared (the text then ends before it)."""
        if self.stopped:
            return True
        self.starts.append(len(self.text.rstrip("\ufffd")))
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
            if "prefix_cache_hits" in s:  # the prefix cache (serve/prefix.py), when the engine has one
                yield CounterMetricFamily("infinigen_prefix_cache_hits", "Requests that reused a cached prefix",
                                          value=s["prefix_cache_hits"])
                yield CounterMetricFamily("infinigen_prefix_cache_hit_tokens", "Prompt tokens not prefilled again",
                                          value=s["prefix_cache_hit_tokens"])
                yield CounterMetricFamily("infinigen_prefix_cache_evictions", "Cached blocks evicted (LRU)",
                                          value=s["prefix_cache_evictions"])
                yield GaugeMetricFamily("infinigen_prefix_cache_bytes", "Bytes of cached prefix blocks",
                                        value=s["prefix_cache_bytes"])
            if "prefix_cache_disk_hits" in s:  # its folder (--prefix-cache-dir)
                yield CounterMetricFamily("infinigen_prefix_cache_disk_hits", "Requests that reused blocks read "
                                          "from the prefix cache's folder", value=s["prefix_cache_disk_hits"])
                yield CounterMetricFamily("infinigen_prefix_cache_disk_hit_tokens", "Prompt tokens read from the "
                                          "prefix cache's folder", value=s["prefix_cache_disk_hit_tokens"])
                yield CounterMetricFamily("infinigen_prefix_cache_disk_skipped", "Files of the prefix cache's "
                                          "folder not trusted (corrupt, another model's)",
                                          value=s["prefix_cache_disk_skipped"])
                yield CounterMetricFamily("infinigen_prefix_cache_disk_evictions", "Files of the prefix cache's "
                                          "folder deleted (least recently used)",
                                          value=s["prefix_cache_disk_evictions"])
                yield GaugeMetricFamily("infinigen_prefix_cache_disk_bytes", "Bytes of the prefix cache's folder",
                                        value=s["prefix_cache_disk_bytes"])
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


class WarmingUp:
    """The ASGI app of a server that listens while it loads (as llama-server does): every route, /health
    included, answers 503 with a `Retry-After` header and OpenAI's error body, "loading: model", "loading:
    calibrating" or "loading: compiling" as `phase` says, until `ready(app)` hands over the app that serves
    (its engine started then); every request after that goes to it, and the server's shutdown stops its
    engine (what that app's own lifespan would do)."""

    RETRY_AFTER_S = 2

    def __init__(self, phase: str = "model"):
        self.phase = phase
        self.app = None

    def ready(self, app) -> None:
        app.state.engine.start()
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    if self.app is not None:
                        self.app.state.engine.stop()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return await send({"type": "websocket.close", "code": 1013})  # "try again later"
        answer = error_response(503, f"loading: {self.phase}", "unavailable_error", code="model_loading",
                                headers={"Retry-After": str(self.RETRY_AFTER_S)})
        await answer(scope, receive, send)


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
