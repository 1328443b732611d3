"""The OpenAI-compatible HTTP API over an `Engine`: the app, its middleware, and the gate that answers while
the server warms up. The routes are plain functions in `routes`; the request bodies and error answers in
`protocol`; the answer's text and log-probabilities in `answer`; /metrics in `metrics`.

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

import logging
import time

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import routes
from .engine import Engine
from .protocol import APIError, error_response, validation_error
from .routes import DRAIN_S, Served  # noqa: F401 (DRAIN_S: re-exported, the command's grace period)

log = logging.getLogger("infinigen.serve")

MAX_BODY = 1 << 20  # bytes


# ---- middleware --------------------------------------------------------------------------------------------
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

    from .metrics import registry

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="infinigen", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=max_body)
    app.add_middleware(ServerErrors)  # added last: outside BodyLimit
    app.state.engine = engine
    app.state.served = Served(engine, tokenizer, model_name, registry(engine))
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"])
    return app


async def _api_error(request, e: APIError):
    return error_response(e.status, e.message, e.type, e.param, e.code)


async def _invalid(request, e: RequestValidationError):
    return await _api_error(request, validation_error(e.errors()))


async def _http_error(request, e: StarletteHTTPException):
    kind = "invalid_request_error" if e.status_code < 500 else "server_error"
    return error_response(e.status_code, str(e.detail), kind)


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
