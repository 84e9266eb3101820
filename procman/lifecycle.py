"""The mechanics under a Backend: its fields, the one state mutator, starting and killing a process.

:class:`Lifecycle` changes state only through :meth:`Lifecycle._set_state`, which checks the
``ALLOWED`` table, logs ``name old->new pid=...``, timestamps, and tells the listener. It
holds no policy about *when* to start or stop; :class:`~procman.backend.Backend` (its
subclass) decides that under its lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from procman import process
from procman.address import Address, safe_name
from procman.errors import BackendUnavailable, InvalidTransition, StartFailed, StartInterrupted
from procman.logbuffer import LogBuffer
from procman.policy import backoff_delay
from procman.runtime import Runtime
from procman.spec import BackendSpec
from procman.states import ALLOWED, State

__all__ = ["Lifecycle"]

log = logging.getLogger("procman.backend")

T = TypeVar("T")


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a start nobody awaited any more must not warn at exit


class Lifecycle:
    """The state of one backend and the steps that move it; see :class:`procman.backend.Backend`."""

    def __init__(self, spec: BackendSpec, runtime: Runtime) -> None:
        self.name = spec.name
        self.spec = spec
        self.state = State.STOPPED
        self.state_since = runtime.clock()
        self.generation = 0
        self.started_at: float | None = None  # wall clock of the current process's spawn
        self.last_used: float | None = None  # wall clock of the end of the last request
        self.in_flight = 0
        self.starts = 0
        self.restarts = 0
        self.failures = 0  # consecutive; reset after stable_after_s READY
        self.last_error: str | None = None
        self.exit_code: int | None = None  # of the last process that exited
        self.logs = LogBuffer(runtime.log_dir / f"{safe_name(spec.name)}.log", runtime.log_lines)
        self._rt = runtime
        self._lock = asyncio.Lock()
        self._running: process.Running | None = None
        self._start_task: asyncio.Task[Address] | None = None
        self._abort: asyncio.Event | None = None
        self._abort_by = "stop"
        self._monitor: asyncio.Task[None] | None = None
        self._retry: asyncio.Task[None] | None = None
        self._idle: asyncio.Task[None] | None = None
        self._ops: set[asyncio.Task[Any]] = set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._ready_at: float | None = None
        self._idle_since = runtime.clock()
        self._backoff_until: float | None = None
        self._closed = False

    # -- what others read --------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._running.pid if self._running is not None else None

    @property
    def address(self) -> Address | None:
        return self._running.address if self._running is not None else None

    @property
    def retry_after_s(self) -> float | None:
        """Seconds until a start may be tried again, while in BACKOFF."""
        return self._backoff_remaining() if self.state is State.BACKOFF else None

    def is_idle(self) -> bool:
        """READY with nothing in flight: what idle stop and eviction may stop."""
        return self.state is State.READY and self.in_flight == 0

    # -- starting ----------------------------------------------------------------------------

    def _pending_start(self) -> asyncio.Task[Address] | None:
        task = self._start_task
        return task if task is not None and not task.done() else None

    async def _join_start(self) -> None:
        pending = self._pending_start()
        if pending is not None:
            await asyncio.wait({pending})

    def _interrupt_start(self, by: str) -> None:
        if self._abort is not None and self._pending_start() is not None and not self._abort.is_set():
            self._abort_by = by
            self._abort.set()

    async def _launch(self, reason: str) -> Address:
        """Start a process in a task of its own (a cancelled caller does not abort it) and await it."""
        self._abort = abort = asyncio.Event()
        task = asyncio.ensure_future(self._start(reason, abort))
        task.add_done_callback(_consume)
        self._start_task = task
        return await asyncio.shield(task)

    async def _start(self, reason: str, abort: asyncio.Event) -> Address:
        began = self._rt.clock()
        self._set_state(State.STARTING)
        self.started_at = time.time()
        try:
            running = await self._launch_process(abort)
        except process.Aborted as stopped:
            await self._abandon(stopped.running)
            by = self._abort_by
            raise StartInterrupted(f"the start of {self.name} was interrupted ({by})", by=by) from None
        except BackendUnavailable as exc:
            self.started_at = None
            self.exit_code = exc.exit_code if isinstance(exc, StartFailed) else None
            exc.retry_after_s = self._note_failure(str(exc))
            self._rt.notify("on_start", self, reason, False, self._rt.clock() - began)
            raise
        self._became_ready(running)
        self._rt.notify("on_start", self, reason, True, self._rt.clock() - began)
        return running.address

    async def _launch_process(self, abort: asyncio.Event) -> process.Running:
        try:
            return await process.launch(self._rt, self.spec, self.logs, abort)
        except (BackendUnavailable, process.Aborted):
            raise
        except Exception as exc:  # a bug or an odd OS error must fail the start, never wedge it in STARTING
            log.exception("%s: start failed unexpectedly", self.name)
            raise BackendUnavailable(f"{self.name}: start failed unexpectedly: {exc!r}") from exc

    async def _abandon(self, running: process.Running) -> None:
        self._running = running
        self._set_state(State.STOPPING)
        await self._terminate()
        self._set_state(State.STOPPED)

    def _became_ready(self, running: process.Running) -> None:
        self._running = running
        self.generation += 1
        self.starts += 1
        self._ready_at = self._idle_since = self._rt.clock()
        self._set_state(State.READY)
        self._on_ready(running)

    def _on_ready(self, running: process.Running) -> None:
        """Called once a process became READY (the Backend starts its watchers here)."""

    # -- stopping and failing ----------------------------------------------------------------

    async def _terminate(self) -> None:
        """Stop watching, kill the process group, reap it and give its address back."""
        self._cancel(self._monitor)
        self._cancel(self._idle)
        self._ready_at = None
        running = self._running  # pid and address stay visible while STOPPING
        if running is None:
            return
        try:
            self.exit_code = await process.terminate(self._rt, self.spec, running, self.logs)
        except Exception:  # never stay in STOPPING: the group gets SIGKILL and the state moves on
            log.exception("%s: stopping pid=%s failed; sending SIGKILL", self.name, running.pid)
            process.kill_now(running)
        finally:
            self._running = None
            self.started_at = None
            self._rt.allocator.release(running.address)

    def _note_failure(self, error: str) -> float:
        """Count one failure, move to BACKOFF and return the delay before the next start."""
        self.failures += 1
        delay = backoff_delay(self.failures, self.spec.policy)
        self._backoff_until = self._rt.clock() + delay
        self.last_error = error
        self._set_state(State.BACKOFF)
        return delay

    def _reset_if_stable(self) -> None:
        if self.state is not State.READY or not self.failures or self._ready_at is None:
            return
        if self._rt.clock() - self._ready_at >= self.spec.policy.stable_after_s:
            log.info("%s up for %gs: failure count reset", self.name, self.spec.policy.stable_after_s)
            self.failures = 0
            self._backoff_until = None

    def _backoff_remaining(self) -> float:
        if self._backoff_until is None:
            return 0.0
        return max(0.0, self._backoff_until - self._rt.clock())

    # -- the one mutator ---------------------------------------------------------------------

    def _set_state(self, new: State) -> None:
        old = self.state
        if new not in ALLOWED[old]:
            raise InvalidTransition(f"{self.name}: {old.name}->{new.name} is not an allowed transition")
        self.state = new
        self.state_since = self._rt.clock()
        log.info("%s %s->%s pid=%s", self.name, old.name, new.name, self.pid)
        self._rt.notify("on_transition", self, old, new)

    # -- task plumbing -----------------------------------------------------------------------

    async def _owned(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` in a task this backend keeps; the caller's cancellation does not stop it."""
        task = asyncio.ensure_future(coro)
        self._ops.add(task)
        task.add_done_callback(self._ops.discard)
        return await asyncio.shield(task)

    @staticmethod
    def _cancel(task: asyncio.Task[Any] | None) -> None:
        if task is not None and task is not asyncio.current_task():
            task.cancel()
