"""``/ui`` (the dashboard's static files, from the package), ``/api/events``, ``/api/requests``.

The page itself is public (it holds no data); everything it shows comes from ``/api``
behind the admin key, which the page asks for and keeps in ``sessionStorage`` only. That
is why ``/api/events`` is read with ``fetch()`` (which can send an Authorization header)
rather than ``EventSource`` (which cannot, and would need the key in the URL).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from router.edge.errors import BadRequest, NotFound
from router.service import RouterService, check_key, credential_of

__all__ = ["console_routes", "snapshot"]

UI_DIR = Path(__file__).parent.parent / "ui"  # router/ui: the package data
STATIC = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
STATS_INTERVAL_S = 2.0
Handler = Callable[[Request], Awaitable[Response]]


def _admin(service: RouterService, handler: Handler) -> Handler:
    async def guarded(request: Request) -> Response:
        check_key(credential_of(request.headers), service.config.router.effective_admin_keys, "admin_keys")
        return await handler(request)

    return guarded


def snapshot(service: RouterService) -> dict[str, Any]:
    """Everything the dashboard draws, in one object (the first event of /api/events)."""
    return {
        "models": service.console.enrich(service.models_table()),
        "requests": service.console.activity.rows(),
        "last_reload": service.last_reload,
        "config": str(service.config.path) if service.config.path else None,
        "started_at": service.started_at,
        "admin_key_required": bool(service.config.router.effective_admin_keys),
        "now": time.time(),
    }


async def _stream(service: RouterService, kinds: set[str] | None) -> AsyncIterator[bytes]:
    console = service.console
    async with console.bus.subscribe(kinds) as sub:
        yield _sse("snapshot", snapshot(service))
        next_stats = time.monotonic() + STATS_INTERVAL_S
        while True:
            try:
                event = await asyncio.wait_for(sub.get(), max(0.0, next_stats - time.monotonic()))
            except TimeoutError:
                console.refresh()
                rows = console.enrich(service.models_table())
                yield _sse("stats", {"models": rows, "last_reload": service.last_reload, "now": time.time()})
                next_stats = time.monotonic() + STATS_INTERVAL_S
                continue
            yield event.sse()


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), default=str)}\n\n".encode()


def console_routes(service: RouterService) -> list[Route]:
    async def index(request: Request) -> Response:
        return RedirectResponse("/ui/", status_code=307)

    async def static(request: Request) -> Response:
        name = request.path_params.get("file") or "index.html"
        if name not in STATIC:
            raise NotFound(f"no file {name!r} in /ui; the dashboard is at /ui/")
        return FileResponse(UI_DIR / name, media_type=STATIC[name], headers={"cache-control": "no-cache"})

    async def events(request: Request) -> Response:
        raw = request.query_params.get("kinds")
        kinds = {k.strip() for k in raw.split(",") if k.strip()} if raw else None
        headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        stream = service.console.until_closing(_stream(service, kinds))
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)

    async def requests(request: Request) -> Response:
        return JSONResponse({"requests": service.console.activity.rows()})

    async def cancel(request: Request) -> Response:
        raw = request.path_params["id"]
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 18):  # int() refused 5000 digits, and "²", with a 500
            raise BadRequest(f"request id must be a number from GET /api/requests, got {raw[:40]!r}", param="id")
        if not service.console.activity.cancel(int(raw)):
            raise NotFound(f"no request {raw} in flight; see GET /api/requests")
        return JSONResponse({"cancelled": int(raw)})

    return [
        Route("/ui", index, methods=["GET"]),
        Route("/ui/", static, methods=["GET"]),
        Route("/ui/{file}", static, methods=["GET"]),
        Route("/api/events", _admin(service, events), methods=["GET"]),
        Route("/api/requests", _admin(service, requests), methods=["GET"]),
        Route("/api/requests/{id}/cancel", _admin(service, cancel), methods=["POST"]),
    ]

