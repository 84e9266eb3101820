"""Streaming: time to first byte and the gap between SSE events, direct vs through the proxies.

The trivial backend streams a role delta at once, then ``chunks`` deltas ``chunk_gap_ms``
apart. A proxy that buffers shows up as a larger TTFB and a lumpy gap distribution (many
~0 gaps followed by long ones); one that passes chunks through adds only its hop latency.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import urlsplit

from bench import plots
from bench.common import Context, Section, Table, percentile
from bench.overhead import CHAT, TRIVIAL_MODEL, start_backends

__all__ = ["StreamSample", "run", "stream_many"]

log = logging.getLogger(__name__)

STREAM_BODY = json.dumps(
    {"model": TRIVIAL_MODEL, "stream": True, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}
).encode()
EXPECTED_EVENTS = 16 + 3  # role delta, 16 content deltas, the finish delta, [DONE]


@dataclass(slots=True)
class StreamSample:
    """One streamed request as the client saw it."""

    ttfb_ms: float = float("nan")
    gaps_ms: list[float] = field(default_factory=list)
    events: int = 0
    total_ms: float = float("nan")
    status: int = 0
    error: str = ""


class _StreamProtocol(asyncio.Protocol):
    """Sends one request, timestamps every body piece, counts SSE ``data:`` events."""

    def __init__(self, request: bytes, done: asyncio.Future[StreamSample]) -> None:
        import httptools

        self._parser = httptools.HttpResponseParser(self)
        self._request = request
        self._done = done
        self.sample = StreamSample()
        self._start = 0.0
        self._last = 0.0
        self._pending = b""  # bytes of an SSE event whose blank-line terminator has not arrived yet

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._start = time.perf_counter()
        cast(asyncio.Transport, transport).write(self._request)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except Exception as exc:  # noqa: BLE001 - a malformed answer is this request's error
            self._finish(f"bad response: {exc}")

    def on_headers_complete(self) -> None:
        self.sample.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        """An event counts when its terminating blank line arrives (a proxy may split or merge chunks)."""
        now = time.perf_counter()
        if math.isnan(self.sample.ttfb_ms):
            self.sample.ttfb_ms = (now - self._start) * 1000
        data = (self._pending + body).replace(b"\r\n", b"\n")
        *complete, self._pending = data.split(b"\n\n")
        count = sum(1 for event in complete if event.strip())
        if not count:
            return
        first_gap = (now - self._last) * 1000 if self.sample.events else None
        if first_gap is not None:
            self.sample.gaps_ms.append(first_gap)
        self.sample.gaps_ms.extend([0.0] * (count - 1))  # events that arrived in the same read
        self.sample.events += count
        self._last = now

    def on_message_complete(self) -> None:
        self.sample.total_ms = (time.perf_counter() - self._start) * 1000
        self._finish("")

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish("connection closed before the end of the stream")

    def _finish(self, error: str) -> None:
        if not self._done.done():
            self.sample.error = error or ("" if self.sample.status == 200 else f"status {self.sample.status}")
            self._done.set_result(self.sample)


def _request(url: str, body: bytes) -> tuple[str, int, bytes]:
    parts = urlsplit(url)
    head = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return parts.hostname or "127.0.0.1", parts.port or 80, head.encode() + body


async def _one(url: str, body: bytes) -> StreamSample:
    host, port, request = _request(url, body)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[StreamSample] = loop.create_future()
    try:
        transport, _ = await loop.create_connection(lambda: _StreamProtocol(request, done), host, port)
    except OSError as exc:
        return StreamSample(error=f"connect: {exc}")
    try:
        return await asyncio.wait_for(done, 30)
    except TimeoutError:
        return StreamSample(error="timeout")
    finally:
        transport.close()


async def _streams(url: str, body: bytes, concurrency: int, per_worker: int) -> list[StreamSample]:
    async def worker() -> list[StreamSample]:
        return [await _one(url, body) for _ in range(per_worker)]

    batches = await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [sample for batch in batches for sample in batch]


def stream_many(url: str, body: bytes, concurrency: int, per_worker: int) -> list[StreamSample]:
    """``concurrency`` workers each stream ``per_worker`` requests back to back (a new connection each)."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_streams(url, body, concurrency, per_worker))


