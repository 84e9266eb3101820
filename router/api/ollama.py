"""Ollama's API under ``/ollama`` (and at the root of ``router.ollama_port``), separate from the management ``/api``.

The router answers what its registry and procman know: ``/api/version``, ``/api/tags``,
``/api/show``, ``/api/ps``, ``/api/pull`` (starts a configured model), ``HEAD /`` and ``GET /``, and a
clear error for ``create``/``copy``/``push``/``delete`` (models come from the config file). ``/api/chat``,
``/api/generate``, ``/api/embed`` and ``/api/embeddings`` go to the model's server, which translates
them (``modelserver/api/ollama.py``), through the same admission, cold start, retry and relay as
``/v1``. Here: the model name (``name:latest`` or an alias), ``keep_alive`` (procman's
``keep_alive`` once the answer is sent), a generate or chat with nothing to say (Ollama's load and
unload), and every error as Ollama writes it: ``{"error": "..."}``. A streamed answer waiting on a cold
start sends nothing until its first token (NDJSON has no comment line for progress).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from procman import BackendUnavailable, State
from router.api.endpoint import ProxyEndpoint
from router.api.ollama_cards import keep_alive_s, ollama_names, ps_entry, served, show, tags_entry
from router.edge.body import parse_json, read_body, too_large
from router.edge.errors import BadRequest, ModelNotFound, NotFound, RouterError, body_for, unavailable
from router.path import request as proxy_request
from router.path.proxy import forward
from router.path.relay import run_until_disconnect
from router.path.request import ProxyRequest
from router.service import RouterService, check_key, credential_of
from router.state.registry import Model, Registry

__all__ = ["PREFIX", "VERSION", "OllamaApi"]

log = logging.getLogger(__name__)

PREFIX = "/ollama"
#: What ``/api/version`` answers: GitHub Copilot's Ollama provider needs at least 0.6.4.
VERSION = "0.6.4"
#: Header that tells the model server how long the request waited for a cold start (its ``load_duration``).
LOAD_HEADER = "x-ovrouter-load-ns"
#: The routes each task's model server answers.
PROXIED = {"/api/chat": ("llm", "vlm"), "/api/generate": ("llm", "vlm"), "/api/embed": ("embeddings",),
           "/api/embeddings": ("embeddings",)}
NOT_HERE = "ovrouter serves the models of its config file: add, copy or remove a model there (models.<name>), " \
           "then the router reloads it"

Handler = Callable[[Request], Awaitable[Response]]


def ollama_error(exc: RouterError) -> Response:
    """``exc`` as Ollama writes errors: ``{"error": "..."}`` (`router.edge.errors.body_for` under ``/ollama/``)."""
    return Response(body_for(exc, PREFIX + "/"), status_code=exc.status, headers=exc.headers())


async def _no_receive() -> Any:
    return {"type": "http.disconnect"}


def not_found(name: str) -> ModelNotFound:
    return ModelNotFound(f"model {json.dumps(name[:200])} not found, try pulling it first")


@dataclass(frozen=True, slots=True)
class Asked:
    """What the router reads of a chat/generate/embed body."""

    model: str
    stream: bool
    keep_s: float | None
    keep_given: bool
    empty: bool  # a generate without prompt or a chat without messages: Ollama's load (or unload)


def _asked(body: bytes, path: str) -> Asked:
    data = parse_json(body, 'send a JSON object with a "model"')
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    model = data.get("model") or data.get("name")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required")
    empty = (path == "/api/generate" and not data.get("prompt") and not data.get("images")) or (
        path == "/api/chat" and not data.get("messages"))
    stream = data.get("stream") is not False and path in ("/api/chat", "/api/generate")
    return Asked(model, stream, keep_alive_s(data.get("keep_alive")), "keep_alive" in data, empty)


class OllamaApi:
    """The routes under ``/ollama``; ``routes()`` is all the app needs."""

    def __init__(self, service: RouterService) -> None:
        self.service = service

    @property
    def registry(self) -> Registry:
        return self.service.registry

    def resolve(self, name: str, tasks: tuple[str, ...] = ()) -> Model:
        """The model ``name`` stands for (``name``, an alias, either with ``:latest``); 404 Ollama's way."""
        registry = self.registry
        model = registry.resolve(name) or (registry.resolve(name[: -len(":latest")])
                                           if name.endswith(":latest") else None)
        if model is None or not served(model.spec):
            raise not_found(name)
        if tasks and model.spec.task not in tasks:
            what = "embeddings" if "embeddings" in tasks else "generate"
            raise BadRequest(f"{json.dumps(name[:200])} does not support {what}")
        return model

    # -- routes -----------------------------------------------------------------------------------

    def routes(self) -> list[BaseRoute]:
        keyed = self._keyed
        routes: list[BaseRoute] = [
            Route(PREFIX, self.root, methods=["GET", "HEAD"]),
            Route(PREFIX + "/", self.root, methods=["GET", "HEAD"]),
            Route(PREFIX + "/api/version", keyed(self.version), methods=["GET", "HEAD"]),
            Route(PREFIX + "/api/tags", keyed(self.tags), methods=["GET", "HEAD"]),
            Route(PREFIX + "/api/show", keyed(self.show), methods=["POST"]),
            Route(PREFIX + "/api/ps", keyed(self.ps), methods=["GET"]),
            Route(PREFIX + "/api/pull", keyed(self.pull), methods=["POST"]),
            *(Route(PREFIX + path, keyed(self.refused), methods=[method]) for path, method in (
                ("/api/create", "POST"), ("/api/copy", "POST"), ("/api/push", "POST"), ("/api/delete", "DELETE"))),
            *(Route(PREFIX + path, _Proxied(self, path), methods=["POST"]) for path in PROXIED),
            Route(PREFIX + "/{rest:path}", self.unknown, methods=["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH"]),
        ]
        return routes

    def _keyed(self, handler: Handler) -> Handler:
        async def guarded(request: Request) -> Response:
            try:
                check_key(credential_of(request.headers), self.service.config.router.api_keys, "api_keys")
                return await handler(request)
            except RouterError as exc:
                return ollama_error(exc)

        return guarded

    async def root(self, request: Request) -> Response:
        return Response("Ollama is running", media_type="text/plain; charset=utf-8")

    async def unknown(self, request: Request) -> Response:
        path, hint = request.url.path, ""
        server, ollama_port = request.scope.get("server"), self.service.config.router.ollama_port
        if ollama_port is not None and server is not None and server[1] == ollama_port:
            path = path[len(PREFIX):] or "/"  # as the client sent it: this port serves Ollama's API at its root
            if path.startswith("/api/"):
                hint = " (the router's management /api is on router.port)"
        return ollama_error(NotFound(f"404 page not found: {request.method} {path} is not part of "
                                     f"Ollama's API here{hint}"))

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    def _served(self) -> list[Model]:
        return [m for m in self.registry.models.values() if served(m.spec)]

    async def tags(self, request: Request) -> Response:
        started = self.service.started_at
        entries = [tags_entry(m, name, self.registry, started) for m in self._served() for name in ollama_names(m.spec)]
        return JSONResponse({"models": entries})

    async def show(self, request: Request) -> Response:
        model = self.resolve(await _name_field(request))
        return JSONResponse(show(model, self.service.started_at))

    async def ps(self, request: Request) -> Response:
        entries = [ps_entry(m, self.registry, self.service.started_at) for m in self._served()]
        return JSONResponse({"models": [e for e in entries if e is not None]})

    async def refused(self, request: Request) -> Response:
        return ollama_error(BadRequest(f"{request.url.path.removeprefix(PREFIX)}: {NOT_HERE}"))

    async def pull(self, request: Request) -> Response:
        data = await _json_body(request)
        name = data.get("model") or data.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequest("model is required")
        try:
            model = self.resolve(name)
        except ModelNotFound:
            raise ModelNotFound("pull model manifest: file does not exist") from None
        if data.get("stream") is False:
            await self.load(model)
            return JSONResponse({"status": "success"})
        return StreamingResponse(self._pull_lines(model), media_type="application/x-ndjson")

    async def load(self, model: Model) -> None:
        refused = self.service.refusal(model)
        if refused is not None:
            raise unavailable(model.spec.name, refused, "cannot load")
        try:
            await model.backend.ensure_ready()
        except BackendUnavailable as exc:
            raise unavailable(model.spec.name, exc, "cannot load") from None

    async def _pull_lines(self, model: Model) -> AsyncIterator[bytes]:
        yield _line({"status": "pulling manifest"})
        try:
            await self.load(model)
        except RouterError as exc:
            yield _line({"error": exc.message})
            return
        for status in ("verifying sha256 digest", "writing manifest", "success"):
            yield _line({"status": status})


