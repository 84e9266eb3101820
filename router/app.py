"""The router's ASGI app: OpenAI routes proxied by model name, /upstream, /api, /health, /metrics."""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from dataclasses import replace

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from router.api.clientapi import ClientApi
from router.api.cors import Cors
from router.api.endpoint import ProxyEndpoint
from router.api.events import EventBus
from router.api.management import management_routes
from router.api.modelstatus import StatusBus
from router.api.ollama import PREFIX as OLLAMA_PREFIX
from router.api.ollama import OllamaApi
from router.api.responses import (
    INPUT_TOKENS_PATH,
    RESPONSES_PATH,
    ResponsesStream,
    headers_for,
    opening,
    prepare,
    stored_response_routes,
)
from router.api.ui_routes import console_routes
from router.config import Config
from router.edge.errors import BadRequest, MethodNotAllowed, NotFound, RouterError, error_response
from router.path import request
from router.path.request import ProxyRequest
from router.service import RouterService, check_key, credential_of
from router.state.registry import Model

__all__ = ["build_app"]

log = logging.getLogger(__name__)

#: OpenAI-style routes (and llama.cpp's and vLLM's /tokenize, /detokenize), each proxied to the model its body names.
OPENAI_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/rerank",
    "/v2/rerank",  # Cohere's v2 SDK (the model server serves both)
    "/v1/audio/speech",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/tokenize",
    "/detokenize",
    "/v1/messages",  # Anthropic's Messages API (errors in its shape: router.edge.errors.body_for)
    "/v1/messages/count_tokens",
)


class _ResponsesEndpoint(ProxyEndpoint):
    """``POST /v1/responses`` (and ``/input_tokens``): state and stream framing (router/api/responses.py)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == INPUT_TOKENS_PATH:
            await super().__call__(scope, receive, send)
            return
        tap = scope["ovrouter.responses"] = ResponsesStream(send, self.service.responses)
        await super().__call__(scope, receive, tap)

    async def prepare(self, scope: Scope, receive: Receive) -> tuple[Model, ProxyRequest]:
        model, req = await request.proxied(scope, receive, self.service.registry)
        prepared = prepare(req.body, self.service.responses)
        tap: ResponsesStream | None = scope.get("ovrouter.responses")
        if tap is not None:
            tap.prepared = prepared
        headers = [*req.headers, *headers_for(prepared)]
        start = opening(prepared) if tap is not None and prepared.stream else b""
        return model, replace(req, body=prepared.body, headers=headers, opening=start)


class _UpstreamEndpoint(ProxyEndpoint):
    """``/upstream/{model}/{path}``: any method and path, raw, to one configured backend."""

    async def prepare(self, scope: Scope, receive: Receive) -> tuple[Model, ProxyRequest]:
        return await request.raw(scope, receive, self.service.registry)


def _routes(service: RouterService, client_api: ClientApi) -> list[BaseRoute]:
    proxy, upstream = ProxyEndpoint(service), _UpstreamEndpoint(service)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "models": len(service.registry.models)})

    async def metrics(request: Request) -> Response:
        check_key(credential_of(request.headers), service.config.router.effective_admin_keys, "admin_keys")
        service.console.refresh()
        exposition = service.metrics.render(service.config.router.metrics_names)
        return Response(exposition, media_type="text/plain; version=0.0.4")

    routes = [Route(path, proxy, methods=["POST"]) for path in OPENAI_ROUTES]  # see _FastPath
    responses = _ResponsesEndpoint(service)
    routes += [Route(path, responses, methods=["POST"]) for path in (RESPONSES_PATH, INPUT_TOKENS_PATH)]
    routes += stored_response_routes(service)
    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    routes += client_api.routes()  # /v1/models, /v1/models/{id}, /models, /models/load|unload|sse
    routes += [
        Route("/upstream/{model}/{path:path}", upstream, methods=methods),
        Route("/upstream/{model}", upstream, methods=methods),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return routes + OllamaApi(service).routes() + management_routes(service) + console_routes(service)


#: Ollama's routes a client sends when given the router's root as its Ollama URL (they live under /ollama).
_OLLAMA_ROUTES = frozenset(f"/api/{name}" for name in ("chat", "generate", "tags", "show", "ps", "pull", "version",
                                                       "embed", "embeddings"))


def _route_hint(path: str) -> str:
    """The likely client setting behind a 404: an Ollama URL without /ollama, a base URL that ends in /v1 twice."""
    if path in _OLLAMA_ROUTES:
        return (f" (Ollama's API is under {OLLAMA_PREFIX}: give the app http://HOST:PORT{OLLAMA_PREFIX} as its Ollama"
                " URL, or set router.ollama_port)")
    if path.startswith("/v1/v1/"):
        return " (the base URL ends in /v1 once too often: Anthropic's SDK takes http://HOST:PORT, OpenAI's .../v1)"
    if path.split("/")[1:2] in (["chat"], ["completions"], ["embeddings"], ["audio"], ["responses"], ["rerank"]):
        return f" (OpenAI's routes are under /v1: did you mean /v1{path}? OpenAI clients take http://HOST:PORT/v1)"
    return ""


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404 and 405 (and any other HTTPException) as the path's error shape (router.edge.errors.body_for)."""
    assert isinstance(exc, HTTPException)
    path = request.url.path
    if exc.status_code == 404:
        error: RouterError = NotFound(f"no route {request.method} {path}; see GET /v1/models and /api"
                                      + _route_hint(path))
    elif exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow")
        error = MethodNotAllowed(f"method {request.method} is not allowed on {path}"
                                 + (f"; it takes {allow}" if allow else ""), allow)
    else:
        error = BadRequest(str(exc.detail))
        error.status = exc.status_code
    return error_response(error, path)


