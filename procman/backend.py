"""One supervised backend: its state machine, its lock, its in-flight count.

The lock's invariant: every state change happens while ``_lock`` is held, either by the
coroutine that holds it or by the start task it awaits. Callers never inspect ``state``
to decide anything: they call :meth:`Backend.ensure_ready` (or enter :meth:`Backend.request`),
which under the lock returns the address of a READY process, joins the start in progress,
starts one, or raises a :class:`~procman.errors.BackendUnavailable` saying why not.

Multi-step operations (stop, restart, reload, the reaction to a crash) run in tasks the
backend owns, so a caller that is cancelled half way (a client that disconnects) can never
leave the backend in STOPPING with nobody finishing the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from procman import process
from procman.address import Address
from procman.errors import BackendClosed, BackendUnavailable, InBackoff, StartInterrupted
from procman.lifecycle import Lifecycle
from procman.spec import BackendSpec
from procman.states import State

__all__ = ["FAILURE_REASONS", "Backend", "Lease"]

log = logging.getLogger(__name__)

#: Restart reasons that count as a failure of the backend (they feed the backoff).
FAILURE_REASONS = frozenset({"crash", "hang", "fatal"})


@dataclass(frozen=True, slots=True)
class Lease:
    """What a request talks to; ``generation`` names the process (it grows with every successful start)."""

    address: Address
    pid: int | None
    generation: int


class Backend(Lifecycle):
    """A model process under supervision. Built by :class:`~procman.manager.ProcessManager`."""

    # -- what others read --------------------------------------------------------------------

    def snapshot(self) -> dict[str, object]:
        self._reset_if_stable()
        return {
            "name": self.name,
            "state": self.state.value,
            "pid": self.pid,
            "address": str(self.address) if self.address is not None else None,
            "generation": self.generation,
            "started_at": self.started_at,
            "last_used": self.last_used,
            "in_flight": self.in_flight,
            "starts": self.starts,
            "restarts": self.restarts,
            "failures": self.failures,
            "last_error": self.last_error,
            "exit_code": self.exit_code,
            "retry_after_s": self.retry_after_s,
        }

    def __repr__(self) -> str:
        return f"<Backend {self.name} {self.state.value} pid={self.pid}>"

    # -- the entry ---------------------------------------------------------------------------

    async def ensure_ready(self) -> Address:
        """The address of a READY process, starting one if needed; raises BackendUnavailable.

        Concurrent callers share one start: whoever waited on the lock while a start ran
        gets that start's result (its address, or the very error it raised).
        """
        return (await self._admit(count=False)).address

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[Lease]:
        """``async with backend.request() as lease:`` counts a request in flight for its duration.

        The ready check and the count happen under the lock, so no stop slips in between;
        a stop with ``drain=True`` waits for the count to reach zero.
        """
        lease = await self._admit(count=True)
        try:
            yield lease
        finally:
            self._request_done()

    async def _admit(self, count: bool) -> Lease:
        joined = self._pending_start()
        try:
            return await self._admit_once(joined, count)
        except StartInterrupted as exc:
            if exc.by != "reload":
                raise
            return await self._admit_once(None, count)  # the reload starts the new spec: wait for that one

    async def _admit_once(self, joined: asyncio.Task[Address] | None, count: bool) -> Lease:
        async with self._lock:
            address = await self._ready_locked(joined)
            if count:
                self.in_flight += 1
                self._drained.clear()
            return Lease(address, self.pid, self.generation)

    def _request_done(self) -> None:
        self.in_flight -= 1
        self.last_used = time.time()
        self._idle_since = self._rt.clock()
        if self.in_flight == 0:
            self._drained.set()
            self._arm_idle()

    async def _ready_locked(self, joined: asyncio.Task[Address] | None) -> Address:
        if joined is not None and joined.done() and not joined.cancelled():
            error = joined.exception()
            if error is not None and not isinstance(error, StartInterrupted):
                raise error  # the start we queued behind failed: the same answer for everyone who waited
        if self._closed:
            raise BackendClosed(f"{self.name} was removed or is shutting down")
        pending = self._pending_start()
        if pending is not None:  # a start whose first caller went away; join it
            return await asyncio.shield(pending)
        self._reset_if_stable()
        if self.state is State.READY and self._running is not None:
            return self._running.address
        if self.state is State.BACKOFF and (remaining := self._backoff_remaining()) > 0:
            raise InBackoff(self._backoff_message(remaining), retry_after_s=remaining)
        await self._before_start()
        return await self._launch("cold")

    def _backoff_message(self, remaining: float) -> str:
        return (
            f"{self.name} is backing off after {self.failures} failure(s); next try in {remaining:.1f}s"
            f" (last error: {self.last_error})"
        )

    # -- stop, restart, update ---------------------------------------------------------------

    async def stop(self, reason: str = "stop", *, drain: bool = True) -> None:
        """Stop the process (after in-flight requests finish, bounded, when ``drain``); -> STOPPED.

        Interrupts a start in progress. The next ``ensure_ready`` cold-starts again.
        """
        self._interrupt_start(reason)
        await self._owned(self._stop_op(reason, drain))

    async def restart(self, reason: str, *, generation: int | None = None) -> None:
        """Kill now (no drain) and relaunch. With ``generation``, only if that process is still the READY one.

        ``crash``, ``hang`` and ``fatal`` count as failures (backoff applies); any other
        reason (``manual``) relaunches at once. Never raises for a failed relaunch: the
        error is in ``last_error`` and the next ``ensure_ready`` reports it.
        """
        await self._owned(self._restart_op(reason, generation))

    async def update(self, spec: BackendSpec) -> None:
        """Apply a changed spec: drain, stop, swap, start again if it was loaded (else stay STOPPED)."""
        if spec.name != self.name:
            raise ValueError(f"update of {self.name!r} got a spec named {spec.name!r}")
        if spec == self.spec:
            return
        retrying = self.state is State.BACKOFF and self._retry is not None and not self._retry.done()
        was_loaded = retrying or self.state in (State.STARTING, State.READY)
        self._interrupt_start("reload")
        await self._owned(self._update_op(spec, was_loaded))

    async def close(self, *, drain: bool) -> None:
        """Stop for good: later ``ensure_ready`` calls raise BackendClosed."""
        self._closed = True
        reason = "remove" if drain else "shutdown"
        self._interrupt_start(reason)
        await self._owned(self._stop_op(reason, drain))
        self.logs.close()

    def kill_now(self) -> None:
        """SIGKILL the process group at once (a shutdown that ran out of time)."""
        process.kill_now(self._running)

    async def _stop_op(self, reason: str, drain: bool) -> None:
        async with self._lock:
            await self._stop_locked(reason, drain)

    async def _restart_op(self, reason: str, generation: int | None) -> None:
        async with self._lock:
            await self._join_start()
            if self._closed:
                return
            if generation is not None and (generation != self.generation or self.state is not State.READY):
                log.debug("%s restart(%s) for generation %s skipped: now %s", self.name, reason, generation, self)
                return
            if self.state is State.READY and reason in FAILURE_REASONS:
                await self._fault_locked(reason)
            else:
                await self._replace_locked(reason)

    async def _update_op(self, spec: BackendSpec, was_loaded: bool) -> None:
        async with self._lock:
            await self._join_start()
            if self._closed or spec == self.spec:
                return
            was_loaded = was_loaded or self.state is State.READY
            await self._stop_locked("reload", drain=True)
            self.spec = spec
            self.failures = 0
            self._backoff_until = None
            log.info("%s spec updated%s", self.name, "; starting it again" if was_loaded else "")
            if was_loaded:
                await self._relaunch_quietly("reload")

    async def _stop_locked(self, reason: str, drain: bool) -> None:
        self._cancel(self._retry)
        await self._join_start()
        if self.state is State.BACKOFF:
            self._set_state(State.STOPPED)
            self._rt.notify("on_stop", self, reason)
            return
        if self.state is not State.READY:
            return
        if drain:
            await self._drain(reason)
        self._set_state(State.STOPPING)
        await self._terminate()
        self._set_state(State.STOPPED)
        log.info("stopped %s (%s)", self.name, reason)
        self._rt.notify("on_stop", self, reason)

    async def _drain(self, reason: str) -> None:
        if self.in_flight == 0:
            return
        log.info("%s: %s waits for %d request(s) in flight", self.name, reason, self.in_flight)
        drained = asyncio.ensure_future(self._drained.wait())
        try:
            done = await self._rt.wait_done(drained, self.spec.drain_timeout_s)
        finally:
            drained.cancel()
        if not done:
            log.warning(
                "%s: %d request(s) still in flight after drain_timeout_s=%g; stopping anyway",
                self.name,
                self.in_flight,
                self.spec.drain_timeout_s,
            )

    async def _replace_locked(self, reason: str) -> None:
        """A restart that is no failure: kill what runs, then start again right away."""
        if self.state is State.READY:
            self.restarts += 1
            self._rt.notify("on_restart", self, reason)
            self._set_state(State.STOPPING)
            await self._terminate()
        elif self.state in (State.STOPPED, State.BACKOFF):
            self._cancel(self._retry)
            if not await self._before_start_quietly():
                return
        await self._launch_quietly(reason)

    # -- failures and recovery ---------------------------------------------------------------

    async def _fault_locked(self, reason: str) -> None:
        """The READY process crashed, hung or hit a fatal error: count it, clean up, relaunch."""
        self.restarts += 1
        self._rt.notify("on_restart", self, reason)
        self._reset_if_stable()
        running = self._running
        if reason == "crash" and running is not None:
            tail = self.logs.since(running.log_mark, 5)
            error = f"{self.name} pid={running.pid} exited unexpectedly with code {running.exit_code}"
            log.warning("%s", error)
            await self._terminate()  # reaps, and kills what the process left in its group
            self._note_failure(error + ("; last log lines:\n" + "\n".join(tail) if tail else ""))
        else:
            error = f"{self.name} pid={self.pid} was killed: {self._fault_words(reason)}"
            log.warning("%s", error)
            self._set_state(State.STOPPING)
            await self._terminate()
            self._note_failure(error)
        await self._recover(reason)

    def _fault_words(self, reason: str) -> str:
        if reason == "hang":
            spec = self.spec
            timeout = f"{spec.health_timeout_s:g}s timeout"
            return f"{spec.health_path} failed {spec.health_failures} probes in a row ({timeout})"
        if reason == "fatal":
            return "the backend reported an unrecoverable (fatal) error"
        return reason

    async def _recover(self, reason: str) -> None:
        """In BACKOFF after a failure: relaunch now, later (a timer), or give up after max_retries."""
        while self.state is State.BACKOFF and not self._closed:
            if self.failures > self.spec.policy.max_retries:
                log.warning("%s gave up after %d failed starts", self.name, self.failures)
                return
            remaining = self._backoff_remaining()
            if remaining > 0:
                self._retry = asyncio.ensure_future(self._retry_later(remaining, reason))
                return
            if not await self._before_start_quietly():
                return
            with contextlib.suppress(BackendUnavailable):
                await self._launch(reason)

    async def _retry_later(self, delay_s: float, reason: str) -> None:
        await self._rt.sleep(delay_s)
        await self._owned(self._retry_op(reason))

    async def _retry_op(self, reason: str) -> None:
        async with self._lock:
            if self.state is State.BACKOFF and self._pending_start() is None:
                await self._recover(reason)

    async def _relaunch_quietly(self, reason: str) -> None:
        if await self._before_start_quietly():
            await self._launch_quietly(reason)

    async def _launch_quietly(self, reason: str) -> None:
        """A relaunch nobody waits on: a failure goes to recovery (backoff), not to a caller."""
        try:
            await self._launch(reason)
        except StartInterrupted:
            pass
        except BackendUnavailable:
            await self._recover(reason)

    async def _before_start(self) -> None:
        if self._rt.before_start is not None:
            await self._rt.before_start(self)

    async def _before_start_quietly(self) -> bool:
        try:
            await self._before_start()
        except Exception as exc:
            log.warning("%s not relaunched: %s", self.name, exc, exc_info=not isinstance(exc, BackendUnavailable))
            self.last_error = str(exc)
            return False
        return True

    # -- background watchers -----------------------------------------------------------------

    def _on_ready(self, running: process.Running) -> None:
        self._monitor = asyncio.ensure_future(self._watch(running, self.generation))
        self._arm_idle()

    async def _watch(self, running: process.Running, generation: int) -> None:
        reason = await process.watch(self._rt, self.spec, running)
        await self._owned(self._fault_op(reason, generation))

    async def _fault_op(self, reason: str, generation: int) -> None:
        async with self._lock:
            if not self._closed and generation == self.generation and self.state is State.READY:
                await self._fault_locked(reason)

    def _arm_idle(self) -> None:
        if self.spec.idle_timeout_s <= 0 or not self.is_idle() or self._closed:
            return
        if self._idle is None or self._idle.done():
            self._idle = asyncio.ensure_future(self._idle_watch())

    async def _idle_watch(self) -> None:
        timeout = self.spec.idle_timeout_s
        while self.is_idle() and not self._closed:
            remaining = self._idle_since + timeout - self._rt.clock()
            if remaining > 0:
                await self._rt.sleep(remaining)
            else:
                await self._owned(self._idle_op(timeout))

    async def _idle_op(self, timeout: float) -> None:
        async with self._lock:
            if self.is_idle() and self._rt.clock() - self._idle_since >= timeout:
                log.info("%s idle for %gs", self.name, timeout)
                await self._stop_locked("idle", drain=False)
