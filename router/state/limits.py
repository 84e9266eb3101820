"""Admission: per model ``max_concurrency`` in flight, ``max_queue`` waiting, then 429; router-wide,
the bytes of request bodies held in memory (:class:`BodyBudget`), then 503."""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections import deque
from types import TracebackType
from typing import Protocol

from router.edge.errors import RouterBusy, TooManyRequests

__all__ = ["CURRENT_WAITER", "BodyBudget", "Limiter", "QueueWaiter", "note_queue_wait"]


class QueueWaiter(Protocol):
    """What the limiter tells of a request that waited for a slot (router.api.activity's RequestRecord)."""

    queue_s: float


#: The record of the request running in this context; router.api.activity sets it around each exchange.
CURRENT_WAITER: contextvars.ContextVar[QueueWaiter | None] = contextvars.ContextVar("ovrouter_request", default=None)


def note_queue_wait(waited_s: float) -> None:
    """Add a wait for a slot to the current request's record, if one is being kept."""
    record = CURRENT_WAITER.get()
    if record is not None:
        record.queue_s += waited_s

MIB = 1024 * 1024


class Limiter:
    """An async context manager: enter takes a slot (waiting in FIFO order) or raises 429.

    Invariant: ``in_flight <= max_concurrency`` and ``queued <= max_queue``; a request that
    finds the queue full is refused at once instead of waiting without bound.
    """

    def __init__(self, name: str, max_concurrency: int, max_queue: int, retry_after_s: float = 1.0) -> None:
        self.name = name
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.queued = 0
        self._slots = asyncio.Semaphore(max_concurrency)

    async def __aenter__(self) -> Limiter:
        if self._slots.locked():
            if self.queued >= self.max_queue:
                raise TooManyRequests(
                    f"model {self.name!r} is at capacity ({self.max_concurrency} in flight, {self.queued} queued; "
                    f"max_concurrency={self.max_concurrency}, max_queue={self.max_queue}); retry later",
                    retry_after_s=self.retry_after_s,
                )
            self.queued += 1
            began = time.perf_counter()
            try:
                await self._slots.acquire()
            finally:
                self.queued -= 1
                note_queue_wait(time.perf_counter() - began)
        else:
            await self._slots.acquire()
        self.in_flight += 1
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.in_flight -= 1
        self._slots.release()


class BodyBudget:
    """Router-wide bound on the request bodies held in memory: ``take(n)`` before a body is read,
    ``give(n)`` when its request is over. Waiters are served in FIFO order; one that waits longer
    than ``wait_s`` gets 503 with Retry-After.

    A body is charged what its ``Content-Length`` declares before any of it is read, so bodies
    never deadlock half-read: one in, whole, or it waits with its bytes still in the client's
    socket. The limit is never below the largest single body allowed (``floor``), so any one
    request fits an empty budget.
    """

    def __init__(self, limit_bytes: int, wait_s: float, retry_after_s: float = 1.0) -> None:
        self.limit_bytes = limit_bytes
        self.wait_s = wait_s
        self.retry_after_s = retry_after_s
        self.held = 0
        self._floor = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def effective_limit(self) -> int:
        return max(self.limit_bytes, self._floor)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def configure(self, limit_bytes: int, wait_s: float, floor_bytes: int) -> None:
        """New settings (a reload); a raised limit lets waiters in at once."""
        self.limit_bytes, self.wait_s, self._floor = limit_bytes, wait_s, floor_bytes
        self._grant()

    async def take(self, n: int) -> None:
        if not self._waiters and self.held + n <= self.effective_limit:
            self.held += n
            return
        entry = (n, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(self.wait_s):
                await entry[1]
        except BaseException as exc:
            if entry[1].done() and not entry[1].cancelled():  # granted just as the wait ended
                self.give(n)
            elif entry in self._waiters:
                self._waiters.remove(entry)
                self._grant()  # the head may have been the one that did not fit
            if isinstance(exc, TimeoutError):
                raise RouterBusy(
                    f"the router holds {self.held / MIB:.0f} MiB of request bodies (max_buffered_body_mb="
                    f"{self.limit_bytes / MIB:.0f}) and found no room for {n / MIB:.1f} MiB within "
                    f"body_wait_s={self.wait_s:g}s; retry later", retry_after_s=self.retry_after_s) from None
            raise

    def give(self, n: int) -> None:
        self.held -= n
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.held + self._waiters[0][0] <= self.effective_limit:
            n, future = self._waiters.popleft()
            if not future.done():
                self.held += n
                future.set_result(None)
