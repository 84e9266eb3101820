"""Helpers every task's handlers share: parsing, engine errors, disconnects, SSE, the request log.

A handler reads its body with :func:`read_body`, gets its engine with :func:`engine_as`,
wraps engine calls in :func:`engine_errors` (which classifies them and marks the runtime
failed on a fatal one) and, when the answer takes a while, in :func:`until_disconnect`
so a client that goes away cancels the work. :func:`note` adds ``key=value`` pairs to the
request's single log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar, cast

import orjson
from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from modelserver.errors import FatalEngineError, ModelServerError, RequestError, SuspectEngineError, classify
from modelserver.protocol import parse_request
from modelserver.runtime import SUSPECT_LIMIT, SUSPECT_WINDOW_S, ModelRuntime
from modelserver.spec import ModelSpec

__all__ = [
    "LOG_NOTES",
    "ClientGone",
    "FastJSONResponse",
    "SSEResponse",
    "engine_as",
    "engine_errors",
    "fingerprint",
    "note",
    "read_body",
    "runtime",
    "spec",
    "sse",
    "until_disconnect",
]

T = TypeVar("T")
Model = TypeVar("Model", bound=BaseModel)

#: Scope key of the ``key=value`` notes the request log line ends with.
LOG_NOTES = "modelserver.log_notes"


class ClientGone(Exception):
    """The client disconnected before the answer was ready; the work was cancelled."""


def runtime(request: Request) -> ModelRuntime:
    return cast(ModelRuntime, request.app.state.runtime)


def spec(request: Request) -> ModelSpec:
    return runtime(request).spec


def engine_as(request: Request, kind: Callable[..., T]) -> T:
    """The loaded engine (503 while loading or failed), typed as the protocol ``kind`` the handler needs."""
    return cast(T, runtime(request).require())


_FINGERPRINTS: dict[int, str] = {}


def fingerprint(model: ModelSpec) -> str:
    """``system_fingerprint``: changes whenever the model's configuration does."""
    if (known := _FINGERPRINTS.get(id(model))) is None:
        known = "fp_" + hashlib.sha256(model.model_dump_json().encode()).hexdigest()[:12]
        _FINGERPRINTS[id(model)] = known
    return known


async def read_body(request: Request, model: type[Model]) -> Model:
    """The body (its size bounded by :class:`modelserver.app.BodyLimit`) parsed within the bounds of
    :func:`modelserver.protocol.parse_request`: depth, number length, encoding."""
    try:
        body = await request.body()
    except ClientDisconnect:  # nobody will read the answer; a 400, not a logged traceback
        raise RequestError("the client disconnected before the request body was complete") from None
    return parse_request(body, model)


def note(request: Request, **fields: Any) -> None:
    request.scope.setdefault(LOG_NOTES, {}).update(fields)


@contextlib.contextmanager
def engine_errors(rt: ModelRuntime) -> Iterator[None]:
    """Turn an engine's exception into a client error; a fatal one fails the runtime for good.

    :class:`ClientGone` (from :func:`until_disconnect` inside) passes as it is: no engine's doing."""
    try:
        yield
    except ClientGone:
        raise
    except ModelServerError as exc:
        if isinstance(exc, FatalEngineError):
            rt.set_failed(exc.message)
        raise
    except Exception as exc:
        error = classify(exc, rt.spec.fatal_patterns, rt.spec.suspect_patterns)
        if isinstance(error, SuspectEngineError) and rt.suspect():
            error = FatalEngineError(
                f"{error.message} ({SUSPECT_LIMIT} suspect device errors within {SUSPECT_WINDOW_S:g}s: "
                "the process is replaced)", code="engine_suspect"
            )
        if isinstance(error, FatalEngineError):
            rt.set_failed(error.message)
        raise error from exc


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


#: Work that ends sooner is not watched for its client's disconnect (the watch costs a task and a loop step
#: a request); longer work is cancelled at most this long after its client left.
WATCH_AFTER_S = 0.02


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (and raising :class:`ClientGone`) if the client disconnects first.

    ``work`` runs in the request's own task (no task of its own); the watch starts :data:`WATCH_AFTER_S`
    into it, so a client gone before then is noticed then. Only for the part of a request before its
    response starts: once a streamed response runs, Starlette itself listens for the disconnect.
    """
    task = asyncio.current_task()
    assert task is not None
    watcher: asyncio.Future[None] | None = None
    state = {"watching": True, "gone": False}

    def on_watched(done: asyncio.Future[None]) -> None:
        if state["watching"] and not done.cancelled() and done.exception() is None:  # the client left
            state["gone"] = True
            task.cancel()

    def watch() -> None:
        nonlocal watcher
        watcher = asyncio.ensure_future(_disconnected(request.receive))
        watcher.add_done_callback(on_watched)

    timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, watch)
    try:
        return await work
    except asyncio.CancelledError:
        if state["gone"] and task.uncancel() == 0:  # cancelled by the watch alone, not by a shutdown
            raise ClientGone() from None
        raise
    finally:
        state["watching"] = False
        timer.cancel()
        if watcher is not None:
            watcher.cancel()


class FastJSONResponse(JSONResponse):
    """A JSON answer rendered by orjson: for bodies of many numbers (embeddings), ~17x less CPU than ``json``.

    Numpy arrays and scalars are written as numbers; a NaN or infinity is written as ``null`` (``json`` would
    write ``NaN``, which is not JSON)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class SSEResponse(StreamingResponse):
    """A server-sent-event stream (or another ``media_type``: NDJSON) whose ``on_close`` always runs, however the
    stream ends.

    A disconnect cancels the streaming task at any await, possibly outside the body
    iterator, which then is never closed; closing here frees the engine's slot at once.
    """

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 media_type: str = "text/event-stream") -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type=media_type, headers=headers)
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self._events.aclose()  # type: ignore[attr-defined]
            await self._on_close()