async def _router_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RouterError)
    return error_response(exc, request.url.path)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(RouterError("internal router error; see the router log"), request.url.path)


class _FastPath:
    """Sends ``POST`` to the OpenAI routes straight to the proxy endpoint, everything else
    (and the lifespan) through Starlette: routing and middleware cost a proxied request
    tens of microseconds it does not need."""

    def __init__(self, app: Starlette, service: RouterService) -> None:
        self.app = app
        self.service = service
        self._proxy = ProxyEndpoint(service)
        self._paths = frozenset(OPENAI_ROUTES)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self._paths:
            await self._proxy(scope, receive, send)
        else:
            await self.app(scope, receive, send)


class _OllamaDoors:
    """Ollama's API at the root of ``router.ollama_port`` (``/api/chat`` there is ``/ollama/api/chat``; its
    ``/v1`` is the router's), and OpenAI's ``/v1`` under ``/ollama/v1`` too (Ollama serves both)."""

    def __init__(self, app: ASGIApp, port: int | None) -> None:
        self.app = app
        self.port = port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            server = scope.get("server")
            if self.port is not None and server is not None and server[1] == self.port:
                if path != "/v1" and not path.startswith("/v1/"):
                    scope = _moved(scope, OLLAMA_PREFIX + path)
            elif path.startswith(OLLAMA_PREFIX + "/v1/"):
                scope = _moved(scope, path[len(OLLAMA_PREFIX):])
        await self.app(scope, receive, send)


def _moved(scope: Scope, path: str) -> Scope:
    return {**scope, "path": path, "raw_path": path.encode("latin-1")}


def build_app(config: Config, service: RouterService | None = None) -> ASGIApp:
    """A router app for ``config``; model processes start and stop with its lifespan."""
    service = service or RouterService(config)
    events = getattr(service, "events", None) or EventBus()
    client_api = ClientApi(service, StatusBus(service, events))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await service.start()
        # What startup built (modules, config, registry: ~50k objects) lives as long as the router: the
        # collector's full passes skip it. Each such pass walked all of it (~70 ms on the bench machine,
        # six in 15k proxied requests: ~25 us a request).
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
            await client_api.close()
            await service.stop()

    app = Starlette(
        routes=_routes(service, client_api),
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, RouterError: _router_error, Exception: _unexpected},
    )
    app.state.service = service
    return _OllamaDoors(Cors(_FastPath(app, service), service), config.router.ollama_port)