def _figures(samples: list[StreamSample]) -> dict[str, float]:
    good = [s for s in samples if not s.error and s.events >= EXPECTED_EVENTS]
    ttfb = [s.ttfb_ms for s in good]
    gaps = [g for s in good for g in s.gaps_ms]
    return {"ttfb50": percentile(ttfb, 50), "ttfb99": percentile(ttfb, 99), "gap50": percentile(gaps, 50),
            "gap99": percentile(gaps, 99), "errors": float(sum(1 for s in samples if s.error)),
            "short": float(sum(1 for s in samples if not s.error and s.events < EXPECTED_EVENTS))}


def _row(concurrency: int, name: str, count: int, own: dict[str, float], base: dict[str, float]) -> list[object]:
    return [concurrency, name, count, int(own["errors"]), int(own["short"]), own["ttfb50"], own["ttfb99"],
            own["ttfb50"] - base["ttfb50"], own["gap50"], own["gap99"], own["gap50"] - base["gap50"]]


def _error_note(name: str, concurrency: int, samples: list[StreamSample]) -> str | None:
    kinds: dict[str, int] = {}
    for s in samples:
        if s.error or s.events < EXPECTED_EVENTS:
            kind = s.error or f"stream ended after {s.events} events"
            kinds[kind] = kinds.get(kind, 0) + 1
    if not kinds:
        return None
    listed = "; ".join(f"{count}x {kind}" for kind, count in sorted(kinds.items(), key=lambda kv: -kv[1]))
    return f"{name} at {concurrency} stream(s): {listed}."


HEADERS = ["streams", "target", "requests", "errors", f"short (< {EXPECTED_EVENTS} events)", "TTFB p50 ms",
           "TTFB p99 ms", "+TTFB p50 ms", "gap p50 ms", "gap p99 ms", "+gap p50 ms"]


def run(ctx: Context) -> Section:
    section = Section("streaming", "Streaming: time to first byte and inter-chunk gap")
    backends = start_backends(ctx, "streaming")
    section.notes.extend(backends.notes)
    if backends.router_error:
        section.status = "failed"
    targets = backends.targets()
    levels = [(1, ctx.count(150, 10)), (16, ctx.count(12, 2))]
    samples: dict[tuple[int, str], list[StreamSample]] = {}
    for url in targets.values():
        stream_many(url + CHAT, STREAM_BODY, 2, 2)  # warm-up
    for concurrency, per_worker in levels:
        for name, url in targets.items():
            samples[(concurrency, name)] = stream_many(url + CHAT, STREAM_BODY, concurrency, per_worker)
    section.intro = (
        "Each request streams 18 SSE events from the trivial backend (a role delta at once, 16 deltas 2 ms apart, "
        "the finish delta and `[DONE]`), on a new connection. TTFB = request written -> first body byte; "
        "gap = time between consecutive complete SSE events as they arrive (events completed by the same read "
        "count 0 ms). Percentiles over the complete streams only; errors and short streams are counted apart."
    )
    rows = []
    for concurrency, _ in levels:
        base = _figures(samples[(concurrency, "direct")])
        for name in targets:
            own = _figures(samples[(concurrency, name)])
            section.data[f"{name}@{concurrency}"] = own
            rows.append(_row(concurrency, name, len(samples[(concurrency, name)]), own, base))
            note = _error_note(name, concurrency, samples[(concurrency, name)])
            if note:
                section.notes.append(note)
    section.tables.append(Table(HEADERS, rows, "Percentiles over every request / every gap of every request."))
    panels = {
        "TTFB, 1 stream": {n: [s.ttfb_ms for s in samples[(1, n)] if not s.error] for n in targets},
        "inter-event gap, 1 stream": {n: [g for s in samples[(1, n)] for g in s.gaps_ms if g > 0] for n in targets},
    }
    section.plots.append(plots.distributions(ctx.plot_path("streaming"), "Streaming latency (CDF)", panels))
    return section
