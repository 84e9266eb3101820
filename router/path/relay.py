"""Relaying a backend's answer to the client, and racing the exchange against the client leaving.

``relay()`` sends the head, then each chunk as it arrives (never buffered; a small or finished
body goes in one message); a backend that breaks off mid-answer, or stays silent longer than
``stream_idle_timeout_s``, ends the response with an SSE error event when it is a stream. A
chat, completion or Messages stream that ends without its closing event (``data: [DONE]``, ``message_stop``:
:mod:`router.path.framing`) was cut short too, however the
connection ended; the event then says what was seen (:func:`cut_reason`): the process died
(and how: its exit code or signal), or the upstream closed the stream while its process
runs on — a server that drops a stream on a concurrent request, as llama-cpp-python's does
on a health probe, is not a dead one, and nothing is restarted for it.
``run_until_disconnect()`` runs the whole exchange in the caller's task while a watcher waits
for ``http.disconnect``: a client that goes away cancels it, and the upstream is closed in a
``finally`` so the model server sees the disconnect and cancels the generation.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

from starlette.types import Message, Receive, Send

from procman import Lease
from procman.process import exit_words
from router.edge.errors import RouterError, body_for
from router.edge.httpclient import UpstreamError, UpstreamTimeout
from router.edge.upstream import UpstreamReply
from router.path.framing import OPENAI, Framing, held_end
from router.path.request import HOP_BY_HOP
from router.state.registry import Model

__all__ = ["Relayed", "Tally", "cut_reason", "relay", "run_until_disconnect", "send_error"]

log = logging.getLogger(__name__)

RESPONSE_DROP = HOP_BY_HOP | {"server", "date", "x-backend-fatal"}
SMALL_BODY = 1 << 20
WATCH_AFTER_S = 0.05
#: How long a cut stream waits for its process's exit to be seen before it calls the process alive.
DEATH_GRACE_S = 2.0
#: A process found dead after DEATH_GRACE_S: how much longer its exit status is waited for.
EXIT_WAIT_S = 10.0


class Relayed(Exception):
    """Raised inside the exchange once response headers went out; carries the status sent."""

    def __init__(self, status: int) -> None:
        self.status = status


def _response_headers(resp: UpstreamReply) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in resp.raw_headers if k.decode("latin-1") not in RESPONSE_DROP]


async def send_error(send: Send, exc: RouterError, path: str = "") -> None:
    body = body_for(exc, path)
    headers = [(k.encode(), v.encode()) for k, v in exc.headers().items()]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Tally:
    """What a stream relayed so far: its ``data:`` events (chunks), and its closing event (``data: [DONE]``,
    Anthropic's ``message_stop``: :mod:`router.path.framing`), held back until the stream ends cleanly (a server
    that sends it and then breaks the connection must not have its client stop there, before the router's
    error event)."""

    __slots__ = ("chunks", "framing", "held")

    def __init__(self, framing: Framing = OPENAI) -> None:
        self.chunks = 0
        self.held = b""
        self.framing = framing

    def feed(self, data: bytes) -> bytes:
        """What of ``data`` to send now: all of it but a closing event."""
        if self.held:  # more after a closing event: it was not the end after all
            data, self.held = self.held + data, b""
        if self.framing.ended(data):
            done = held_end(data, self.framing)
            data, self.held = data[:done], data[done:]
        self.chunks += data.count(self.framing.event)
        return data

    @property
    def done(self) -> bool:
        return bool(self.held)


async def relay(model: Model, resp: UpstreamReply, send: Send, lease: Lease | None = None, *,
                framing: Framing | None = None, grace_s: float = DEATH_GRACE_S) -> int:
    """Relay ``resp`` to the client. ``framing``: an SSE answer must end with that protocol's closing event
    (a chat, completion or Messages stream); ``lease`` tells whether the process behind a cut stream died or
    runs on."""
    await send({"type": "http.response.start", "status": resp.status, "headers": _response_headers(resp)})
    idle_s = model.spec.stream_idle_timeout_s
    tally = Tally(framing) if framing is not None and resp.status == 200 and framing.frames(_content_type(resp)) \
        else None
    try:
        if resp.complete or (resp.content_length or SMALL_BODY + 1) <= SMALL_BODY:
            body = await resp.read(idle_s)
            if tally is None:
                await send({"type": "http.response.body", "body": body})
                return resp.status
            await send({"type": "http.response.body", "body": tally.feed(body), "more_body": True})
        else:
            async for chunk in resp.iter_chunks(idle_s):
                if tally is not None and not (chunk := tally.feed(chunk)):
                    continue  # all of it was the closing [DONE], held back
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except UpstreamError as exc:
        await _end_broken_stream(model, resp, send, exc, tally, lease, grace_s)
        raise Relayed(resp.status) from None
    if tally is not None and not tally.done:
        reason = await cut_reason(model, lease, tally.chunks, grace_s)
        log.warning("%s", reason)
        await _end_with_error(send, reason, tally.framing)
        raise Relayed(resp.status)
    await send({"type": "http.response.body", "body": tally.held if tally is not None else b""})
    return resp.status


def _content_type(resp: UpstreamReply) -> bytes:
    return resp.header(b"content-type") or b""


def _is_sse(resp: UpstreamReply) -> bool:
    return _content_type(resp).startswith(b"text/event-stream")


async def _end_broken_stream(model: Model, resp: UpstreamReply, send: Send, exc: UpstreamError, tally: Tally | None,
                             lease: Lease | None, grace_s: float) -> None:
    name = model.spec.name
    if isinstance(exc, UpstreamTimeout):
        reason = f"model {name!r} sent nothing for stream_idle_timeout_s={model.spec.stream_idle_timeout_s:g}s"
    elif tally is not None:
        reason = await cut_reason(model, lease, tally.chunks, grace_s)
    else:
        reason = f"model {name!r} broke off the response mid-body"
    log.warning("%s (%s)", reason, exc)
    if tally is not None or _is_sse(resp):
        await _end_with_error(send, reason, tally.framing if tally is not None else OPENAI)
        return
    await send({"type": "http.response.body", "body": b""})


async def _end_with_error(send: Send, message: str, framing: Framing) -> None:
    await send({"type": "http.response.body", "body": framing.error(message), "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def cut_reason(model: Model, lease: Lease | None, chunks: int, grace_s: float) -> str:
    """What was seen of a stream that ended early: its process died (and how), or it runs on.

    A death shows as the lease's ``exited`` completing; it is waited for ``grace_s`` (the
    connection may break a moment before the exit is seen). A remote has no process to watch.
    """
    name = model.spec.name
    after = f"after {chunks} chunk{'' if chunks == 1 else 's'}"
    if lease is None or lease.pid is None:
        return f"model {name!r} upstream closed the stream {after} without finishing"
    await asyncio.wait({lease.exited}, timeout=grace_s)
    if not lease.exited.done() and not _alive(lease.pid):  # gone, its exit not handled yet (a starved loop)
        await asyncio.wait({lease.exited}, timeout=EXIT_WAIT_S)
    if lease.exited.done():
        code = None if lease.exited.cancelled() or lease.exited.exception() else int(lease.exited.result())
        return (f"model {name!r} died {after}: its process (pid {lease.pid}) {exit_words(code)}"
                f"{_killed_as(model, lease)}; retry the request")
    return (f"model {name!r} upstream closed the stream {after} without finishing; "
            f"the process (pid {lease.pid}) is still running")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not reaped yet, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # someone else's: it exists
            pass
        return True


def _killed_as(model: Model, lease: Lease) -> str:
    """Why the supervisor killed the process, when it did (a hang: failed health probes)."""
    death = model.backend.death(lease.generation)
    if death is None or death.cause != "hang":
        return ""
    spec = model.backend.spec
    return f" by ovrouter as hung ({spec.health_path} failed {spec.health_failures} health probes in a row)"


async def run_until_disconnect(
    work: Callable[[Send], Awaitable[int]], receive: Receive, send: Send, path: str = ""
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
        await send_error(tracking_send, exc, path)
        return exc.status, False
    finally:
        state["done"] = True
        timer.cancel()
        for task in watcher:
            task.cancel()
