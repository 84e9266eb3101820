"""The router's HTTP protocol: bounds on what one connection may hold, and JSON for every refusal.

uvicorn's httptools protocol (with :mod:`router.edge.coalesce`'s joined writes) plus:

- a deadline for the request head (``head_timeout_s``): from the connection's opening, or
  from the first bytes of its next request, to the end of the head; a connection that sends
  nothing, or drips its head a byte at a time (slowloris), is closed (408 when it sent part
  of a head). Idle keep-alive connections close after ``keep_alive_timeout_s`` (uvicorn's
  own timer, armed when a response ends).
- a body that stops arriving for ``body_timeout_s`` -> 408 (its request's charge on the
  router's body budget comes back).
- at most ``max_connections`` open: one more closes the connection idle the longest (no
  request under way: a silent or slow one, a keep-alive one between requests), so a flood
  of idle connections cannot lock clients out; only when every connection has a request
  under way does the new one get 503 (``too_many_connections``), closed at once. Either
  way the file descriptors stay bounded and model starts never run out of them.
- a request line longer than :data:`MAX_URL_BYTES` -> 414; more than :data:`MAX_HEADERS`
  headers or a head over :data:`MAX_HEAD_BYTES` -> 431.
- framing errors the parser finds (a bad or duplicate ``Content-Length``, ``Content-Length``
  with chunked, a malformed request line) -> 400 naming the fault, where uvicorn sends a
  plain-text ``Invalid HTTP request received.``

Every refusal is the router's JSON error shape with ``connection: close``; when a response
is already under way on the connection, it is closed without one.
"""

from __future__ import annotations

import asyncio
import http
import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools

from router.config import RouterSettings
from router.edge.coalesce import CoalescingHttpToolsProtocol
from router.edge.errors import error_body

__all__ = ["MAX_HEADERS", "MAX_HEAD_BYTES", "MAX_URL_BYTES", "ConnectionLimits", "GuardedHttpProtocol", "Refused"]

log = logging.getLogger(__name__)

MAX_URL_BYTES = 16 * 1024
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100
#: How often a refusal of the same kind is logged at most (a flood must not flood the log).
LOG_EVERY_S = 10.0


_SETTINGS = RouterSettings.model_fields  # the settings' one set of defaults


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What ``router.*`` says (:func:`connection_limits`); the defaults are the settings' own."""

    head_timeout_s: float = _SETTINGS["head_timeout_s"].default
    body_timeout_s: float = _SETTINGS["body_timeout_s"].default
    max_connections: int = 1024  # a stand-in: router.max_connections 0 (auto) is resolved by connection_limits()
    max_url_bytes: int = MAX_URL_BYTES
    max_head_bytes: int = MAX_HEAD_BYTES
    max_headers: int = MAX_HEADERS


