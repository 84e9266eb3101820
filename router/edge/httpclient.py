"""A lean HTTP/1.1 client for the router's hop to its backends.

Why not aiohttp or httpx: the proxy's own cost is a product requirement, and on this class
of machine aiohttp's client spends ~280 us per request and httpx's pool more, where the
request itself costs the backend ~90 us. This client is a keep-alive pool of asyncio
protocols with httptools (the parser uvicorn uses) reading the responses: one write per
request, no per-request objects beyond the response, bodies handed on as they arrive with
flow control. It speaks only what the router needs: HTTP/1.1 over a Unix socket or TCP
(TLS for remote ``https://`` backends), Content-Length request bodies, and streamed,
chunked or sized responses.

    UpstreamError          the backend could not be reached or dropped the connection
     ├ UpstreamTimeout     no response head in time, or silence between chunks too long
     └ UpstreamHung        its heartbeats stopped, or said its generation stands still (router/edge/heartbeat.py)

Interim ``1xx`` responses before the final head (a model server's heartbeats) are consumed here: each
feeds the exchange's :class:`~router.edge.heartbeat.Watch`, none is ever relayed.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Literal
from urllib.parse import urlsplit

import httptools

from router.edge.heartbeat import PROGRESS_HEADER, Watch

__all__ = ["ConnectionPool", "UpstreamError", "UpstreamHung", "UpstreamResponse", "UpstreamTimeout"]

HIGH_WATER = 1 << 20  # pause reading the backend when this much is buffered for a slow client
MAX_IDLE = 64
COPY_MAX = 64 * 1024  # a request body larger than this is written apart from its head, not copied after it


class UpstreamError(Exception):
    """The backend could not be reached, or dropped the connection mid-exchange."""


class UpstreamTimeout(UpstreamError):
    """No response head within the deadline, or too long a silence between body chunks."""


class UpstreamHung(UpstreamError):
    """The backend's heartbeats under this request stopped (``hang``) or said it made no progress (``stall``)."""

    def __init__(self, cause: Literal["hang", "stall"], message: str) -> None:
        super().__init__(message)
        self.cause = cause


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.head: asyncio.Future[None] | None = None
        self.lost: BaseException | None = None
        self.got_bytes = False
        self.watch: Watch | None = None  # the exchange's heartbeat watch, fed by interim responses
        self.interim = False  # the message being parsed is a 1xx (a heartbeat), not the answer

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"backend sent a malformed response: {exc}"))
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = exc or ConnectionResetError("connection closed by the backend")
        response = self.response
        if response is not None and response.status and not response.complete and response.delimited_by_close:
            response._finish()  # no length, not chunked: the connection's end is the body's end
        self._fail(UpstreamError(f"backend closed the connection: {self.lost}"))

    # -- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        assert self.response is not None
        self.response.raw_headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.raw_headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # an interim response: a heartbeat, never the answer
            self.interim = True
            if self.watch is not None:
                progress = dict(response.raw_headers).get(PROGRESS_HEADER)
                self.watch.beat(time.monotonic(), int(progress) if progress and progress.isdigit() else None)
            return
        response.status = status
        response.keep_alive = self.parser.should_keep_alive()
        response._by_name = dict(reversed(response.raw_headers))  # a repeated header: its first value
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)

    def on_message_complete(self) -> None:
        assert self.response is not None
        if self.interim:  # the answer's own head is still to come
            self.interim = False
            return
        self.response._finish()

    # -- helpers ------------------------------------------------------------------------------

    def _fail(self, exc: UpstreamError) -> None:
        if self.head is not None and not self.head.done():
            self.head.set_exception(exc)
        if self.response is not None and not self.response.complete:
            self.response._abort(exc)

    @property
    def reusable(self) -> bool:
        return self.lost is None and self.transport is not None and not self.transport.is_closing()


