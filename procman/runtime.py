"""The services every backend of one manager shares: spawner, prober, clock, addresses, hooks.

Injecting them (instead of calling ``time`` and ``subprocess`` directly) is what lets the
state machine run under a fake spawner and a fake clock in unit tests, with no sleeps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from procman.address import AddressAllocator
from procman.prober import Prober
from procman.spawner import Spawner, Where
from procman.states import State

if TYPE_CHECKING:
    from procman.backend import Backend

__all__ = ["Listener", "Runtime", "Sleep", "wait_done"]

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[Any]]


class Listener(Protocol):
    """Observer of backends (metrics, the event bus, logging). Every method is optional; errors are logged.

    ``backend.snapshot()["reason"]`` names why the last start, stop or restart happened. A
    listener may also have ``on_evict(backend, target, reason)``: the manager stopped
    ``backend`` to make room for ``target`` (reason ``memory`` or ``max_loaded``).
    """

    def on_transition(self, backend: Backend, old: State, new: State) -> None: ...

    def on_start(self, backend: Backend, reason: str, ok: bool, duration_s: float) -> None:
        """A start attempt ended; reason: cold, crash, fatal, hang, reload, manual."""
        ...

    def on_restart(self, backend: Backend, reason: str) -> None:
        """A running backend is being replaced (crash, hang, fatal, manual)."""
        ...

    def on_stop(self, backend: Backend, reason: str) -> None:
        """A backend was stopped on purpose (idle, unload, reload, shutdown, evict...)."""
        ...


@dataclass(slots=True)
class Runtime:
    allocator: AddressAllocator
    spawner: Spawner
    prober: Prober
    clock: Callable[[], float]
    sleep: Sleep
    log_dir: Path
    listeners: list[Listener] = field(default_factory=list)
    before_start: Callable[[Backend], Awaitable[None]] | None = None
    on_change: Callable[[Backend], None] | None = None
    log_lines: int = 1000
    #: an engine with nodes: where a backend's start was placed (None: the local engine)
    locate: Callable[[Backend], Where] | None = None

    def notify(self, method: str, *args: object) -> None:
        """Call ``listener.<method>(*args)`` on every listener that has it; a failing listener is only logged."""
        for listener in self.listeners:
            callback = getattr(listener, method, None)
            if callback is None:
                continue
            try:
                callback(*args)
            except Exception:
                log.exception("listener %s failed", method)

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