@dataclass(frozen=True, slots=True, kw_only=True)
class OllamaRequest(ProxyRequest):
    asked: Asked


class _Proxied(ProxyEndpoint):
    """``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/embeddings``: to the model's server, with
    Ollama's names, load/unload, keep_alive and error shape."""

    def __init__(self, api: OllamaApi, path: str) -> None:
        super().__init__(api.service)
        self.api = api
        self.path = path
        self.tasks = PROXIED[path]

    async def prepare(self, scope: Scope, receive: Receive) -> tuple[Model, ProxyRequest]:
        registry = self.service.registry
        body = await read_body(receive, proxy_request.content_length(scope), registry.max_body_bytes)
        asked = _asked(body, self.path)
        model = self.api.resolve(asked.model, self.tasks)
        if len(body) > model.spec.max_request_bytes:
            raise too_large(model.spec.max_request_bytes, f"request body for model {model.spec.name!r}")
        headers = proxy_request.upstream_headers(scope["headers"], proxy_request.client_of(scope))
        return model, OllamaRequest("POST", PREFIX + self.path, headers, body, not asked.stream, asked=asked)

    async def exchange(self, model: Model, req: ProxyRequest, scope: Scope, receive: Receive, send: Send) -> int:
        asked = cast(OllamaRequest, req).asked
        if asked.empty:
            return await self._load_or_unload(model, asked, send)
        status, _gone = await run_until_disconnect(
            lambda s: self._exchange(model, req, proxy_request.client_of(scope), s), receive, send, scope["path"])
        model.backend.keep_alive(asked.keep_s)  # each Ollama request sets it; none given: the config's
        return status

    async def _exchange(self, model: Model, req: ProxyRequest, client: str | None, send: Send) -> int:
        service = self.service

        async def work(s: Send) -> int:
            load_ns = 0
            if model.backend.state is not State.READY:  # a cold start: Ollama's load_duration
                waited = time.perf_counter_ns()
                try:
                    await model.backend.ensure_ready()
                except BackendUnavailable as exc:
                    raise unavailable(model.spec.name, exc) from None
                load_ns = time.perf_counter_ns() - waited
            timed = replace(req, headers=[*req.headers, (LOAD_HEADER, str(load_ns))])
            return await forward(model, timed, service.pool, s)

        return await service.console.activity.run(model, req, client, send, work)

    async def _load_or_unload(self, model: Model, asked: Asked, send: Send) -> int:
        """A generate or chat with nothing to answer: load the model, or (``keep_alive`` 0) unload it."""
        unload = asked.keep_given and asked.keep_s == 0
        if unload:
            if model.backend.state is not State.STOPPED:
                model.backend.keep_alive(0.0)
        else:
            await self.api.load(model)
            model.backend.keep_alive(asked.keep_s)
        answer: dict[str, Any] = {"model": asked.model, "created_at": _now(), "done": True,
                                  "done_reason": "unload" if unload else "load"}
        if self.path == "/api/chat":
            answer["message"] = {"role": "assistant", "content": ""}
        elif self.path == "/api/generate":
            answer["response"] = ""
        await JSONResponse(answer)({"type": "http"}, _no_receive, send)
        return 200


def _now() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e9):09d}Z"


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


async def _json_body(request: Request) -> dict[str, Any]:
    body = await read_body(request.receive, None, 1 << 20)
    data = parse_json(body or b"{}", 'send a JSON object with a "model"')
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    return data


async def _name_field(request: Request) -> str:
    data = await _json_body(request)
    name = data.get("model") or data.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest("model is required")
    return name