class UpstreamResponse:
    """Status, headers, and the body as it arrives. ``close()`` (always call it) frees the connection."""

    def __init__(self, pool: ConnectionPool, conn: _Connection) -> None:
        self._pool, self._conn = pool, conn
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self._by_name: dict[bytes, bytes] = {}
        self.keep_alive = False
        self.complete = False
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._error: UpstreamError | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self._closed = False

    def header(self, name: bytes) -> bytes | None:
        """The value of header ``name`` (lower case), its first one when repeated."""
        return self._by_name.get(name)

    @property
    def content_length(self) -> int | None:
        value = self.header(b"content-length")
        return int(value) if value is not None and value.isdigit() else None

    @property
    def delimited_by_close(self) -> bool:
        chunked = b"chunked" in (self.header(b"transfer-encoding") or b"").lower()
        return self.content_length is None and not chunked and not self.keep_alive

    # fed by the connection
    def _feed(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and self._conn.transport is not None:
            self._conn.transport.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        self._wake()

    def _abort(self, exc: UpstreamError) -> None:
        self._error = exc
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def iter_chunks(self, idle_timeout_s: float | None = None) -> AsyncIterator[bytes]:
        """Body chunks as they arrive; raises UpstreamTimeout after ``idle_timeout_s`` of silence."""
        loop = asyncio.get_running_loop()
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._buffered <= HIGH_WATER // 2 and self._conn.transport is not None:
                    self._conn.transport.resume_reading()
                yield chunk
                continue
            if self.complete:
                return
            if self._error is not None:
                raise self._error
            self._wakeup = loop.create_future()
            try:
                async with asyncio.timeout(idle_timeout_s):
                    await self._wakeup
            except TimeoutError:
                raise UpstreamTimeout(f"backend sent nothing for {idle_timeout_s:g}s") from None
            finally:
                self._wakeup = None

    async def read(self, idle_timeout_s: float | None = None) -> bytes:
        if self.complete and self._error is None and self._buffered <= HIGH_WATER:
            body = b"".join(self._chunks)  # all here already (a small answer): no iterator, reading never paused
            self._chunks.clear()
            self._buffered = 0
            return body
        return b"".join([chunk async for chunk in self.iter_chunks(idle_timeout_s)])

    def close(self) -> None:
        """Give the connection back when the exchange finished cleanly, else drop it."""
        if self._closed:
            return
        self._closed = True
        self._conn.response = None
        if self.complete and self.keep_alive and self._conn.reusable:
            self._pool._release(self._conn)
        elif self._conn.transport is not None:
            self._conn.transport.close()


def _bodyless(method: str, response: UpstreamResponse) -> UpstreamResponse:
    """A HEAD answer has no body whatever its Content-Length says; the parser cannot know that,
    so the exchange ends at the head and the connection is not reused."""
    if method == "HEAD" and not response.complete:
        response.keep_alive = False
        response._finish()
    return response


def _expire(future: asyncio.Future[None], timeout_s: float) -> None:
    if not future.done():
        future.set_exception(UpstreamTimeout(f"no response within {timeout_s:g}s"))


def _judge(future: asyncio.Future[None], watch: Watch) -> None:
    """Ask the watch, again every ``check_s`` until the head came: hung or stalled ends the wait."""
    if future.done():
        return
    verdict = watch.expired(time.monotonic())
    if verdict is not None:
        future.set_exception(UpstreamHung(*verdict))
    else:
        asyncio.get_running_loop().call_later(watch.check_s(), _judge, future, watch)


class ConnectionPool:
    """Keep-alive connections to one backend address (a Unix socket path, or a base URL)."""

    def __init__(self, *, uds: str | None = None, url: str | None = None, connect_timeout_s: float = 5.0) -> None:
        if (uds is None) == (url is None):
            raise ValueError("give exactly one of uds= or url=")
        self._uds = uds
        self._idle: list[_Connection] = []
        self._connect_timeout_s = connect_timeout_s
        self._ssl: ssl.SSLContext | None = None
        if url is not None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"backend URL must be http(s)://host[:port][/prefix], got {url!r}")
            self._host = parts.hostname
            self._port = parts.port or (443 if parts.scheme == "https" else 80)
            self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
            self.prefix = parts.path.rstrip("/")
            default_port = self._port == (443 if self._ssl else 80)
            self._host_header = parts.hostname if default_port else f"{parts.hostname}:{self._port}"
        else:
            self.prefix = ""
            self._host_header = "localhost"

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                if self._uds is not None:
                    _, conn = await loop.create_unix_connection(_Connection, self._uds)
                else:
                    _, conn = await loop.create_connection(_Connection, self._host, self._port, ssl=self._ssl)
        except TimeoutError:
            raise UpstreamTimeout(f"connecting to the backend took over {self._connect_timeout_s:g}s") from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect to the backend: {exc}") from None
        return conn

    def _release(self, conn: _Connection) -> None:
        if len(self._idle) < MAX_IDLE:
            self._idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    def _encode(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> tuple[bytes, ...]:
        """The request as one write, or head and body apart when the body is large (no copy of it)."""
        sized = body or method not in ("GET", "HEAD", "DELETE", "OPTIONS")
        head = "".join([
            f"{method} {self.prefix}{path} HTTP/1.1\r\nhost: {self._host_header}\r\n",
            *[f"{k}: {v}\r\n" for k, v in headers],
            f"content-length: {len(body)}\r\n\r\n" if sized else "\r\n",
        ]).encode("latin-1")
        return (head, body) if len(body) > COPY_MAX else (head + body,)

    async def request(
        self, method: str, path: str, headers: list[tuple[str, str]], body: bytes, head_timeout_s: float | None,
        watch: Watch | None = None,
    ) -> UpstreamResponse:
        """Send one request; returns once the response head arrived (the body follows).

        ``watch``: ask for heartbeats and judge the wait for the head by them (raises UpstreamHung)."""
        if watch is not None:
            headers = [*headers, watch.header()]
        payload = self._encode(method, path, headers, body)
        while self._idle:
            conn = self._idle.pop()
            if not conn.reusable:
                continue
            try:
                return _bodyless(method, await self._exchange(conn, payload, head_timeout_s, watch))
            except UpstreamError:
                if conn.got_bytes:  # the backend saw and answered part of it: never resend
                    raise
                # a keep-alive connection the backend had closed: try a fresh one
        return _bodyless(method, await self._exchange(await self._connect(), payload, head_timeout_s, watch))

    async def _exchange(
        self, conn: _Connection, payload: tuple[bytes, ...], head_timeout_s: float | None, watch: Watch | None
    ) -> UpstreamResponse:
        assert conn.transport is not None
        conn.got_bytes = False
        conn.watch = watch
        response = conn.response = UpstreamResponse(self, conn)  # the parser goes on: the last answer was whole
        loop = asyncio.get_running_loop()
        head = conn.head = loop.create_future()
        for part in payload:
            conn.transport.write(part)
        timer = None
        if head_timeout_s is not None:  # a timer handle is cheaper than asyncio.timeout() per request
            timer = loop.call_later(head_timeout_s, _expire, head, head_timeout_s)
        if watch is not None:
            loop.call_later(watch.check_s(), _judge, head, watch)
        try:
            await head
        except BaseException:
            conn.transport.close()
            raise
        finally:
            conn.watch = None
            if timer is not None:
                timer.cancel()
        return response

    def close(self) -> None:
        for conn in self._idle:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()
