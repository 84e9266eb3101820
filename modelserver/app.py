"""The model server's Starlette app: ``/health``, ``/v1/models``, the task's routes, limits, errors.

``build_app(spec, engine)`` serves an engine that is already loaded (tests, in-process
use); ``build_app(spec, runtime=rt)`` serves a :class:`ModelRuntime` that a loader thread
fills in, which is how ``python -m modelserver`` starts serving before the model loads.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelserver.api.common import LOG_NOTES, runtime
from modelserver.errors import BodyTooLarge, ModelServerError, NoRoute, RequestError, Unauthorized, error_response
from modelserver.memory import meter_for
from modelserver.runtime import ModelRuntime
from modelserver.settle import Settle
from modelserver.spec import ModelSpec
from modelserver.tasks import routes_for

__all__ = ["BodyLimit", "ExitWhenFailed", "RequestLog", "RequireToken", "build_app"]

log = logging.getLogger("modelserver.access")

#: Paths that never run the model (an answer there is not the model's first).
QUIET_PATHS = frozenset({"/health", "/v1/models", "/tokenize", "/detokenize", "/v1/messages/count_tokens"})


class RequireToken:
    """401 for any request without its token, every endpoint (``/health`` too): as ``Authorization: Bearer
    <token>`` (the router's way; any case of ``Bearer``) or ``x-api-key: <token>`` (Anthropic's SDKs), compared
    in constant time. The 401 takes the shape of the path's protocol."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = token.encode()

    def _holds_token(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        scheme, _, value = headers.get(b"authorization", b"").strip().partition(b" ")
        candidates = (value.strip() if scheme.lower() == b"bearer" else b"", headers.get(b"x-api-key", b"").strip())
        matched = False
        for candidate in candidates:
            matched |= hmac.compare_digest(candidate, self.expected)
        return matched

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._holds_token(scope):
            message = ("this model server requires its bearer token (sent by the router that started it): send "
                       "`Authorization: Bearer <token>`")
            await error_response(Unauthorized(message), scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for a body above ``max_mb`` MiB: at once from Content-Length, else while it is read."""

    def __init__(self, app: ASGIApp, max_mb: float) -> None:
        self.app = app
        self.max_mb = max_mb
        self.max_bytes = int(max_mb * 1024 * 1024)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(BodyTooLarge(self.max_mb), scope["path"])(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_mb)
            return message

        await self.app(scope, limited, send)


class RequestLog:
    """One log line per request when it ends: method, path, status, seconds and the handler's notes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.monotonic(), 0

        async def recording(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording)
        finally:
            notes = "".join(f" {key}={value}" for key, value in scope.get(LOG_NOTES, {}).items())
            level = logging.DEBUG if scope["path"] == "/health" else logging.INFO
            elapsed = time.monotonic() - started
            log.log(level, "%s %s %s %.3fs%s", scope["method"], scope["path"], status or "-", elapsed, notes)


class ExitWhenFailed:
    """After each response: a process that failed beyond repair exits now (:meth:`ModelRuntime.exit_if_failed`);
    after the model's first answer, what it no longer uses goes back to the OS (:class:`Settle`)."""

    def __init__(self, app: ASGIApp, runtime: ModelRuntime, settle: Settle | None = None) -> None:
        self.app = app
        self.runtime = runtime
        self.settle = settle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.settle is None or self.settle.done or scope["type"] != "http" or scope["path"] in QUIET_PATHS:
            try:
                await self.app(scope, receive, send)
            finally:
                if scope["type"] == "http":
                    self.runtime.exit_if_failed()
            return
        status = 0

        async def recording(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording)
        finally:
            self.runtime.exit_if_failed()
            if status == 200 and self.runtime.status == "ready":  # the model ran: its first inference is behind it
                self.settle.after_answer()


async def health(request: Request) -> Response:
    rt = runtime(request)
    status_code, body = rt.health()
    body["memory"] = memory = request.app.state.memory.report(engine_loaded=rt.status == "ready")
    if memory.get("device_memory_bytes") is not None:
        body.setdefault("device_memory_bytes", memory["device_memory_bytes"])
    return JSONResponse(body, status_code=status_code)


async def list_models(request: Request) -> Response:
    rt = runtime(request)
    card = {
        "id": rt.spec.name,
        "object": "model",
        "created": rt.started_at,
        "owned_by": "ovrouter",
        "task": rt.spec.task,
        "status": rt.status,
    }
    context = getattr(rt.loaded(), "context_length", None)  # what this process enforces (llm, vlm)
    if context is not None:
        card["max_model_len"] = context
    return JSONResponse({"object": "list", "data": [card]})


async def _model_server_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ModelServerError)
    if exc.status >= 500:
        log.warning("%s %s failed: %s", request.method, request.url.path, exc.message)
    return error_response(exc, request.url.path)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    paths = ", ".join(route.path for route in request.app.routes if isinstance(route, Route))
    message = f"{request.method} {request.url.path}: {exc.detail}; this server serves {paths}"
    if exc.status_code in (404, 405):
        error: ModelServerError = NoRoute(message, exc.status_code, (exc.headers or {}).get("Allow"))
    else:
        error = RequestError(str(exc.detail))
        error.status = exc.status_code
    return error_response(error, request.url.path)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("%s %s: unexpected error", request.method, request.url.path, exc_info=exc)
    error = ModelServerError("internal error; see the model server's log")  # 500 server_error internal_error
    return error_response(error, request.url.path)


def build_app(
    spec: ModelSpec, engine: Any = None, *, runtime: ModelRuntime | None = None, token: str | None = None
) -> Starlette:
    """The app for one model; give a loaded ``engine``, or a ``runtime`` that a loader fills in.

    ``token``: every request must carry it as a bearer token (a server listening on a network address)."""
    rt = runtime or ModelRuntime(spec)
    if engine is not None:
        rt.set_ready(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        rt.close()

    app = Starlette(
        routes=[Route("/health", health), Route("/v1/models", list_models), *routes_for(spec.task)],
        middleware=[
            *([Middleware(RequireToken, token=token)] if token else []),
            Middleware(ExitWhenFailed, runtime=rt, settle=Settle(spec.name) if spec.engine != "fake" else None),
            Middleware(RequestLog),
            Middleware(BodyLimit, max_mb=spec.max_request_mb),
        ],
        exception_handlers={ModelServerError: _model_server_error, HTTPException: _http_error, Exception: _unexpected},
        lifespan=lifespan,
    )
    app.state.runtime = rt
    app.state.memory = meter_for(spec)
    return app
