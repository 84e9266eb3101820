"""Relaying a backend's answer to the client, and racing the exchange against the client leaving.

``relay()`` sends the head, then each chunk as it arrives (never buffered; a small or finished
body goes in one message); a backend that breaks off mid-answer, or stays silent longer than
``stream_idle_timeout_s``, ends the response with an SSE error event when it is a stream.
``run_until_disconnect()`` runs the whole exchange in the caller's task while a watcher waits
for ``http.disconnect``: a client that goes away cancels it, and the upstream is closed in a
``finally`` so the model server sees the disconnect and cancels the generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

from starlette.types import Message, Receive, Send

from router.errors import RouterError, error_body
from router.httpclient import UpstreamError, UpstreamTimeout
from router.registry import Model
from router.request import HOP_BY_HOP
from router.upstream import UpstreamReply

__all__ = ["Relayed", "relay", "run_until_disconnect", "send_error"]

log = logging.getLogger(__name__)

RESPONSE_DROP = HOP_BY_HOP | {"server", "date", "x-backend-fatal"}
SMALL_BODY = 1 << 20
WATCH_AFTER_S = 0.05


class Relayed(Exception):
    """Raised inside the exchange once response headers went out; carries the status sent."""

    def __init__(self, status: int) -> None:
        self.status = status


def _response_headers(resp: UpstreamReply) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in resp.raw_headers if k.decode("latin-1") not in RESPONSE_DROP]


async def send_error(send: Send, exc: RouterError) -> None:
    body = error_body(exc.message, exc.type, exc.code, exc.param)
    headers = [(k.encode(), v.encode()) for k, v in exc.headers().items()]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def relay(model: Model, resp: UpstreamReply, send: Send) -> int:
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
        raise Relayed(resp.status) from None
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
        await send({"type": "http.response.body", "body": f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode(),
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
    except Relayed as relayed:
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
