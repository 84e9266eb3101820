"""Per-model admission: ``max_concurrency`` in flight, ``max_queue`` waiting, then 429."""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

from router.activity import note_queue_wait
from router.errors import TooManyRequests

__all__ = ["Limiter"]


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
