"""The owner of every backend of one router: adds, finds, removes, makes room, shuts them all down."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from procman.address import AddressAllocator
from procman.backend import Backend
from procman.errors import BackendUnavailable
from procman.prober import HttpProber, Prober
from procman.room import Member, Scope, victims
from procman.runtime import Listener, Runtime, Sleep
from procman.spawner import Spawner, SubprocessSpawner
from procman.spec import BackendSpec
from procman.states import State

__all__ = ["ProcessManager"]

log = logging.getLogger(__name__)

#: Extra seconds a shutdown grants beyond the longest stop_timeout_s before it SIGKILLs what is left.
SHUTDOWN_GRACE_S = 10.0
#: Retry-After of a start refused because every model of a scope stayed busy.
BUSY_RETRY_AFTER_S = 5.0

Scopes = Callable[[str], Sequence[Scope]]


class ProcessManager:
    """Backends by name, sharing one runtime directory, address allocator, spawner, prober and clock.

    ``runtime_dir`` holds ``sockets/`` (mode 0700) and ``logs/<name>.log``. ``scopes(name)``
    says which limits a backend's start must fit (``max_loaded_models``, groups): before a
    start from no process the backend awaits :meth:`make_room`, which stops idle backends
    (least recently used first) and waits for them to exit. ``before_start`` replaces that
    step (tests); raising BackendUnavailable there refuses the start.
    """

    def __init__(
        self,
        runtime_dir: Path,
        *,
        port_range: tuple[int, int] = (20000, 20999),
        spawner: Spawner | None = None,
        prober: Prober | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        listener: Listener | None = None,
        before_start: Callable[[Backend], Awaitable[None]] | None = None,
        scopes: Scopes | None = None,
        log_lines: int = 1000,
    ) -> None:
        self.runtime_dir = Path(runtime_dir).absolute()
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        self._runtime = Runtime(
            allocator=AddressAllocator(self.runtime_dir, port_range),
            spawner=spawner or SubprocessSpawner(),
            prober=prober or HttpProber(),
            clock=clock,
            sleep=sleep,
            log_dir=self.runtime_dir / "logs",
            listeners=[listener] if listener is not None else [],
            before_start=before_start or self._reserve,
            on_change=self._changed,
            log_lines=log_lines,
        )
        self.scopes = scopes
        self._backends: dict[str, Backend] = {}
        self.backends: Mapping[str, Backend] = MappingProxyType(self._backends)
        self._holding: set[str] = set()  # granted room, process not yet gone
        self._evicting: set[str] = set()
        self._change = asyncio.Event()
        self._room_waiters = 0

    # -- listeners ------------------------------------------------------------------------------

    def add_listener(self, listener: Listener) -> None:
        """Observe every backend's transitions, starts, restarts and stops (see :class:`Listener`)."""
        self._runtime.listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        if listener in self._runtime.listeners:
            self._runtime.listeners.remove(listener)

    @property
    def listener(self) -> Listener | None:
        """The first listener (the one given to the constructor)."""
        return self._runtime.listeners[0] if self._runtime.listeners else None

    @listener.setter
    def listener(self, listener: Listener | None) -> None:
        self._runtime.listeners[:1] = [listener] if listener is not None else []

    @property
    def before_start(self) -> Callable[[Backend], Awaitable[None]] | None:
        return self._runtime.before_start

    @before_start.setter
    def before_start(self, hook: Callable[[Backend], Awaitable[None]] | None) -> None:
        self._runtime.before_start = hook

    # -- backends -------------------------------------------------------------------------------

    def add(self, spec: BackendSpec) -> Backend:
        """A new, STOPPED backend; its first ``ensure_ready`` starts it."""
        if spec.name in self._backends:
            raise ValueError(f"a backend named {spec.name!r} already exists; use update() to change it")
        backend = self._backends[spec.name] = Backend(spec, self._runtime)
        return backend

    def get(self, name: str) -> Backend | None:
        return self._backends.get(name)

    async def remove(self, name: str) -> None:
        """Drain, stop and forget ``name``; holders of the Backend then get BackendClosed."""
        backend = self._backends.pop(name, None)
        if backend is not None:
            await backend.close(drain=True)

    async def shutdown(self) -> None:
        """Stop every backend at once (no drain), bounded; whatever outlives the bound is SIGKILLed."""
        backends = list(self._backends.values())
        self._backends.clear()
        if backends:
            bound = max(b.spec.stop_timeout_s for b in backends) + SHUTDOWN_GRACE_S
            closing = [asyncio.ensure_future(b.close(drain=False)) for b in backends]
            done, late = await asyncio.wait(closing, timeout=bound)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.error("shutdown of a backend failed: %r", task.exception())
            for backend, task in zip(backends, closing, strict=True):
                if task in late:
                    log.error("%s did not stop within %gs; killing its process group", backend.name, bound)
                    backend.kill_now()
                    task.cancel()
        self._runtime.allocator.close()

    # -- room -----------------------------------------------------------------------------------

    def loaded(self) -> list[Member]:
        """Backends that hold memory or the room granted for their start."""
        members = []
        for name in self._holding:
            backend = self._backends.get(name)
            if backend is not None:
                going = name in self._evicting or backend.state is State.STOPPING
                members.append(Member(name, backend.is_idle(), backend.last_used or 0.0, going))
        return members

    async def make_room(self, name: str, scopes: Sequence[Scope], timeout_s: float = 180.0) -> None:
        """Stop least-recently-used idle backends until ``name`` fits every scope, then hold its room.

        Waits (bounded by ``timeout_s``) for victims to exit and for busy backends to become
        idle, woken by every change of any backend, never by a timer; raises
        BackendUnavailable when busy backends leave no room in time.
        """
        deadline = self._runtime.clock() + timeout_s
        while True:
            room = victims(name, self.loaded(), scopes)
            if room.fits:
                self._holding.add(name)
                return
            for victim in room.stop:
                self._evict(victim, name)
            remaining = deadline - self._runtime.clock()
            if remaining <= 0:
                scope = room.busy or next(s for s in scopes if s.limit > 0)
                busy = ", ".join(sorted(m.name for m in self.loaded() if m.name in scope.members))
                limit = f"{scope.label} allows {scope.limit} loaded model(s)"
                raise BackendUnavailable(
                    f"cannot start {name}: {limit} and all are busy ({busy})",
                    retry_after_s=BUSY_RETRY_AFTER_S,
                )
            change = asyncio.ensure_future(self._change.wait())
            self._room_waiters += 1
            try:
                await self._runtime.wait_done(change, remaining)
            finally:
                self._room_waiters -= 1
                change.cancel()

    def _evict(self, victim: str, target: str) -> None:
        backend = self._backends.get(victim)
        if backend is None or victim in self._evicting:
            return
        log.info("evicting %s (least recently used) to start %s", victim, target)
        self._evicting.add(victim)
        task = asyncio.ensure_future(backend.stop("evict"))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _reserve(self, backend: Backend) -> None:
        scopes = self.scopes(backend.name) if self.scopes is not None else ()
        await self.make_room(backend.name, scopes, backend.spec.startup_timeout_s)

    def _changed(self, backend: Backend) -> None:
        state = backend.state
        if state is State.STOPPED or state is State.BACKOFF:
            self._holding.discard(backend.name)
            self._evicting.discard(backend.name)
        elif state is State.READY and backend.name not in self._holding and not backend.spec.remote:
            self._holding.add(backend.name)
        if self._room_waiters:
            self._change.set()
            self._change = asyncio.Event()  # the next waiters wait for the next change
