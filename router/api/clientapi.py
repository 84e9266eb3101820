"""What clients read about models: ``/v1/models`` (with ``status``), ``/v1/models/{id}``, and the
llama.cpp router's model API — ``GET /models``, ``POST /models/load``, ``POST /models/unload``,
``GET /models/sse``. Text models' entries carry their context size (:func:`context_fields`).

``/v1/models*`` take the API keys; ``/models*`` the admin keys, like ``/api``. Load and unload
answer ``{"success": true}`` once the change has begun (as llama.cpp's do); the status that
follows is read from ``GET /models`` or streamed by ``GET /models/sse``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from modelserver.modelfiles import served_context
from modelserver.spec import ModelSpec
from procman import BackendUnavailable, State
from router.api.events import Subscription
from router.api.modelstatus import KIND, MODALITIES, StatusBus
from router.edge.body import MIB, parse_json, read_body
from router.edge.errors import BadRequest, ModelNotFound, PayloadTooLarge, unavailable
from router.service import RouterService, check_key, credential_of
from router.state.registry import Model

__all__ = ["ClientApi", "context_fields"]

log = logging.getLogger(__name__)

#: How long load/unload wait for the model's state to move before answering anyway.
BEGIN_WAIT_S = 2.0
#: An SSE comment this often keeps proxies from closing an idle event stream.
KEEPALIVE_S = 15.0

Handler = Callable[[Request], Awaitable[Response]]


class ClientApi:
    def __init__(self, service: RouterService, bus: StatusBus) -> None:
        self.service = service
        self.bus = bus
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- model objects ------------------------------------------------------------------------

    def entry(self, model: Model, model_id: str | None = None) -> dict[str, Any]:
        """One OpenAI ``Model`` object with the llama.cpp router's extras (``status``, ``architecture``)."""
        spec = model.spec
        inputs, outputs = MODALITIES.get(spec.task, (["text"], ["text"]))
        entry: dict[str, Any] = {
            "id": model_id or spec.name, "object": "model", "created": int(self.service.started_at),
            "owned_by": "ovrouter", "status": self.bus.status(model), "task": spec.task,
            "aliases": list(spec.aliases),
            "architecture": {"input_modalities": inputs, "output_modalities": outputs},
        }
        if model_id is not None and model_id != spec.name:
            entry["root"] = spec.name
        return {**entry, **context_fields(spec)}

    def models_list(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.entry(m) for m in self.service.registry.models.values()]}

    # -- routes ---------------------------------------------------------------------------------

    def routes(self) -> list[Route]:
        keys, admin = self._keys("api_keys"), self._keys("admin_keys")
        return [
            Route("/v1/models", keys(self.list_models), methods=["GET"]),
            Route("/v1/models/{model_id:path}", keys(self.retrieve), methods=["GET"]),
            Route("/models", admin(self.list_models), methods=["GET"]),
            Route("/models/load", admin(self.load), methods=["POST"]),
            Route("/models/unload", admin(self.unload), methods=["POST"]),
            Route("/models/sse", admin(self.sse), methods=["GET"]),
        ]

    def _keys(self, which: str) -> Callable[[Handler], Handler]:
        def wrap(handler: Handler) -> Handler:
            async def guarded(request: Request) -> Response:
                settings = self.service.config.router
                keys = settings.api_keys if which == "api_keys" else settings.effective_admin_keys
                check_key(credential_of(request.headers), keys, which)
                return await handler(request)

            return guarded

        return wrap

    def _anthropic(self, entry: dict[str, Any]) -> dict[str, Any]:
        """Anthropic's ``ModelInfo`` fields beside OpenAI's, for a client that sent ``anthropic-version``: a text
        model's context is both ``max_input_tokens`` and ``max_tokens`` (a larger ``max_tokens`` is capped at what
        the context leaves), null where the router cannot know it."""
        created = datetime.fromtimestamp(self.service.started_at, UTC).isoformat().replace("+00:00", "Z")
        context = entry.get("context_length")
        return {**entry, "type": "model", "display_name": entry["id"], "created_at": created,
                "max_input_tokens": context, "max_tokens": context}

    async def list_models(self, request: Request) -> Response:
        listing = self.models_list()
        if "anthropic-version" in request.headers:  # Anthropic's SDKs: ModelInfo fields and its page fields
            data = [self._anthropic(entry) for entry in listing["data"]]
            listing = {**listing, "data": data, "has_more": False,
                       "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}
        return JSONResponse(listing)

    async def retrieve(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        entry = self.entry(self._resolve(model_id), model_id)
        return JSONResponse(self._anthropic(entry) if "anthropic-version" in request.headers else entry)

    async def load(self, request: Request) -> Response:
        model = self._resolve(await _model_field(request))
        if model.backend.state in (State.STARTING, State.READY):
            what = "loading" if model.backend.state is State.STARTING else "loaded"
            raise BadRequest(f"model {model.spec.name!r} is already {what}; see its status in GET /models",
                             param="model")
        refused = self.service.refusal(model)  # refused a moment after STARTING: say so, not success
        if refused is not None:
            self.bus.refused(model)
            raise unavailable(model.spec.name, refused, "cannot load")
        began = self.bus.changed(model.spec.name)
        task = self._spawn(self._ensure_ready(model), f"load {model.spec.name}")
        await asyncio.wait({task, began}, timeout=BEGIN_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        failed = task.result() if task.done() else None
        if failed is not None:
            raise unavailable(model.spec.name, failed, "cannot load now")
        return JSONResponse({"success": True})

    async def unload(self, request: Request) -> Response:
        model = self._resolve(await _model_field(request))
        if model.backend.state in (State.STOPPED, State.STOPPING):
            raise BadRequest(f"model {model.spec.name!r} is not loaded; nothing to unload", param="model")
        began = self.bus.changed(model.spec.name)
        task = self._spawn(model.backend.stop("unload"), f"unload {model.spec.name}")
        await asyncio.wait({task, began}, timeout=BEGIN_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        return JSONResponse({"success": True})

    async def sse(self, request: Request) -> Response:
        return StreamingResponse(self._events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    # -- helpers ------------------------------------------------------------------------------

    def _resolve(self, name: str) -> Model:
        model = self.service.registry.resolve(name)
        if model is None:
            known = ", ".join(sorted(self.service.registry.models)) or "none"
            raise ModelNotFound(f"model {name!r} is not configured; known models: {known}", param="model")
        return model

    def _spawn(self, coro: Any, what: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=what)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _ensure_ready(self, model: Model) -> BackendUnavailable | None:
        """Load in the background; the error (if any) is the task's result, never an unretrieved exception."""
        try:
            await model.backend.ensure_ready()
        except BackendUnavailable as exc:
            log.warning("load of %s requested through /models/load failed: %s", model.spec.name, exc.reason)
            return exc
        return None

    async def _events(self) -> AsyncIterator[bytes]:
        async with self.bus.events.subscribe({KIND}) as subscription:
            for chunk in self._snapshot():  # where every model stands now
                yield chunk
            async for chunk in self._follow(subscription):
                yield chunk

    def _snapshot(self) -> list[bytes]:
        return [_sse(self.bus.event(model)) for model in list(self.service.registry.models.values())]

    async def _follow(self, subscription: Subscription) -> AsyncIterator[bytes]:
        while True:
            try:
                event = await asyncio.wait_for(subscription.get(), KEEPALIVE_S)
            except TimeoutError:
                yield b": keep-alive\n\n"
                continue
            if event.kind == KIND:
                yield _sse(dict(event.data))
            else:  # resync: this client fell behind and lost events; send every model's status again
                for chunk in self._snapshot():
                    yield chunk

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.bus.close()


def context_fields(spec: ModelSpec) -> dict[str, Any]:
    """The context a model serves, under the names clients read: vLLM's ``max_model_len``, ``context_length``
    (OpenRouter, LM Studio) and llama.cpp's ``meta.n_ctx_train``; ``{}`` when unknown (not a text model, or a
    ``command:``/``url:`` backend). Known before the model loads: read from its files (see ``served_context``)."""
    context = served_context(spec)
    if context is None:
        return {}
    return {"max_model_len": context, "context_length": context, "meta": {"n_ctx_train": context}}


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def _model_field(request: Request) -> str:
    try:
        body = await read_body(request.receive, None, MIB)  # a model name, not a payload: 1 MiB is plenty
    except PayloadTooLarge:
        raise PayloadTooLarge('send a JSON body {"model": "<id>"} of at most 1 MiB') from None
    data = parse_json(body or b"null", 'send {"model": "<id>"}')
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, str) or not model:
        raise BadRequest('send a JSON body {"model": "<id>"} naming the model (see GET /models)', param="model")
    return model
