"""Forwarding one request to a model's backend and relaying the answer chunk by chunk.

The flow of a proxied request::

    limiter slot (429 when the queue is full)
      -> backend.request()  (procman: cold start / wait for ready, in-flight guard)
        -> upstream request, first byte within request_timeout_s
          -> X-Backend-Fatal: 1 or a dead process: restart the backend; a non-streamed
             request with nothing sent yet is retried once on the fresh process
          -> relay: headers, then each chunk as it arrives (never buffered); silence
             longer than stream_idle_timeout_s ends the stream with an error event

The whole exchange runs in a task raced against the client's disconnect: a client that
goes away cancels it, and the upstream connection is closed in a ``finally`` so the model
server sees the disconnect and cancels the generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.types import Message, Receive, Send

from procman import BackendUnavailable, InBackoff, Lease
from router.errors import BadGateway, GatewayTimeout, RouterError, ServiceUnavailable, error_body
from router.httpclient import UpstreamError, UpstreamTimeout
from router.registry import Model
from router.upstream import Upstream, UpstreamReply

__all__ = ["ProxyRequest", "forward", "run_until_disconnect", "send_error"]

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
#: Request headers the router owns: the client's key is for the router, not the backend.
REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "authorization", "expect"}
RESPONSE_DROP = HOP_BY_HOP | {"server", "date", "x-backend-fatal"}
SMALL_BODY = 1 << 20
DEATH_GRACE_S = 2.0
WATCH_AFTER_S = 0.05


@dataclass(frozen=True, slots=True)
class ProxyRequest:
    method: str
    path: str  # path and query string as sent to the backend
    headers: list[tuple[str, str]]
    body: bytes
    retryable: bool  # a non-streamed request: safe to send again when nothing reached the client


class _Relayed(Exception):
    """Raised inside the exchange once response headers went out; carries the status sent."""

    def __init__(self, status: int) -> None:
        self.status = status


def upstream_headers(raw: list[tuple[bytes, bytes]], client: str | None) -> list[tuple[str, str]]:
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw if k.decode("latin-1") not in REQUEST_DROP]
    if client:
        headers.append(("x-forwarded-for", client))
    return headers


def _response_headers(resp: UpstreamReply) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in resp.raw_headers if k.decode("latin-1") not in RESPONSE_DROP]


async def send_error(send: Send, exc: RouterError) -> None:
    body = error_body(exc.message, exc.type, exc.code, exc.param)
    headers = [(k.encode(), v.encode()) for k, v in exc.headers().items()]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _unavailable(model: Model, exc: BackendUnavailable) -> ServiceUnavailable:
    retry = exc.retry_after_s if exc.retry_after_s is not None else (5.0 if isinstance(exc, InBackoff) else None)
    return ServiceUnavailable(f"model {model.spec.name!r} is unavailable: {exc.reason}", retry_after_s=retry)


async def forward(model: Model, req: ProxyRequest, pool: Upstream, send: Send) -> int:
    """Proxy ``req`` to ``model`` and relay the answer; returns the HTTP status the client got."""
    async with model.limiter:
        for attempt in (1, 2):
            try:
                async with model.backend.request() as lease:
                    result = await _exchange(model, req, pool, lease, send, may_retry=attempt == 1)
            except BackendUnavailable as exc:
                raise _unavailable(model, exc) from None
            if result is not None:
                return result
        raise AssertionError("unreachable: the second attempt never asks for a retry")


def _can_retry(model: Model, req: ProxyRequest, may_retry: bool) -> bool:
    return may_retry and req.retryable and model.spec.retry_on_fatal


async def _exchange(
    model: Model, req: ProxyRequest, pool: Upstream, lease: Lease, send: Send, may_retry: bool
) -> int | None:
    """One try. Returns the status relayed, or None to ask for one retry on a fresh backend."""
    spec = model.spec
    try:
        resp = await pool.request(lease.address, req.method, req.path, req.headers, req.body, spec.request_timeout_s)
    except UpstreamTimeout:
        raise GatewayTimeout(
            f"model {spec.name!r} sent no response within request_timeout_s={spec.request_timeout_s:g}s"
        ) from None
    except UpstreamError as exc:
        return await _backend_failed(model, req, lease, exc, may_retry)
    try:
        if resp.header(b"x-backend-fatal") == b"1":
            return await _fatal(model, req, lease, resp, may_retry)
        return await _relay(model, resp, send)
    finally:
        resp.close()


async def _backend_failed(
    model: Model, req: ProxyRequest, lease: Lease, exc: Exception, may_retry: bool
) -> int | None:
    """The connection failed before any answer: the process most likely died mid-request."""
    died = await _wait_replaced(model, lease)
    if died and _can_retry(model, req, may_retry):
        log.warning("%s died mid-request (%s); retrying once on a fresh process", model.spec.name, exc)
        return None
    what = "died while handling the request" if died else f"could not be reached ({exc})"
    raise BadGateway(f"model {model.spec.name!r} {what}; it is being restarted, retry the request")


async def _wait_replaced(model: Model, lease: Lease) -> bool:
    """Whether the process behind ``lease`` is gone: its exit future completes within ``DEATH_GRACE_S``."""
    await asyncio.wait({lease.exited}, timeout=DEATH_GRACE_S)
    return lease.exited.done()


async def _fatal(
    model: Model, req: ProxyRequest, lease: Lease, resp: UpstreamReply, may_retry: bool
) -> int | None:
    try:
        detail = _error_message(await resp.read(idle_timeout_s=5.0))
    except UpstreamError:
        detail = "no detail"
    log.warning("%s reported a fatal engine error (%s); restarting it", model.spec.name, detail)
    restart = model.backend.restart("fatal", generation=lease.generation)
    if _can_retry(model, req, may_retry):
        await restart  # the retry must land on the fresh process
        return None
    task = asyncio.create_task(restart)
    _BACKGROUND.add(task)  # the loop keeps only a weak reference to a task
    task.add_done_callback(_background_done)
    raise ServiceUnavailable(
        f"model {model.spec.name!r} hit an unrecoverable engine error and is being restarted: {detail}",
        retry_after_s=2.0,
    )


_BACKGROUND: set[asyncio.Task[None]] = set()


def _background_done(task: asyncio.Task[None]) -> None:
    _BACKGROUND.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.warning("background restart failed: %s", task.exception())


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300].decode("utf-8", "replace") or "no detail"


async def _relay(model: Model, resp: UpstreamReply, send: Send) -> int:
    await send({"type": "http.response.start", "status": resp.status, "headers": _response_headers(resp)})
    idle_s = model.spec.stream_idle_timeout_s
    try:
        if resp.complete or (resp.content_length or SMALL_BODY + 1) <= SMALL_BODY:
            await send({"type": "http.response.body", "body": await resp.read(idle_s)})
            return resp.status
        async for chunk in resp.iter_chunks(idle_s):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except UpstreamError as exc:
        await _end_broken_stream(model, resp, send, exc)
        raise _Relayed(resp.status) from None
    await send({"type": "http.response.body", "body": b""})
    return resp.status


async def _end_broken_stream(model: Model, resp: UpstreamReply, send: Send, exc: UpstreamError) -> None:
    if isinstance(exc, UpstreamTimeout):
        reason = f"sent nothing for stream_idle_timeout_s={model.spec.stream_idle_timeout_s:g}s"
    else:
        reason = "stopped answering mid-response (the process may have died; it is being restarted)"
    log.warning("%s %s: %s", model.spec.name, reason, exc)
    if (resp.header(b"content-type") or b"").startswith(b"text/event-stream"):
        error = {"error": {"message": f"model {model.spec.name!r} {reason}", "type": "server_error",
                           "param": None, "code": "backend_error"}}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(error)}\n\n".encode(),
                    "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def run_until_disconnect(
    work: Callable[[Send], Awaitable[int]], receive: Receive, send: Send
) -> tuple[int, bool]:
    """Run ``work`` in this task while a watcher waits for the client going away; returns
    (status, disconnected). A disconnect cancels ``work``; its ``finally`` blocks close the
    upstream. The watcher starts only once the exchange has lasted ``WATCH_AFTER_S``, so a
    quick answer costs no extra task; a disconnect is noticed at most that much later.
    ``work`` gets a ``send`` that remembers whether response headers went out, so an error
    raised afterwards is not answered with a second response."""
    me = asyncio.current_task()
    assert me is not None
    started: list[int] = []
    state = {"done": False, "gone": False}

    async def tracking_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            started.append(message["status"])
        elif not message.get("more_body", False):
            state["done"] = True  # from here on a "disconnect" is just the end of the exchange
        await send(message)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not state["done"]:
            state["gone"] = True
            me.cancel()

    loop = asyncio.get_running_loop()
    watcher: list[asyncio.Task[None]] = []

    def arm() -> None:
        if not state["done"]:
            watcher.append(loop.create_task(watch()))

    timer = loop.call_later(WATCH_AFTER_S, arm)  # most exchanges end first: no task at all
    try:
        return await work(tracking_send), False
    except asyncio.CancelledError:
        if not state["gone"]:
            raise
        me.uncancel()
        return (started[0] if started else 499), True
    except _Relayed as relayed:
        return relayed.status, False
    except RouterError as exc:
        if started:
            return started[0], False
        await send_error(tracking_send, exc)
        return exc.status, False
    finally:
        state["done"] = True
        timer.cancel()
        for task in watcher:
            task.cancel()
