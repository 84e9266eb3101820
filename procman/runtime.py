"""The services every backend of one manager shares: spawner, prober, clock, addresses, hooks.

Injecting them (instead of calling ``time`` and ``subprocess`` directly) is what lets the
state machine run under a fake spawner and a fake clock in unit tests, with no sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from procman.address import AddressAllocator
from procman.notices import Notice, Notices
from procman.prober import Prober
from procman.spawner import Spawner, Where

__all__ = ["Hook", "Runtime", "Sleep", "unless_aborted", "wait_done"]

#: The backend type (procman.backend.Backend, which imports this module): a parameter, so the import goes one way.
B = TypeVar("B")

Sleep = Callable[[float], Awaitable[Any]]
#: A step before a backend's start from no process (device checks, making room); raising BackendUnavailable
#: refuses the start. ``Hook[Backend]`` is procman's ``BeforeStart``.
Hook = Callable[[B], Awaitable[None]]


@dataclass(slots=True)
class Runtime(Generic[B]):
    allocator: AddressAllocator
    spawner: Spawner
    prober: Prober
    clock: Callable[[], float]
    sleep: Sleep
    log_dir: Path
    notices: Notices = field(default_factory=Notices)
    #: run in order before a start from no process, then ``room`` (the manager's make_room)
    before_start: list[Hook[B]] = field(default_factory=list)
    room: Hook[B] | None = None
    on_change: Callable[[B], None] | None = None
    log_lines: int = 1000
    #: an engine with nodes: where a backend's start (counted under a key: its name, or a rolling start's) was
    #: placed (None: the local engine)
    locate: Callable[[B, str], Where] | None = None
    #: rolling replacements (procman/rolling.py): whether a second process of a backend fits beside the current
    #: one now; make room for it (counted under a key) without stopping the current one; the new process took
    #: over (the old one's key, the new one's)
    fits_beside: Callable[[B], bool] | None = None
    beside: Callable[[B, str], Awaitable[None]] | None = None
    switched: Callable[[B, str, str], None] | None = None

    def publish(self, notice: Notice) -> None:
        """Hand ``notice`` to its subscribers; a failing subscriber is only logged."""
        self.notices.publish(notice)

    async def prepare(self, backend: B) -> None:
        """Run every ``before_start`` hook in order, then make room (the first that raises refuses the start)."""
        for hook in list(self.before_start):
            await hook(backend)
        if self.room is not None:
            await self.room(backend)

    def changed(self, backend: B) -> None:
        """A backend handled an event (its state, in-flight count or room may have changed)."""
        if self.on_change is not None:
            self.on_change(backend)

    async def wait_done(self, future: asyncio.Future[Any], timeout_s: float) -> bool:
        """Whether ``future`` finished within ``timeout_s`` of this runtime's clock (it is never cancelled)."""
        return await wait_done(future, timeout_s, self.sleep)


async def wait_done(future: asyncio.Future[Any], timeout_s: float, sleep: Sleep) -> bool:
    if future.done():
        return True
    timer = asyncio.ensure_future(sleep(max(timeout_s, 0.0)))
    try:
        await asyncio.wait({future, timer}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
    return future.done()


async def unless_aborted(abort: asyncio.Event, step: Awaitable[None]) -> bool:
    """Await ``step`` unless ``abort`` is set first (``step`` is then cancelled): False when aborted. What
    ``step`` raises is raised."""
    task = asyncio.ensure_future(step)
    aborted = asyncio.ensure_future(abort.wait())
    try:
        await asyncio.wait({task, aborted}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        aborted.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return False
    task.result()
    return True
