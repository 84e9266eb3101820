"""The services every backend of one manager shares: spawner, prober, clock, addresses, hooks.

Injecting them (instead of calling ``time`` and ``subprocess`` directly) is what lets the
state machine run under a fake spawner and a fake clock in unit tests, with no sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from procman.address import AddressAllocator
from procman.notices import Notice, Notices
from procman.prober import Prober
from procman.spawner import Spawner, Where

if TYPE_CHECKING:
    from procman.backend import Backend

__all__ = ["BeforeStart", "Runtime", "Sleep", "wait_done"]

Sleep = Callable[[float], Awaitable[Any]]
#: A step before a backend's start from no process (device checks, making room); raising BackendUnavailable
#: refuses the start.
BeforeStart = Callable[["Backend"], Awaitable[None]]


@dataclass(slots=True)
class Runtime:
    allocator: AddressAllocator
    spawner: Spawner
    prober: Prober
    clock: Callable[[], float]
    sleep: Sleep
    log_dir: Path
    notices: Notices = field(default_factory=Notices)
    #: run in order before a start from no process, then ``room`` (the manager's make_room)
    before_start: list[BeforeStart] = field(default_factory=list)
    room: BeforeStart | None = None
    on_change: Callable[[Backend], None] | None = None
    log_lines: int = 1000
    #: an engine with nodes: where a backend's start was placed (None: the local engine)
    locate: Callable[[Backend], Where] | None = None

    def publish(self, notice: Notice) -> None:
        """Hand ``notice`` to its subscribers; a failing subscriber is only logged."""
        self.notices.publish(notice)

    async def prepare(self, backend: Backend) -> None:
        """Run every ``before_start`` hook in order, then make room (the first that raises refuses the start)."""
        for hook in list(self.before_start):
            await hook(backend)
        if self.room is not None:
            await self.room(backend)

    def changed(self, backend: Backend) -> None:
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
