"""An in-process event bus: publish from anywhere, subscribe with a bounded queue, encode as SSE.

The router publishes what an operator watches (``GET /api/events``, the ``/ui`` dashboard)
and what clients' model-status APIs stream (``/models/sse``)::

    bus = EventBus()
    bus.publish("state", {"model": "smollm2", "state": "ready"})     # sync, never blocks

    async with bus.subscribe() as sub:             # or bus.subscribe({"state"}) for some kinds
        async for event in sub:                    # Event(id, kind, data, at)
            await send(event.sse())                # b"id: 7\\nevent: state\\ndata: {...}\\n\\n"

Each subscriber has its own bounded queue (``queue_size``). A subscriber that does not
keep up never slows the publisher nor the other subscribers: when its queue is full, what
it had queued is dropped and it gets one ``resync`` event instead (``data.lost`` counts
the dropped events), its cue to fetch a fresh snapshot (``GET /api/models``).

Kinds the router publishes (``data`` always holds ``model`` where one model is meant):

    state     a model changed state: model, state, old, pid, reason (of the last start/stop/restart)
    loading   a model's start in progress: model, elapsed_s, estimate_s (published every second)
    loaded    a start ended: model, ok, duration_s, reason
    restart   a running model is being replaced: model, reason
    evict     a model was stopped to make room: model, reason (memory, max_loaded), for, device, size_bytes,
              budget_bytes, at
    rolling   a rolling change: model, phase (starting, switched, failed), reason (reload, manual), old_pid, pid,
              error
    request   a proxied request finished: the recent-requests row (see router.api.activity)
    reload    a config reload: ok, errors, diff
    resync    (per subscriber) events were dropped; reload the snapshot
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from router.path.framing import sse_comment  # re-exported: the dashboard's streams use it too

__all__ = ["Event", "EventBus", "Subscription", "sse_comment"]

DEFAULT_QUEUE_SIZE = 512


@dataclass(frozen=True, slots=True)
class Event:
    id: int
    kind: str
    data: Mapping[str, Any]
    at: float  # wall clock, seconds

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "at": self.at, "data": dict(self.data)}

    def sse(self) -> bytes:
        """This event as one server-sent event (``id``, ``event``, one ``data`` line of JSON)."""
        payload = json.dumps(self.data, separators=(",", ":"), default=str)
        return f"id: {self.id}\nevent: {self.kind}\ndata: {payload}\n\n".encode()


class Subscription:
    """One subscriber's bounded queue; iterate it, or ``await get()``."""

    def __init__(self, bus: EventBus, kinds: frozenset[str] | None, queue_size: int) -> None:
        self._bus = bus
        self.kinds = kinds
        self._queue: asyncio.Queue[Event] = asyncio.Queue(queue_size)
        self.lost = 0

    def offer(self, event: Event) -> None:
        if self.kinds is not None and event.kind not in self.kinds:
            return
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.lost += self._queue.qsize() + 1
            while not self._queue.empty():
                self._queue.get_nowait()
            self._queue.put_nowait(Event(event.id, "resync", {"lost": self.lost}, event.at))

    async def get(self) -> Event:
        return await self._queue.get()

    def pending(self) -> int:
        return self._queue.qsize()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        while True:
            yield await self._queue.get()


class EventBus:
    """Fan-out of events to subscribers; ``publish`` is synchronous and O(subscribers)."""

    def __init__(self, queue_size: int = DEFAULT_QUEUE_SIZE) -> None:
        self.queue_size = queue_size
        self._subscribers: set[Subscription] = set()
        self._ids = itertools.count(1)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def publish(self, kind: str, data: Mapping[str, Any]) -> Event:
        event = Event(next(self._ids), kind, data, time.time())
        for subscription in self._subscribers:
            subscription.offer(event)
        return event

    @contextlib.asynccontextmanager
    async def subscribe(self, kinds: Collection[str] | None = None) -> AsyncIterator[Subscription]:
        """Events published while the block runs (of ``kinds`` only, when given)."""
        subscription = Subscription(self, frozenset(kinds) if kinds is not None else None, self.queue_size)
        self._subscribers.add(subscription)
        try:
            yield subscription
        finally:
            self._subscribers.discard(subscription)
