"""A request's progress signal for the router: interim ``102 Processing`` responses until the answer's head.

The router asks for it with ``x-ovrouter-heartbeat: <seconds>`` on the requests it forwards to a model
server it launched. The server then writes ``HTTP/1.1 102 Processing`` at once and every ``<seconds>``
while the request is answered, until the final response begins; each carries ``x-progress: N`` once the
request's generation started (the pieces of text it produced so far, every choice together)::

    HTTP/1.1 102 Processing            <- at once: this server speaks the heartbeat
    HTTP/1.1 102 Processing
    x-progress: 7                      <- the generation advances
    ...
    HTTP/1.1 200 OK                    <- the answer, exactly as without the header
    content-type: application/json

The router (``router/edge/heartbeat.py``) reads silence as a wedged process (SIGSTOP, a blocked event loop)
and heartbeats whose progress stands still as a stalled generation, and consumes them: its clients never
see one. Why a 1xx and not whitespace before the JSON body (which JSON allows): a body's first byte
commits the status, and an answer still being generated may yet be a 400, a 500 or a fatal 500 with
``X-Backend-Fatal``; an interim response commits nothing, and HTTP/1.1 clients must parse 1xx
responses before the final one (RFC 9110, 15.2). A request without the header is answered as ever.

The interim lines are written on the connection's transport, which uvicorn's protocol holds on the
``send`` it gives the app (as it writes ``100 Continue`` itself); under a server that does not expose it
(an in-process test client) nothing is written, and the router, which arms its watch only at the first
heartbeat, watches nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["ASK_HEADER", "Heartbeat", "follow"]

ASK_HEADER = b"x-ovrouter-heartbeat"
MIN_INTERVAL_S = 0.05
MAX_INTERVAL_S = 30.0

_PROGRESS: contextvars.ContextVar[list[Callable[[], int]] | None] = contextvars.ContextVar("progress", default=None)


def follow(count: Callable[[], int]) -> None:
    """Count ``count()`` into the current request's progress (a no-op for a request nobody watches)."""
    counts = _PROGRESS.get()
    if counts is not None:
        counts.append(count)


class Heartbeat:
    """ASGI middleware, outside the app (it needs the server's own ``send``): see the module doc."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        interval_s = _asked(scope) if scope["type"] == "http" else None
        write = _interim_writer(send) if interval_s is not None else None
        if write is None or interval_s is None:
            await self.app(scope, receive, send)
            return
        counts: list[Callable[[], int]] = []
        token = _PROGRESS.set(counts)
        write(None)
        beats = asyncio.ensure_future(_beat(write, counts, interval_s))

        async def answering(message: Message) -> None:
            if message["type"] == "http.response.start":
                beats.cancel()  # synchronous: no interim line can follow the final head
            await send(message)

        try:
            await self.app(scope, receive, answering)
        finally:
            beats.cancel()
            _PROGRESS.reset(token)


async def _beat(write: Callable[[int | None], None], counts: list[Callable[[], int]], interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        write(sum(count() for count in counts) if counts else None)


def _asked(scope: Scope) -> float | None:
    for name, value in scope["headers"]:
        if name == ASK_HEADER:
            with contextlib.suppress(ValueError):
                return min(max(float(value), MIN_INTERVAL_S), MAX_INTERVAL_S)
    return None


def _interim_writer(send: Send) -> Callable[[int | None], None] | None:
    """A function writing one ``102`` on the connection of ``send``, or None when the server hides it."""
    cycle: Any = getattr(send, "__self__", None)
    transport: Any = getattr(cycle, "transport", None)
    if transport is None or not hasattr(transport, "write") or not hasattr(cycle, "response_started"):
        return None

    def write(progress: int | None) -> None:
        if cycle.response_started or transport.is_closing():
            return
        extra = b"" if progress is None else b"x-progress: %d\r\n" % progress
        transport.write(b"HTTP/1.1 102 Processing\r\n" + extra + b"\r\n")

    return write
