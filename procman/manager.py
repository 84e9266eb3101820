"""The owner of every backend of one router: adds, finds, removes, and shuts them all down."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from types import MappingProxyType

from procman.address import AddressAllocator
from procman.backend import Backend
from procman.prober import HttpProber, Prober
from procman.runtime import Listener, Runtime, Sleep
from procman.spawner import Spawner, SubprocessSpawner
from procman.spec import BackendSpec

__all__ = ["ProcessManager"]

log = logging.getLogger(__name__)

#: Extra seconds a shutdown grants beyond the longest stop_timeout_s before it SIGKILLs what is left.
SHUTDOWN_GRACE_S = 10.0


class ProcessManager:
    """Backends by name, sharing one runtime directory, address allocator, spawner, prober and clock.

    ``runtime_dir`` holds ``sockets/`` (mode 0700) and ``logs/<name>.log``. ``before_start``
    runs under a backend's lock right before a start from STOPPED or BACKOFF spawns (the
    router evicts idle models there); raising BackendUnavailable cancels that start.
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
            listener=listener,
            before_start=before_start,
            log_lines=log_lines,
        )
        self._backends: dict[str, Backend] = {}
        self.backends: Mapping[str, Backend] = MappingProxyType(self._backends)

    @property
    def listener(self) -> Listener | None:
        return self._runtime.listener

    @listener.setter
    def listener(self, listener: Listener | None) -> None:
        self._runtime.listener = listener

    @property
    def before_start(self) -> Callable[[Backend], Awaitable[None]] | None:
        return self._runtime.before_start

    @before_start.setter
    def before_start(self, hook: Callable[[Backend], Awaitable[None]] | None) -> None:
        self._runtime.before_start = hook

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
