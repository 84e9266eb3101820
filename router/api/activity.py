"""What each proxied request did: queue wait, time to first token, tokens, status; recent and in-flight.

:meth:`Activity.run` wraps one proxied exchange (``router.app`` calls it around ``forward``).
It hands the exchange a ``send`` that watches the response go by — the first streamed
token, the number of token events, the ``usage`` object when the answer carries one — at
the cost of a few comparisons per chunk, and never changes a byte of it. When the
request streams and its model is not ready, the cold-start feedback of
:mod:`router.path.loading` speaks first.

Figures, per request: ``queue_s`` (waiting for a ``max_concurrency`` slot), ``ttft_s``
(request arrival to the first token event of a stream), ``itl_s`` (mean time between
token events after the first), ``prompt_tokens``/``completion_tokens`` (from ``usage``;
without one, completion tokens are the number of token events of the stream).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import re
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.types import Message, Send

from procman import State
from router.api.events import EventBus
from router.edge.errors import RouterError, error_body
from router.path.framing import NDJSON
from router.path.loading import Feedback
from router.state.limits import CURRENT_WAITER

if TYPE_CHECKING:
    from router.metrics import Metrics
    from router.path.request import ProxyRequest
    from router.state.registry import Model

__all__ = ["Activity", "Cancelled", "ModelStats", "RequestRecord"]

log = logging.getLogger(__name__)

RECENT = 200
WINDOW_S = 300.0  # requests/min, TTFT p50 and tokens/s look this far back
SPARK_BUCKETS, SPARK_BUCKET_S = 30, 10.0
_USAGE = re.compile(rb'"usage"\s*:\s*\{[^{}]*?"prompt_tokens"\s*:\s*(\d+)[^{}]*?"completion_tokens"\s*:\s*(\d+)')
_TOKEN_EVENT = b'"finish_reason":null'
#: The Responses API's (modelserver/api/responses.py): text deltas, and usage as input/output tokens.
_RESPONSES_TOKEN_EVENT = b'"type":"response.output_text.delta"'
#: Anthropic's Messages API (modelserver/api/messages.py): content block deltas; its usage has the same names.
_MESSAGES_TOKEN_EVENT = b'"type":"content_block_delta"'
_RESPONSES_USAGE = re.compile(rb'"usage"\s*:\s*\{\s*"input_tokens"\s*:\s*(\d+).*?"output_tokens"\s*:\s*(\d+)', re.S)
#: Messages usage: ``input_tokens`` leave out the prompt tokens read from the cache, counted here.
_CACHE_READ = re.compile(rb'"cache_read_input_tokens"\s*:\s*(\d+)')
#: Ollama's NDJSON streams (/ollama/api/chat, /generate): a token line, and the counts of the final object.
_ND_TOKEN = b'"done":false'
_ND_USAGE = re.compile(rb'"prompt_eval_count"\s*:\s*(\d+)[^{}]*?"eval_count"\s*:\s*(\d+)')

class Cancelled(RouterError):
    status, type, code = 503, "server_error", "request_cancelled"


@dataclass(slots=True, eq=False)
class RequestRecord:
    id: int
    model: str
    path: str
    client: str | None
    started_at: float  # wall clock
    t0: float  # perf_counter at arrival
    status: int | None = None
    queue_s: float = 0.0
    ttft_s: float | None = None
    duration_s: float | None = None
    last_token_t: float | None = None
    token_events: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    stream: bool = False
    state: str = "running"  # running | done | cancelled | disconnected
    task: asyncio.Task[Any] | None = field(default=None, repr=False)

    @property
    def itl_s(self) -> float | None:
        if self.ttft_s is None or self.last_token_t is None or self.token_events < 2:
            return None
        return (self.last_token_t - self.t0 - self.ttft_s) / (self.token_events - 1)

    @property
    def tokens_per_s(self) -> float | None:
        tokens = self.completion_tokens or 0
        if self.ttft_s is None or self.last_token_t is None or tokens < 2:
            return None
        span = self.last_token_t - self.t0 - self.ttft_s
        return (tokens - 1) / span if span > 0 else None

    def row(self) -> dict[str, Any]:
        elapsed = self.duration_s if self.duration_s is not None else time.perf_counter() - self.t0
        return {
            "id": self.id, "model": self.model, "path": self.path, "client": self.client,
            "started_at": self.started_at, "state": self.state, "status": self.status,
            "duration_s": _r(elapsed), "queue_s": _r(self.queue_s), "ttft_s": _r(self.ttft_s),
            "itl_s": _r(self.itl_s), "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "tokens_per_s": _r(self.tokens_per_s), "stream": self.stream,
        }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


#: What the figures keep of a finished request: (started_at, status, ttft_s, tokens_per_s). A plain tuple of
#: numbers, which the garbage collector stops tracking; a window of whole records (each holding its task) put
#: some thousand short-lived objects in front of every full collection.
Sample = tuple[float, int | None, float | None, float | None]


class ModelStats:
    """The last few minutes of one model's finished requests, for the dashboard's figures."""

    def __init__(self) -> None:
        self._done: collections.deque[Sample] = collections.deque(maxlen=2000)

    def add(self, record: RequestRecord) -> None:
        self._done.append((record.started_at, record.status, record.ttft_s, record.tokens_per_s))

    def figures(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        recent = [sample for sample in self._done if now - sample[0] <= WINDOW_S]
        last_minute = sum(1 for started_at, *_ in recent if now - started_at <= 60)
        ttfts = [ttft for _, _, ttft, _ in recent if ttft is not None][-100:]
        speeds = [speed for *_, speed in recent if speed is not None][-100:]
        spark = [0] * SPARK_BUCKETS
        for started_at, *_ in recent:
            age = int((now - started_at) // SPARK_BUCKET_S)
            if 0 <= age < SPARK_BUCKETS:
                spark[SPARK_BUCKETS - 1 - age] += 1
        return {
            "requests_per_min": last_minute,
            "ttft_p50_s": _r(statistics.median(ttfts)) if ttfts else None,
            "tokens_per_s": round(statistics.fmean(speeds), 1) if speeds else None,
            "errors_5m": sum(1 for _, status, *_ in recent if (status or 0) >= 500),
            "sparkline": spark,
        }


class Activity:
    """In-flight and recent requests of one router, their metrics, and their events."""

    def __init__(self, metrics: Metrics, bus: EventBus, estimate: Callable[[str], float | None]) -> None:
        self.metrics = metrics
        self.bus = bus
        self.estimate = estimate
        self.in_flight: dict[int, RequestRecord] = {}
        self.recent: collections.deque[RequestRecord] = collections.deque(maxlen=RECENT)
        self.stats: dict[str, ModelStats] = {}
        self._ids = itertools.count(1)

    def rows(self) -> list[dict[str, Any]]:
        """In-flight requests first (oldest first), then the finished ones (newest first)."""
        return [r.row() for r in self.in_flight.values()] + [r.row() for r in reversed(self.recent)]

    def cancel(self, request_id: int) -> bool:
        record = self.in_flight.get(request_id)
        if record is None or record.task is None or record.state != "running":
            return False
        log.info("%s request %d cancelled by the operator", record.model, request_id)
        record.state = "cancelled"
        record.task.cancel()
        return True

    async def run(
        self, model: Model, req: ProxyRequest, client: str | None, send: Send, work: Callable[[Send], Awaitable[int]]
    ) -> int:
        """Run ``work(send)`` (the proxied exchange), observing what it sends; returns its status."""
        name = model.spec.name
        path = req.path.partition("?")[0]
        record = RequestRecord(next(self._ids), name, path, client, time.time(), time.perf_counter(),
                               task=asyncio.current_task())
        self.in_flight[record.id] = record
        if self.bus.subscribers:
            self.bus.publish("request", record.row())
        token = CURRENT_WAITER.set(record)
        # cold-start feedback only for a model that is not ready (the usual case: none, and no estimate looked up)
        feedback = None if model.backend.state is State.READY else Feedback.maybe(model, req, send,
                                                                                   self.estimate(name))
        watcher = _Watcher(record, feedback, send)
        try:
            status = await work(watcher)
            record.status = status if record.status is None else record.status
            return status
        except asyncio.CancelledError:
            if record.state != "cancelled":
                record.state = "disconnected"
                raise
            if record.task is not None:
                record.task.uncancel()
            return await watcher.fail(Cancelled(f"request {record.id} to model {record.model!r} was cancelled by "
                                                "the operator"))
        except RouterError as exc:
            return await watcher.fail(exc)
        finally:
            CURRENT_WAITER.reset(token)
            if feedback is not None:
                await feedback.stop()
            self._finish(record)

    def _finish(self, record: RequestRecord) -> None:
        record.duration_s = time.perf_counter() - record.t0
        record.task = None  # cancel() is for requests in flight; a finished one must not keep its task alive
        if record.state == "running":
            record.state = "done"
        self.in_flight.pop(record.id, None)
        self.recent.append(record)
        stats = self.stats.get(record.model)
        if stats is None:
            stats = self.stats[record.model] = ModelStats()
        stats.add(record)
        self.metrics.observe_activity(record.model, record.queue_s, record.ttft_s, record.itl_s,
                                      record.prompt_tokens, record.completion_tokens)
        if self.bus.subscribers:
            self.bus.publish("request", record.row())

    def forget(self, model: str) -> None:
        self.stats.pop(model, None)


class _Watcher:
    """The ``send`` handed to the exchange: records what goes by, lets cold-start feedback speak first."""

    __slots__ = ("record", "feedback", "send", "_sse", "_nd", "_opening", "_tail", "_head", "_ended")

    def __init__(self, record: RequestRecord, feedback: Feedback | None, send: Send) -> None:
        self.record = record
        self.feedback = feedback
        self.send = send
        self._sse = False
        self._nd = False  # an NDJSON stream (Ollama's)
        self._opening = True
        self._tail = b""
        self._head = False
        self._ended = False

    async def __call__(self, message: Message) -> None:
        if message["type"] != "http.response.body":
            await self._start(message)
            return
        if self._sse or self._nd:
            self._observe(message.get("body", b""))
        if not message.get("more_body", False):
            self._ended = True
            self._usage(self._tail if self._sse or self._nd else message.get("body", b""))
        if self.feedback is not None and self.feedback.rewrites:
            await self.feedback.relay_body(message)
        else:
            await self.send(message)

    async def _start(self, message: Message) -> None:
        record = self.record
        record.status = message["status"]
        for key, value in message.get("headers", ()):
            if key.lower() == b"content-type":
                self._sse = value.startswith(b"text/event-stream")
                self._nd = value.startswith(b"application/x-ndjson")
        record.stream = self._sse or self._nd
        self._head = True
        if self.feedback is not None and await self.feedback.upstream_start(message, self._sse):
            return  # the feedback already sent the response head
        await self.send(message)

    def _observe(self, body: bytes) -> None:
        record = self.record
        if self._nd:
            events = body.count(_ND_TOKEN)
        else:
            events = body.count(_TOKEN_EVENT) or body.count(_RESPONSES_TOKEN_EVENT) or body.count(_MESSAGES_TOKEN_EVENT)
        if self._opening and events and not self._nd and b'"role"' in body and _TOKEN_EVENT in body:
            events -= 1  # the chat stream's opening chunk carries the role, not a token
        self._opening = False
        if events:
            now = time.perf_counter()
            if record.ttft_s is None:
                record.ttft_s = now - record.t0
            record.last_token_t = now
            record.token_events += events
        if b'"usage"' in body or b'"eval_count"' in body or self._tail:
            self._tail = (self._tail + body)[-4096:]

    def _usage(self, body: bytes) -> None:
        """``usage`` of the answer: the last one in the body (OpenAI servers put it last), digits only."""
        record = self.record
        at = body.rfind(b'"usage"')
        found = (_USAGE.match(body, at) or _RESPONSES_USAGE.match(body, at)) if at >= 0 else None
        if found is None and (at := body.rfind(b'"prompt_eval_count"')) >= 0:  # Ollama's final object
            found = _ND_USAGE.match(body, at)
        if found:
            record.prompt_tokens, record.completion_tokens = int(found[1]), int(found[2])
            if (cached := _CACHE_READ.search(body, at, body.find(b"}", at) + 1 or len(body))) is not None:
                record.prompt_tokens += int(cached[1])  # Anthropic's input_tokens are the uncached part
            return
        if self._sse and record.token_events:
            record.completion_tokens = record.token_events

    async def fail(self, exc: RouterError) -> int:
        """An error once a response head went out: an SSE stream gets one error event, then the body ends.

        With no head sent yet the error is raised again, for the caller to answer as usual."""
        self.record.status = exc.status
        if self.feedback is not None:
            await self.feedback.stop()
        head = self._head or (self.feedback is not None and self.feedback.head_sent)
        if not head or self._ended:
            raise exc
        self._ended = True
        if self._nd:
            await self.send({"type": "http.response.body", "body": NDJSON.error(exc.message, exc.code, exc.status),
                             "more_body": True})
        elif self._sse or self.feedback is not None:
            await self.send({"type": "http.response.body", "body": error_event(exc) + DONE, "more_body": True})
        await self.send({"type": "http.response.body", "body": b""})
        return exc.status


#: The end of an OpenAI stream, after its error event too (as a mid-stream failure ends).
DONE = b"data: [DONE]\n\n"


def error_event(exc: RouterError) -> bytes:
    return b"data: " + error_body(exc.message, exc.type, exc.code, exc.param) + b"\n\n"