class Refused(Exception):
    """A request the connection answers itself, with ``status`` and the JSON error shape, then closes."""

    def __init__(self, status: int, message: str, code: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after_s = status, message, code, retry_after_s

    def response(self) -> bytes:
        type_ = "server_error" if self.status >= 500 else "invalid_request_error"
        body = error_body(self.message, type_, self.code)
        head = [f"HTTP/1.1 {self.status} {http.HTTPStatus(self.status).phrase}", "content-type: application/json",
                f"content-length: {len(body)}", "connection: close"]
        if self.retry_after_s is not None:
            head.append(f"retry-after: {self.retry_after_s}")
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body


_last_logged: dict[str, float] = {}


def _log_rarely(key: str, message: str, *args: Any) -> None:
    """A warning at most once per :data:`LOG_EVERY_S` per ``key``: a flood must not flood the log."""
    now = time.monotonic()
    if now - _last_logged.get(key, -LOG_EVERY_S) >= LOG_EVERY_S:
        _last_logged[key] = now
        log.warning(message + " (at most one such line per %gs)", *args, LOG_EVERY_S)


class GuardedHttpProtocol(CoalescingHttpToolsProtocol):
    """Select with ``uvicorn.run(..., http=GuardedHttpProtocol.with_limits(limits))``.

    Timers cost nothing on the usual path: a head that arrives whole, and a body that
    arrives with it, never arm one; only a connection that opens, a partial head and an
    unfinished body do (one timer each, re-armed only when it fires and bytes came meanwhile).
    """

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    #: This server's connections with no request under way, the longest idle first.
    idle: ClassVar[dict[GuardedHttpProtocol, None]] = {}

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[GuardedHttpProtocol]:
        return type(cls.__name__, (cls,), {"limits": limits, "idle": {}})

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._in_head = False
        self._head_bytes = self._body_bytes = self._body_mark = 0
        if len(self.connections) > self.limits.max_connections and not self._evict_idle():
            self._refuse(Refused(503, f"all {len(self.connections) - 1} open connections of the router are busy "
                                      f"(max_connections={self.limits.max_connections}); retry later",
                                 "too_many_connections", retry_after_s=1))
            return
        self.idle[self] = None
        self._arm_head_timer()  # a connection that never sends a byte is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self.idle.pop(self, None)
        self._cancel_timers()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._idle() and not self.transport.is_closing():
            self.idle[self] = None  # to the end: the longest idle is first

    def _evict_idle(self) -> bool:
        """At ``max_connections``: close the connection idle the longest (no request under way: a silent or
        slow one, a keep-alive one between requests) to make room; False when every one is busy."""
        oldest = next(iter(self.idle), None)
        if oldest is None:
            return False
        del self.idle[oldest]
        _log_rarely("evict", "max_connections=%d reached: closed the connection idle the longest",
                    self.limits.max_connections)
        oldest._cancel_timers()
        oldest.transport.close()
        return True

    def _unsupported_upgrade_warning(self) -> None:
        """uvicorn's two warnings for every Upgrade request (websocket, h2c), which is answered as plain HTTP."""
        _log_rarely("upgrade", "an Upgrade request was answered as plain HTTP (the router serves no websocket)")

    def data_received(self, data: bytes) -> None:
        """uvicorn's, with its parser errors (and this class's refusals) answered in JSON."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            self._refuse(cause if isinstance(cause, Refused) else Refused(
                400, f"invalid HTTP request: {exc}; send well-formed HTTP/1.1", "invalid_http_request"))
            return
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_head_bytes:
                self._refuse(Refused(431, f"request head is larger than {self.limits.max_head_bytes} bytes; "
                                          "send fewer or shorter headers", "request_header_fields_too_large"))
            elif self._head_timer is None:
                self._arm_head_timer()
        elif self._reading_body():
            if self._body_timer is None:
                self._arm_body_timer()
        elif self._idle() and self._head_timer is None and self.timeout_keep_alive_task is None:
            self._arm_head_timer()  # bytes between requests (a bare CRLF) still count against the deadline

    # -- parser callbacks ---------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_url_bytes:
            raise Refused(414, f"request URL is longer than {self.limits.max_url_bytes} bytes; send a shorter one "
                               "(the model goes in the body)", "uri_too_long")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= self.limits.max_headers:
            raise Refused(431, f"request has more than {self.limits.max_headers} headers; send fewer",
                          "request_header_fields_too_large")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self.idle.pop(self, None)
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    # -- helpers -------------------------------------------------------------------------------------

    def _idle(self) -> bool:
        """No request of this connection is being answered."""
        return self.cycle is None or self.cycle.response_complete

    def _reading_body(self) -> bool:
        """A request's head is in, its body is not, and nothing has answered it yet."""
        cycle = self.cycle
        return cycle is not None and cycle.more_body and not cycle.response_complete and not self._in_head

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)

    def _arm_body_timer(self) -> None:
        self._body_mark = self._body_bytes
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._idle():
            return
        if not self._in_head:  # nothing of a request sent: close quietly, as a keep-alive timeout does
            self.transport.close()
            return
        self._refuse(Refused(408, f"request head not complete within head_timeout_s="
                                  f"{self.limits.head_timeout_s:g}s; send the whole head at once", "request_timeout"))

    def _body_timed_out(self) -> None:
        """408 after ``body_timeout_s`` without a byte of the body; not while the router itself holds the
        client back (reading paused: the app has not taken what came, e.g. waiting for room for the body)."""
        self._body_timer = None
        if self.transport.is_closing() or not self._reading_body():
            return
        if self._body_bytes != self._body_mark or self.flow.read_paused:
            self._arm_body_timer()
            return
        self._refuse(Refused(408, f"request body: nothing received for {self.limits.body_timeout_s:g}s "
                                  "(body_timeout_s); send the whole body without pausing", "request_timeout"))

    def _refuse(self, refusal: Refused) -> None:
        _log_rarely(refusal.code, "refused a connection from %s: %d %s", self.client[0] if self.client else "?",
                    refusal.status, refusal.message)
        self.idle.pop(self, None)
        self._cancel_timers()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:
            self.transport.write(refusal.response())
        if cycle is not None and not cycle.response_complete:  # its app (reading a body) sees a disconnect
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def raise_open_file_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (logging both); the soft limit in force after."""
    try:
        import resource
    except ImportError:  # Windows: no rlimits
        return 8192
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("open-file limit: soft %d, hard %d; could not raise the soft limit: %s", soft, hard, exc)
            return int(soft)
    log.info("open-file limit: soft %d -> %d (hard %s)", soft, target,
             "unlimited" if hard == resource.RLIM_INFINITY else hard)
    return int(target)


def connection_limits(head_timeout_s: float, body_timeout_s: float, max_connections: int,
                      open_files: int) -> ConnectionLimits:
    """``max_connections`` 0 = auto: half of the open files left after a reserve for model processes,
    log files and the router's own connections to its backends (each proxied request holds one)."""
    auto = max(64, (open_files - 512) // 2)
    return ConnectionLimits(head_timeout_s, body_timeout_s, max_connections or auto)
