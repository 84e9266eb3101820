"""``/api``: models table, load/unload/restart, logs, status and reload (admin keys)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from procman import BackendUnavailable, State
from router.edge.errors import BadRequest, ModelNotFound, error_object, unavailable
from router.service import RouterService, check_key, credential_of
from router.state.registry import Model

__all__ = ["management_routes"]

Handler = Callable[[Request], Awaitable[Response]]
MAX_LOG_LINES = 5000


def _admin(service: RouterService, handler: Handler) -> Handler:
    async def guarded(request: Request) -> Response:
        check_key(credential_of(request.headers), service.config.router.effective_admin_keys, "admin_keys")
        return await handler(request)

    return guarded


def _model(service: RouterService, request: Request) -> Model:
    name = request.path_params["name"]
    model = service.registry.resolve(name)
    if model is None:
        known = ", ".join(sorted(service.registry.models)) or "none"
        raise ModelNotFound(f"model {name!r} is not configured; known models: {known}", param="name")
    return model


def _row(service: RouterService, name: str) -> dict[str, Any]:
    return next(row for row in service.models_table() if row["name"] == name)


def management_routes(service: RouterService) -> list[Route]:
    async def models(request: Request) -> Response:
        return JSONResponse({"models": service.console.enrich(service.models_table())})

    async def load(request: Request) -> Response:
        model = _model(service, request)
        try:
            refused = service.refusal(model) if model.backend.state is not State.READY else None
            if refused is not None:
                raise refused
            await model.backend.ensure_ready()
        except BackendUnavailable as exc:
            raise unavailable(model.spec.name, exc, "failed to load") from None
        return JSONResponse(_row(service, model.spec.name))

    async def unload(request: Request) -> Response:
        model = _model(service, request)
        await model.backend.stop("unload")
        return JSONResponse(_row(service, model.spec.name))

    async def restart(request: Request) -> Response:
        model = _model(service, request)
        await service.registry.residency.restart(model)  # rolling where memory allows
        return JSONResponse(_row(service, model.spec.name))

    async def logs(request: Request) -> Response:
        model = _model(service, request)
        lines = _int_param(request, "lines", 200)
        if request.query_params.get("follow") in ("1", "true", "yes"):
            follow = service.console.until_closing(_follow(model))  # ends when the server shuts down
            return StreamingResponse(follow, media_type="text/plain; charset=utf-8")
        return Response("".join(line + "\n" for line in model.backend.logs.tail(lines)),
                        media_type="text/plain; charset=utf-8")

    async def status(request: Request) -> Response:
        return JSONResponse({
            "status": "ok",
            "config": str(service.config.path) if service.config.path else None,
            "started_at": service.started_at,
            "uptime_s": round(time.time() - service.started_at, 3),
            "last_reload": service.last_reload,
            "models": {row["name"]: str(row["state"]).lower() for row in service.models_table()},
            "memory": service.registry.manager.memory(),  # per budgeted device: budget_bytes, used_bytes
            "spares": spares.snapshot() if (spares := service.registry.manager.spares) is not None else None,
            "devices": service.devices.snapshot(),
        })

    async def reset_device(request: Request) -> Response:
        device = request.path_params["device"]
        was_unhealthy = service.devices.health.reset(device)
        return JSONResponse({"device": device, "was_unhealthy": was_unhealthy, "healthy": True})

    async def reload(request: Request) -> Response:
        result = await service.reload("api")
        if result["ok"]:
            return JSONResponse(result)
        message = "config not reloaded: " + "; ".join(map(str, result["errors"]))  # the usual error, and the result
        error = error_object(message, "invalid_request_error", "invalid_config")
        return JSONResponse({**error, **result}, status_code=400)

    plain: list[tuple[str, Handler, str]] = [
        ("/api/models", models, "GET"),
        ("/api/models/{name}/load", load, "POST"),
        ("/api/models/{name}/unload", unload, "POST"),
        ("/api/models/{name}/restart", restart, "POST"),
        ("/api/models/{name}/logs", logs, "GET"),
        ("/api/status", status, "GET"),
        ("/api/reload", reload, "POST"),
        ("/api/devices/{device:path}/reset", reset_device, "POST"),  # path: a node's device is <node>/<device>
    ]
    return [Route(path, _admin(service, handler), methods=[method]) for path, handler, method in plain]


def _int_param(request: Request, key: str, default: int) -> int:
    raw = request.query_params.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"`{key}` must be an integer, got {json.dumps(raw)}", param=key) from None
    return max(1, min(value, MAX_LOG_LINES))


async def _follow(model: Model) -> AsyncIterator[bytes]:
    async for line in model.backend.logs.follow():
        yield (line + "\n").encode()
