"""One supervised backend: one owner task that feeds events to :func:`procman.machine.decide`.

Every public method (``ensure_ready``, ``request``, ``stop``, ``restart``, ``update``,
``retune``, ``close``) puts a command on the backend's queue and awaits its answer; the
owner task takes commands and the reports of its helpers (a start ended, the process
exited, a timer fired) one at a time, asks ``decide`` what to do, and carries out the
effects. Nothing awaits inside a decision, so no lock is needed and none is held across a
wait; helpers that wait (a start, a stop, a watch, a timer) run as tasks of their own and
report back through the same queue. A caller that goes away (a client that disconnects)
abandons its answer, never the work: the owner finishes what it started.

The request path is the one shortcut: admitting a request and counting it done are decided
in the caller's own turn when the queue is empty and no decision is under way — exactly the
step the owner would take next, through the owner's own :meth:`Backend._handle`, without two
task switches per request. The commonest of those (admit to a READY process with room; a done
that leaves others in flight) also skip the reply future (:meth:`Backend._shortcut`).

Queries (``state``, ``pid``, ``snapshot()``, ``is_idle()``) read and never change anything.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal, NamedTuple

from procman import deaths, process
from procman import machine as m
from procman import rolling as r
from procman.address import Address, safe_name
from procman.deaths import Death
from procman.errors import (
    BackendClosed,
    BackendUnavailable,
    InBackoff,
    InvalidTransition,
    StartFailed,
    StartInterrupted,
)
from procman.logbuffer import LogBuffer
from procman.machine import FAILURE_REASONS, Counters
from procman.notices import Restarted, Rolled, Started, Stopped, Transition
from procman.prober import Health
from procman.runtime import Runtime, unless_aborted
from procman.spec import BackendSpec
from procman.states import ALLOWED, State

__all__ = ["FAILURE_REASONS", "Backend", "Lease"]

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True, slots=True)
class _Ended:
    """A counted request of the process of ``generation`` ended, queued while the owner was busy: the owner counts
    it against that process — a retiree, when a switch came between the post and the take (a bare ``Done``
    taken then would count against the new process and leave the old one draining until ``drain_timeout_s``)."""

    generation: int


#: What the owner's queue carries: the machine's events, a replacement's command and reports, a request's end.
Event = m.Event | r.Replace | r.Report | _Ended


class Lease(NamedTuple):
    """What a request talks to; ``generation`` names the process, ``exited`` completes when it is gone."""

    address: Address
    pid: int | None
    generation: int
    exited: asyncio.Future[Any]


class Backend:
    """A model process under supervision. Built by :class:`~procman.manager.ProcessManager`."""

    def __init__(self, spec: BackendSpec, runtime: Runtime[Backend]) -> None:
        self.name = spec.name
        self.spec = spec  # through the setter: also caches its tuning
        self.state = State.STOPPED
        self.state_since = runtime.clock()
        self.counters = Counters(idle_since=runtime.clock())
        self.started_at: float | None = None  # wall clock of the current process's spawn
        self.last_used: float | None = None  # wall clock of the end of the last request
        self.starts = 0
        self.restarts = 0
        self.last_error: str | None = None
        self.exit_code: int | None = None  # of the last process that exited
        self._deaths: dict[int, Death] = {}  # generation -> how that process failed
        self.logs = LogBuffer(runtime.log_dir / f"{safe_name(spec.name)}.log", runtime.log_lines)
        self._rt = runtime
        self._queue: asyncio.Queue[tuple[Event, asyncio.Future[Any] | None]] = asyncio.Queue()
        self._owner: asyncio.Task[None] | None = None
        self._handling = False
        self._running: process.Running | None = None
        self._next_spec = spec
        self._parked: list[tuple[asyncio.Future[Any], m.Event]] = []  # callers and the Want each parked with
        self._settling: list[asyncio.Future[Any]] = []
        self._start_error: BackendUnavailable | None = None
        self._start_began = 0.0
        self.last_load_s: float | None = None  # how long the last successful start took (written by _notify)
        self._ready: asyncio.Future[None] | None = None  # handed out by ready(), done by _set_state
        self._abort: asyncio.Event | None = None
        self._helpers: dict[str, asyncio.Task[Any]] = {}
        self._kill_why: tuple[int | None, str] | None = None  # (generation, why) of a restart the caller explained
        self._fast = True  # the request path's shortcut (tests turn it off to compare both paths)
        self._roll: r.Rollout | None = None  # a rolling start beside the current process (procman/rolling.py)
        self._retired: dict[int, r.Retiree] = {}  # generation -> a replaced process, draining
        self._retired_gone: set[int] = set()  # generations of replaced processes gone since (recent ones)

    # -- what others read --------------------------------------------------------------------

    @property
    def spec(self) -> BackendSpec:
        return self._spec

    @spec.setter
    def spec(self, spec: BackendSpec) -> None:
        self._spec = spec
        self._tuning = spec.tuning  # decide() reads it on every event

    @property
    def pid(self) -> int | None:
        return self._running.pid if self._running is not None else None

    @property
    def address(self) -> Address | None:
        return self._running.address if self._running is not None else None

    @property
    def generation(self) -> int:
        return self.counters.generation

    @property
    def in_flight(self) -> int:
        return self.counters.in_flight

    def in_flight_of(self, generation: int) -> int:
        """Requests in flight in the process of ``generation`` (the current one, or a replaced one draining)."""
        retiree = self._retired.get(generation)
        return retiree.in_flight if retiree is not None else self.counters.in_flight

    @property
    def failures(self) -> int:
        """Consecutive failures; 0 once the process stayed READY for ``stable_after_s``."""
        return m.failures_now(self.state, self.counters, self._tuning, self._rt.clock())

    @property
    def retry_after_s(self) -> float | None:
        """Seconds until a start may be tried again, while in BACKOFF."""
        return m.backoff_remaining(self.counters, self._rt.clock()) if self.state is State.BACKOFF else None

    @property
    def closed(self) -> bool:
        return self.counters.closed

    @property
    def last_health(self) -> Health | None:
        """The current process's last answer to a health probe (status, JSON body, when), from procman's own
        probes (readiness, then the health watch): read it instead of asking the process again."""
        return self._running.health if self._running is not None else None

    def loading_for_s(self) -> float | None:
        """Seconds since the start in progress began (runtime clock); None unless STARTING."""
        return self._rt.clock() - self._start_began if self.state is State.STARTING else None

    def ready(self) -> asyncio.Future[None]:
        """Done once the backend is READY (at once when it is): await it instead of polling ``state``.

        Never fails and never starts anything: a start that fails leaves it pending until a later start
        succeeds (``ensure_ready`` is what starts, and says why a start failed). Cancel-safe: shielded."""
        if self.state is State.READY:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        if self._ready is None:
            self._ready = asyncio.get_running_loop().create_future()
        return asyncio.shield(self._ready)

    def is_idle(self) -> bool:
        """READY with nothing in flight: what idle stop and eviction may stop."""
        return self.state is State.READY and self.counters.in_flight == 0 and not self.counters.draining

    @property
    def kept_loaded(self) -> bool:
        """A client asked to keep it loaded until its next change (``keep_alive(inf)``): pinned meanwhile."""
        return self.counters.keep_s == float("inf")

    def idle_stop_in_s(self) -> float | None:
        """Seconds until the idle stop of the READY process (from now, or from its last request's end when
        requests are in flight: counted once they are done); None when it is not READY or never stops."""
        after = m.idle_after_s(self.counters, self._tuning)
        if self.state is not State.READY or after is None:
            return None
        if self.counters.in_flight or self.counters.draining:
            return after
        return max(0.0, self.counters.idle_since + after - self._rt.clock())

    def forgive(self, generations: Iterable[int]) -> None:
        """The deaths of ``generations`` were a poison request's doing (the router named it): those counted as
        failures come off the count, so the request does not push the model into backoff."""
        self._post(m.Forgive(tuple(generations)))  # (deaths.forgivable takes each once, in order)

    def keep_alive(self, keep_s: float | None) -> None:
        """How long the process stays loaded once idle (a client's ``keep_alive``): 0 stops it as soon as
        nothing is in flight, ``inf`` keeps (and pins) it until the spec changes or it is stopped, any other
        value keeps it at least that long, None goes back to ``idle_timeout_s``. Forgotten when the process
        stops or the settings change."""
        self._post(m.KeepAlive(keep_s))


    def death(self, generation: int) -> Death | None:
        """How the process of ``generation`` ended, when it failed (crash, fatal, hang) while READY.

        A process whose exit the owner has not handled yet is classified here, the way it will be.
        """
        known = self._deaths.get(generation)
        running = self._running
        if known is None and running is not None and generation == self.generation and running.exited.done():
            known = process.exit_death(running, self.logs, self.spec, self.counters.in_flight)
        return known

    def stopped(self, generation: int) -> bool:
        """Whether the process of ``generation`` runs and is stopped by a signal (SIGSTOP): a hang from outside."""
        retiree = self._retired.get(generation)
        running = retiree.running if retiree is not None else self._running if generation == self.generation else None
        return running is not None and process.stopped(running)

    def snapshot(self) -> dict[str, object]:
        return {
            "name": self.name,
            "state": self.state.value,
            "pid": self.pid,
            "address": str(self.address) if self.address is not None else None,
            "node": self._running.node if self._running is not None else None,
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
            "reason": self.counters.reason or None,
        }

    def __repr__(self) -> str:
        return f"<Backend {self.name} {self.state.value} pid={self.pid}>"

    # -- what others ask ---------------------------------------------------------------------

    async def ensure_ready(self) -> Address:
        """The address of a READY process, starting one if needed; raises BackendUnavailable.

        Concurrent callers share one start: everyone parked on it gets its address, or the
        very error it raised.
        """
        return (await self._want(count=False)).address

    def request(self) -> InFlight:
        """``async with backend.request() as lease:`` counts a request in flight for its duration.

        The ready check and the count are one decision, so no stop slips in between; a stop
        with ``drain=True`` waits for the count to reach zero.
        """
        return InFlight(self)

    async def _admitted(self) -> Lease:
        if self._shortcut(_WANT_ONE):
            lease = self._lease()
            assert lease is not None  # the shortcut admits only to a live process
            return lease
        return await self._want(count=True)

    async def _finished(self, generation: int) -> None:
        if self._retiree_done(generation):
            return
        if self._shortcut(_DONE):
            return
        if self._quiet():
            self._dispatch(_DONE, None)
        else:
            done = self._post(_Ended(generation), want_reply=True)
            assert done is not None
            await done

    def _retiree_done(self, generation: int) -> bool:
        """Count a request's end against the replaced process it was admitted to; False: the current process's.

        A replaced process that is gone (drained, or killed while requests still held leases on it) took its
        count with it: a late end is its own, never the new process's (that would undercount requests running)."""
        retiree = self._retired.get(generation)
        if retiree is not None:
            self.last_used = time.time()
            retiree.done()
        return retiree is not None or generation in self._retired_gone

    async def stop(self, reason: str = "stop", *, drain: bool = True) -> None:
        """Stop the process (after in-flight requests finish, bounded, when ``drain``); -> STOPPED.

        Interrupts a start in progress. The next ``ensure_ready`` cold-starts again.
        """
        await self._ask(m.Stop(reason, drain))

    def restart(self, reason: str, *, generation: int | None = None, why: str | None = None,
                blamed: bool = False) -> asyncio.Future[None]:
        """Replace the process now (no drain). With ``generation``, only if that process is still the READY one.
        ``why``: what the caller saw, for ``last_error`` (a ``hang`` is otherwise put as failed health probes).
        ``blamed``: a request in flight caused it (a poison request, a suspect's retry): no failure is counted.

        The command is queued when called (a caller that does not await it still gets it in
        before any later request); await the result to wait until the backend settles.
        ``crash``, ``hang`` and ``fatal`` count as failures (backoff applies) and SIGKILL at
        once; any other reason (``manual``) stops gracefully and relaunches at once. Never
        fails for a failed relaunch: the error is in ``last_error`` and the next
        ``ensure_ready`` reports it.
        """
        retiree = self._retired.get(generation) if generation is not None else None
        if retiree is not None:  # a replaced process that a request saw hang or fail: killed, never waited for
            retiree.condemn(reason)
            gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            gone.set_result(None)
            return gone
        if why is not None:
            self._kill_why = (generation, why)
        reply = self._post(m.Restart(reason, generation, blamed), want_reply=True)
        assert reply is not None
        reply.add_done_callback(_retrieve)
        return reply

    async def update(self, spec: BackendSpec) -> None:
        """Apply a changed spec. Supervision settings only: :meth:`retune`, the process stays.

        Anything the process sees (argv, env, cwd, url, transport): drain, stop, swap, and
        start again if it was loaded (else stay STOPPED).
        """
        if spec.name != self.name:
            raise ValueError(f"update of {self.name!r} got a spec named {spec.name!r}")
        if spec == self._next_spec:
            return
        if spec.process_view == self.spec.process_view and not self.counters.swap:
            await self.retune(spec)
            return
        self._next_spec = spec
        await self._ask(m.Update())

    async def retune(self, spec: BackendSpec) -> None:
        """New supervision settings (timeouts, health, idle, restart policy) for the running process."""
        if spec.process_view != self.spec.process_view or self.counters.swap:
            raise ValueError(f"{self.name}: retune cannot change what the process runs; use update()")
        self._next_spec = spec
        await self._ask(m.Retune())

    async def close(self, *, drain: bool) -> None:
        """Stop for good: later ``ensure_ready`` calls raise BackendClosed."""
        await self._ask(m.Close(drain))
        self.logs.close()

    def kill_now(self) -> None:
        """SIGKILL the process groups at once (a shutdown that ran out of time), a replacement's too."""
        process.kill_now(self._running)
        for retiree in self._retired.values():
            process.kill_now(retiree.running)
        if self._roll is not None:
            self._roll.abort.set()

    async def replace(self, spec: BackendSpec | None = None, *, rolling: bool, reason: str | None = None) -> None:
        """Replace the process with one running ``spec`` (None: the same spec again, a restart).

        ``rolling``: start the new process beside the current one when it serves and room allows both
        (procman/rolling.py): requests go to the new one once READY, the old one drains and stops, and a new
        one that fails leaves the old one serving (``Rolled`` notices tell each step). Otherwise stop-first:
        :meth:`restart` (the same spec) or :meth:`update`. A spec that changes only supervision settings is
        retuned. Answered once the new process serves (or the replacement failed, or was given up).
        """
        spec = spec or self.spec
        if spec.name != self.name:
            raise ValueError(f"replace of {self.name!r} got a spec named {spec.name!r}")
        if spec != self.spec and spec.process_view == self.spec.process_view and not self.counters.swap:
            await self.retune(spec)
            return
        await self._ask(r.Replace(spec, rolling, "manual" if spec == self.spec else "reload"))

    @property
    def replacing(self) -> bool:
        """A replacement's process exists beside the current one: a rolling start, or a replaced one draining."""
        return not self._alone()

    def seats(self) -> list[r.Seat]:
        """The processes of a replacement that hold room beside the current one (the manager counts them)."""
        roll = self._roll
        seats = [r.Seat(roll.key, starting=True)] if roll is not None and roll.holds else []
        return seats + [r.Seat(retiree.key, starting=False) for retiree in self._retired.values()]

    async def _want(self, count: bool) -> Lease:
        if self.counters.closed:
            raise BackendClosed(f"{self.name} was removed or is shutting down")
        if self._quiet():  # the request's hot path: decided right here, in the caller's turn
            reply: asyncio.Future[Any] | None = asyncio.get_running_loop().create_future()
            self._dispatch(m.Want(count), reply)
        else:
            reply = self._post(m.Want(count), want_reply=True)
        assert reply is not None
        if reply.done():
            return reply.result()  # type: ignore[no-any-return]
        try:
            return await reply  # type: ignore[no-any-return]
        except asyncio.CancelledError:
            if count and reply.done() and not reply.cancelled() and reply.exception() is None:
                generation = reply.result().generation  # admitted, but the caller went away
                if not self._retiree_done(generation):
                    self._post(_Ended(generation))
            raise

    async def _ask(self, event: Event) -> None:
        reply = self._post(event, want_reply=True)
        assert reply is not None
        await reply

    def _post(self, event: Event, want_reply: bool = False) -> asyncio.Future[Any] | None:
        reply = asyncio.get_running_loop().create_future() if want_reply else None
        self._queue.put_nowait((event, reply))
        if self._owner is None or self._owner.done():
            self._owner = asyncio.get_running_loop().create_task(self._run(), name=f"procman {self.name}")
        return reply

    # -- the owner ---------------------------------------------------------------------------

    def _shortcut(self, event: m.Want | m.Done) -> bool:
        """Decide a request's admit or done in the caller's turn and, when the answer is plain, take the owner's
        own step with it — no reply future, no task switch; False: the event goes the usual way.

        The one exception to "the owner task decides" (procman/README.md, "How it works"): when the owner is
        quiet (nothing queued, nothing being decided), the backend READY and its process alive, ``decide`` is
        asked right here, and an answer that :func:`procman.machine.plain` accepts (an admit with room, a done
        that leaves requests in flight) goes through :meth:`_handle` like any event — the same bookkeeping,
        effects, settling and ``Runtime.changed``. The caller of an admit then builds its lease from the live
        process, as ``Admit`` would. tests/test_procman_shortcut.py runs random event sequences with the
        shortcut on and off and compares everything a caller, a listener or the manager can see.
        """
        running = self._running
        if not self._fast or self.state is not State.READY or running is None or not self._quiet():
            return False
        if deaths.heard_first(self.state, event, running.exited.done()):
            return False  # the owner's step would decide the death first
        decision = m.decide(State.READY, event, self.counters, self._tuning, self._rt.clock())
        if not m.plain(event, decision):
            return False
        self._dispatch(event, None, decision)
        return True

    def _quiet(self) -> bool:
        """Nothing queued and nothing being decided: an event may be decided in the caller's turn.

        Only the request path (admit, done) uses this; it is the owner's own step, taken at a
        moment the owner would take it next anyway, and it saves two task switches a request.
        """
        return not self._handling and self._queue.empty()

    async def _run(self) -> None:
        while not (self.counters.closed and self.state is State.STOPPED and self._queue.empty() and self._alone()):
            event, reply = await self._queue.get()
            self._dispatch(event, reply)
        self._cancel(*list(self._helpers))  # closed and stopped: no timer or watch outlives the backend

    def _dispatch(self, event: Event, reply: asyncio.Future[Any] | None, decision: m.Decision | None = None) -> None:
        self._handling = True
        try:
            if isinstance(event, _Ended):
                if not self._retiree_done(event.generation):
                    self._handle(_DONE, reply)
                elif reply is not None and not reply.done():
                    reply.set_result(None)
            elif isinstance(event, r.EVENTS):
                self._replacing(event, reply)
            else:
                self._handle(event, reply, decision)
        except Exception as exc:  # a bug must not kill the owner: the caller hears it, the log has it
            log.exception("%s: handling %r failed", self.name, event)
            if reply is not None and not reply.done():
                reply.set_exception(exc)
        finally:
            self._handling = False

    def _handle(self, event: m.Event, reply: asyncio.Future[Any] | None, decision: m.Decision | None = None) -> None:
        """The owner's step for one event (``decision``: the shortcut's, already taken for this very state, after
        its own death check): the event's own bookkeeping, the decision and its effects, the caller's answer,
        ``Runtime.changed``."""
        if reply is not None and reply.done():
            return  # the caller went away before its turn
        before = (_BEFORE if decision is None else _BEFORE_DECIDED).get(type(event))
        if before is not None:
            event = before(self, event)
        self._apply(event, reply, decision)
        if reply is not None and not reply.done():
            answer = m.answered(event)
            if answer == "settled":
                self._settling.append(reply)
            elif answer == "turn":
                reply.set_result(None)
        self._turn_ends()

    def _turn_ends(self) -> None:
        """After each event: a rolling start whose current process stopped serving is given up, commands are
        answered once the backend settled (a replacement's processes gone too), the manager hears of it."""
        if self._roll is not None and not self._roll.dropping and not self._serving():
            self._give_up_roll()
        if self._settling and m.settled(self.state, self.counters) and self._roll is None and (
                not self.counters.closed or not self._retired):
            settling, self._settling = self._settling, []
            for waiter in settling:
                if not waiter.done():
                    waiter.set_result(None)
        self._rt.changed(self)

    def _apply(self, event: m.Event, reply: asyncio.Future[Any] | None, decision: m.Decision | None = None) -> None:
        self._note_death(event)
        old = self.state
        if decision is None:
            decision = m.decide(old, event, self.counters, self._tuning, self._rt.clock())
        self.counters = decision.counters
        if decision.state is not old:
            self._set_state(decision.state)
        for effect in decision.effects:
            self._do(effect, event, reply)

    # -- replacement: the next process and the retirees (procman/rolling.py) ----------------------

    def _serving(self) -> bool:
        """READY with no stop, reload or close pending: a rolling start may take over from this process."""
        c = self.counters
        return self.state is State.READY and not c.draining and not c.swap and not c.closed

    def _alone(self) -> bool:
        """No process of a replacement is left (the owner may end once closed)."""
        return self._roll is None and not self._retired

    def _replacing(self, event: r.Replace | r.Report, reply: asyncio.Future[Any] | None) -> None:
        """The owner's step for a replacement's command or report (the machine's events go to ``decide``)."""
        if reply is not None and reply.done():
            return
        if isinstance(event, r.Replace):
            self._replace_turn(event, reply)
        elif isinstance(event, r.NextStarted):
            self._next_landed(event)
        elif isinstance(event, r.NextGone):
            self._end_roll()
        else:
            self._retired.pop(event.generation, None)
            self._retired_gone = {g for g in self._retired_gone if g > event.generation - DEATHS_KEPT}
            self._retired_gone.add(event.generation)
        self._turn_ends()

    def _replace_turn(self, event: r.Replace, reply: asyncio.Future[Any] | None) -> None:
        fits = self._rt.fits_beside
        mode = r.choose(event.rolling, self._serving(), self.spec.remote or event.spec.remote, self._roll is not None,
                        lambda: fits is not None and fits(self))
        if mode == "wait":
            roll = self._roll
            assert roll is not None
            if roll.pending is not None and roll.pending[1] is not None:
                roll.pending[1].set_result(None)  # superseded by this later one
            roll.pending = (event, reply)
        elif mode == "stop-first":
            if event.rolling and self._serving():
                log.info("%s: not enough room for a second process; the change is stop-first", self.name)
            if event.spec != self.spec:
                self._next_spec = event.spec
            self._handle(m.Restart(event.reason) if event.spec == self.spec else m.Update(), reply)
        else:
            roll = self._roll = r.Rollout(event.spec, event.reason, event.spec == self.spec, r.next_key(self.name),
                                          self._rt.clock(), self.pid, [reply] if reply is not None else [])
            log.info("%s: rolling %s: starting a new process beside pid=%s", self.name, event.reason, self.pid)
            self._rt.publish(Rolled(self.name, "starting", event.reason, old_pid=self.pid))
            self._helper("roll", self._start_next(roll))

    async def _start_next(self, roll: r.Rollout) -> None:
        self._post(await r.start_next(self._rt, self, self.name, self.logs, roll))

    def _next_landed(self, event: r.NextStarted) -> None:
        roll = self._roll
        assert roll is not None
        outcome = r.landed(event.outcome, roll.dropping, self._serving())
        if outcome == "switch":
            self._switch(roll, event.payload)
        elif outcome == "fail":
            error = str(event.payload) if event.payload is not None else "its start was interrupted"
            self.last_error = f"the new process failed to start; the old one keeps serving: {error}"
            log.warning("%s: %s", self.name, self.last_error)
            self._rt.publish(Started(self.name, roll.reason, False, self._rt.clock() - roll.began, self.generation,
                                     None, error))
            self._rt.publish(Rolled(self.name, "failed", roll.reason, old_pid=roll.old_pid, error=error))
            self._end_roll()
        elif isinstance(event.payload, process.Running):  # drop: the new process is not wanted any more
            self._helper("roll", self._stop_next(event.payload))
        else:
            self._end_roll()

    def _switch(self, roll: r.Rollout, running: process.Running) -> None:
        """The new process takes the name: requests go to it from now on; the old one retires and drains."""
        old = self._running
        assert old is not None
        retiree = r.Retiree(old, self.generation, self.counters.in_flight, r.old_key(self.name, old.pid))
        self._retired[retiree.generation] = retiree
        self._running = running
        self.spec = self._next_spec = roll.spec
        self._start_began, self.started_at = roll.began, time.time()
        if self._rt.switched is not None:
            self._rt.switched(self, retiree.key, roll.key)
        self._apply(m.Switched(roll.reason, roll.restart), None)
        self._helper(f"retire {retiree.generation}", self._retire(retiree))
        log.info("%s: requests now go to pid=%s; pid=%s drains and stops", self.name, self.pid, old.pid)
        self._rt.publish(Rolled(self.name, "switched", roll.reason, old_pid=old.pid, pid=self.pid))
        self._end_roll()

    def _give_up_roll(self) -> None:
        """The current process stopped serving (unload, crash, reload, remove) while the next one starts: the
        next one is stopped, and a changed spec is kept for the next start (unless a newer one is pending)."""
        roll = self._roll
        assert roll is not None
        roll.dropping = True
        roll.abort.set()
        log.info("%s: the rolling %s is given up (the current process is %s)", self.name, roll.reason,
                 self.state.value)
        self._rt.publish(Rolled(self.name, "interrupted", roll.reason, old_pid=roll.old_pid))
        if roll.spec != self.spec and not self.counters.swap and not self.counters.closed:
            self._next_spec = roll.spec
            self._post(m.Update())

    async def _stop_next(self, running: process.Running) -> None:
        try:
            await process.terminate(self._rt, self.spec, running, self.logs)
        finally:
            self._rt.allocator.release(running.address)
            self._post(r.NextGone())

    def _end_roll(self) -> None:
        roll, self._roll = self._roll, None
        if roll is None:
            return
        for reply in roll.replies:
            if not reply.done():
                reply.set_result(None)
        if roll.pending is not None:
            self._post_reply(*roll.pending)

    def _post_reply(self, event: r.Replace, reply: asyncio.Future[Any] | None) -> None:
        self._queue.put_nowait((event, reply))

    async def _retire(self, retiree: r.Retiree) -> None:
        try:
            death = await r.retire(self._rt, lambda: self.spec, retiree, self.logs)
            if death is not None:
                self._deaths[retiree.generation] = death
                self.last_error = (f"{self.name} pid={retiree.running.pid} (replaced, draining) ended: "
                                   f"{death.cause}, {process.exit_words(death.code)}")
        finally:
            self._rt.allocator.release(retiree.running.address)
            self._post(r.RetireeGone(retiree.generation))

    # -- each event's own bookkeeping, before it is decided (_BEFORE) ----------------------------

    def _death_first(self, event: m.Want) -> m.Event:
        """A caller that wants the process never gets a lease on a dead one: its exit is decided first."""
        running = self._running
        if running is not None and deaths.heard_first(self.state, event, running.exited.done()):
            self._apply(self._exited(running, self.generation), None)
        return event

    def _closing(self, event: m.Close) -> m.Event:
        """A shutdown (no drain) stops the replaced processes now too; a remove lets them drain first."""
        if not event.drain:
            for retiree in self._retired.values():
                retiree.drained.set()
        return event

    def _forgiven(self, event: m.Forgive) -> m.Event:
        """``event`` with its count: the deaths among its generations that were counted, now blamed."""
        counted = deaths.forgivable(self._deaths, event.generations)
        for generation in counted:
            self._deaths[generation] = dataclasses.replace(self._deaths[generation], blamed=True)
        return m.Forgive(event.generations, len(counted))

    def _restarting(self, event: m.Restart) -> m.Event:
        """A ``hang`` restart (the router saw a request's heartbeats stop) of a process found stopped by a signal is
        from outside, as the health watch's ``Hung`` says: asked now, before the kill, so it counts no failure."""
        if event.reason != "hang" or event.outside:
            return event
        stopped = self.stopped(self.generation if event.generation is None else event.generation)
        return dataclasses.replace(event, outside=True) if stopped else event

    def _retuned(self, event: m.Retune) -> m.Event:
        self.spec = self._next_spec  # decided with the new settings
        return event

    def _done(self, event: m.Done) -> m.Event:
        self.last_used = time.time()
        return event

    def _landed(self, event: m.Started) -> m.Event:
        """What the start left: its process (``ok``, or ``aborted`` with one to terminate), or its error."""
        if event.outcome in ("failed", "refused"):
            error: BackendUnavailable = event.payload
            self._start_error, self.started_at = error, None
            self.exit_code = error.exit_code if isinstance(error, StartFailed) else None
        elif event.payload is not None:
            self._running = event.payload
        return event

    def _note_death(self, event: m.Event) -> None:
        """Remember how the READY process ended (what a request it failed is told: ``death(generation)``)."""
        if type(event) not in deaths.REPORTS:
            return  # (the request path's events: not even a call)
        code = self._running.exit_code if self._running is not None else None
        death = deaths.recorded(self.state, event, self.generation, self.counters.in_flight, code)
        if death is None:
            return
        self._deaths[self.generation] = death
        for old in [g for g in self._deaths if g < self.generation - DEATHS_KEPT]:
            del self._deaths[old]

    def _set_state(self, new: State) -> None:
        """The one mutator of ``state``: checks ``ALLOWED``, logs ``name old->new pid``, tells the listeners."""
        old = self.state
        if new not in ALLOWED[old]:
            raise InvalidTransition(f"{self.name}: {old.name}->{new.name} is not an allowed transition")
        self.state = new
        self.state_since = self._rt.clock()
        if new is State.STARTING:
            self._start_began = self.state_since
        elif new is State.READY and self._ready is not None:
            ready, self._ready = self._ready, None
            ready.set_result(None)
        log.info("%s %s->%s pid=%s", self.name, old.name, new.name, self.pid)
        self._rt.publish(Transition(self.name, old, new, self.pid, self.counters.reason or None, self.generation,
                                    self.last_error, self.started_at, self.retry_after_s))
        self._rt.changed(self)  # the manager's accounting sees every state, even one left within this event

    # -- effects -----------------------------------------------------------------------------

    def _do(self, effect: m.Effect, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        handler = _EFFECTS[type(effect)]
        handler(self, effect, event, reply)

    def _lease(self) -> Lease | None:
        running = self._running
        return Lease(running.address, running.pid, self.generation, running.exited) if running is not None else None

    def _admit(self, effect: m.Admit, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        if reply is None:
            return  # the shortcut's caller builds its own lease
        lease = self._lease()
        if lease is not None:
            reply.set_result(lease)

    def _park(self, effect: m.Park, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        if reply is not None:
            self._parked.append((reply, event))

    def _refuse(self, effect: m.Refuse, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        if reply is not None:
            reply.set_exception(self._refusal(effect.why, effect.retry_after_s))

    def _refusal(self, why: str, retry_after_s: float | None = None, by: str = "") -> BackendUnavailable:
        if why == "backoff":
            remaining = retry_after_s or 0.0
            message = (
                f"{self.name} is backing off after {self.counters.failures} failure(s); next try in {remaining:.1f}s"
                f" (last error: {self.last_error})"
            )
            return InBackoff(message, retry_after_s=remaining)
        if why == "interrupted":
            return StartInterrupted(f"the start of {self.name} was interrupted ({by})", by=by)
        if why == "failed" and self._start_error is not None:
            return self._start_error
        return BackendClosed(f"{self.name} was removed or is shutting down")

    def _wake(self, effect: m.Wake, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        parked, self._parked = self._parked, []
        for waiter, want in parked:
            if not waiter.done():
                self._apply(want, waiter)

    def _fail_parked(self, effect: m.FailParked, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        parked, self._parked = self._parked, []
        if not parked:
            return
        error = self._refusal(effect.why, effect.retry_after_s, effect.by)
        if effect.why == "failed" and effect.retry_after_s is not None:
            error.retry_after_s = effect.retry_after_s
        for waiter, _ in parked:
            if not waiter.done():
                waiter.set_exception(error)
                waiter.add_done_callback(_retrieve)

    def _spawn(self, effect: m.Spawn, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        self._abort = abort = asyncio.Event()
        self._start_error = None
        self._start_began = self._rt.clock()
        self.started_at = time.time()
        self._helper("start", self._start(effect.reserve, abort))

    def _abort_start(self, effect: m.Abort, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        if self._abort is not None:
            self._abort.set()

    def _terminate(self, effect: m.Terminate, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        self._cancel("watch", "idle")
        if effect.graceful:
            self._helper("stop", self._stop_process(graceful=True))
        else:
            log.warning("%s pid=%s: killing it at once (SIGKILL)", self.name, self.pid)
            self._helper("stop", self._stop_process(graceful=False))

    def _reap(self, effect: m.Reap, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        self._cancel("watch", "idle")
        running, self._running = self._running, None
        if running is None:
            return
        process.kill_now(running)  # whatever the dead process left in its group
        self.exit_code = running.exit_code
        self.logs.note(f"pid={running.pid} exited with code {self.exit_code}")
        self._release(running)

    def _watch(self, effect: m.Watch, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        running = self._running
        if running is not None:
            self._helper("watch", self._watch_process(running, self.generation))

    def _arm(self, effect: m.Arm, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        timers: dict[str, m.Event] = {"idle": m.IdleTick(), "retry": m.RetryDue(), "drain": m.DrainTimeout()}
        fire = timers[effect.timer]
        self._helper(effect.timer, self._timer(effect.delay_s, fire))

    def _disarm(self, effect: m.Disarm, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        self._cancel(effect.timer)

    def _notify(self, effect: m.Notify, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        if effect.what == "start":
            self.starts += effect.ok
            error = None if effect.ok else str(self._start_error or "start failed")
            duration_s = self._rt.clock() - self._start_began
            if effect.ok:
                self.last_load_s = duration_s
            self._rt.publish(Started(self.name, effect.reason, effect.ok, duration_s, self.generation, self.pid, error))
        elif effect.what == "restart":
            self.restarts += 1
            self._rt.publish(self.restarted(effect.reason))
        else:
            log.info("stopped %s (%s)", self.name, effect.reason)
            self._rt.publish(Stopped(self.name, effect.reason, self.generation))

    def restarted(self, reason: str) -> Restarted:
        """The news that this backend's process is being replaced for ``reason``, with its figures now."""
        node = self._running.node if self._running is not None else None
        return Restarted(self.name, reason, self.generation, self.pid, node, self.last_error)

    def _blame(self, effect: m.Blame, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        running = self._running
        pid = running.pid if running is not None else None
        if effect.reason == "start":
            self.last_error = str(self._start_error) if self._start_error is not None else "start failed"
            return
        if effect.reason in ("crash", "fatal") and running is not None and running.exited.done():
            tail = self.logs.since(running.log_mark, 5)
            code = running.exit_code
            killed = f" ({process.signal_name(code)})" if code is not None and code < 0 else ""
            error = f"{self.name} pid={pid} exited unexpectedly with code {code}{killed}"
            log.warning("%s", error)
            self.last_error = error + ("; last log lines:\n" + "\n".join(tail) if tail else "")
            return
        told, self._kill_why = self._kill_why, None
        why = told[1] if told is not None and told[0] in (None, self.generation) else None
        self.last_error = f"{self.name} pid={pid} was killed: {why or deaths.fault_words(effect.reason, self.spec)}"
        log.warning("%s", self.last_error)

    def _swap(self, effect: m.Swap, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        self.spec = self._next_spec
        log.info("%s spec updated", self.name)

    def _give_up(self, effect: m.GiveUp, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        c = self.counters
        log.warning("%s: no more automatic relaunches after %d failures in a row (crashes, fatal errors, hangs or "
                    "failed starts; the last: %s); the next request starts it again once the backoff is over",
                    self.name, c.failures, c.reason or "unknown")

    def _follow_up(self, effect: m.FollowUp, event: m.Event, reply: asyncio.Future[Any] | None) -> None:
        self._apply(effect.event, None)

    # -- helpers: the tasks that wait, and report back ----------------------------------------

    def _helper(self, slot: str, coro: Any) -> None:
        self._cancel(slot)
        self._helpers[slot] = asyncio.get_running_loop().create_task(coro, name=f"procman {self.name} {slot}")

    def _cancel(self, *slots: str) -> None:
        for slot in slots:
            task = self._helpers.pop(slot, None)
            if task is not None and task is not asyncio.current_task():
                task.cancel()

    async def _timer(self, delay_s: float, fire: m.Event) -> None:
        await self._rt.sleep(delay_s)
        self._post(fire)

    async def _start(self, reserve: bool, abort: asyncio.Event) -> None:
        self._post(await self._starting(reserve, abort))

    async def _starting(self, reserve: bool, abort: asyncio.Event) -> m.Started:
        try:
            if reserve and not self.spec.remote and not await _unless(abort, self._rt.prepare(self)):
                return m.Started("aborted")
            where = self._rt.locate(self, self.name) if self._rt.locate is not None else None
            running = await process.launch(self._rt, self.spec, self.logs, abort, where)
        except process.Stopped as outside:
            return m.Started("stopped", has_process=True, payload=outside.running)
        except process.Aborted as stopped:
            return m.Started("aborted", has_process=True, payload=stopped.running)
        except NoRoom as refused:
            return m.Started("refused", payload=refused.error)
        except BackendUnavailable as exc:
            return m.Started("failed", payload=exc)
        except Exception as exc:  # a bug or an odd OS error must fail the start, never wedge it in STARTING
            log.exception("%s: start failed unexpectedly", self.name)
            return m.Started("failed", payload=BackendUnavailable(f"{self.name}: start failed unexpectedly: {exc!r}"))
        return m.Started("ok", payload=running)

    async def _stop_process(self, graceful: bool) -> None:
        running = self._running  # pid and address stay visible while STOPPING
        if running is not None:
            try:
                if graceful:
                    self.exit_code = await process.terminate(self._rt, self.spec, running, self.logs)
                else:
                    self.exit_code = await process.kill(self._rt, self.spec, running, self.logs)
            except Exception:  # never stay in STOPPING: the group gets SIGKILL and the state moves on
                log.exception("%s: stopping pid=%s failed; sending SIGKILL", self.name, running.pid)
                process.kill_now(running)
            finally:
                self._running = None
                self._release(running)
        self._post(m.Reaped())

    def _release(self, running: process.Running) -> None:
        self.started_at = None
        self._rt.allocator.release(running.address)

    async def _watch_process(self, running: process.Running, generation: int) -> None:
        reason = await process.watch(self._rt, lambda: self.spec, running)
        if reason == "crash":
            self._post(self._exited(running, generation))
        else:  # a hang with one request in flight: that request most likely hung it (unless SIGSTOP silenced it)
            stopped = process.stopped(running)
            hang = deaths.of_hang(self.counters.in_flight, stopped)
            self._post(m.Hung(generation, blamed=hang.blamed, outside=stopped))

    def _exited(self, running: process.Running, generation: int) -> m.Exited:
        death = process.exit_death(running, self.logs, self.spec, self.counters.in_flight)
        cause: Literal["crash", "fatal"] = "fatal" if death.cause == "fatal" else "crash"
        return m.Exited(generation, cause, death.blamed, lost=process.node_lost(running))


#: Deaths remembered per backend (a request asks about its own process, a moment after it died).
DEATHS_KEPT = 8


class NoRoom(Exception):
    """``before_start`` refused the start (wraps its BackendUnavailable)."""

    def __init__(self, error: BackendUnavailable) -> None:
        super().__init__(str(error))
        self.error = error


async def _unless(abort: asyncio.Event, hook: Awaitable[None]) -> bool:
    """Run the ``before_start`` hooks unless ``abort`` comes first; False when aborted."""
    try:
        return await unless_aborted(abort, hook)
    except BackendUnavailable as exc:
        raise NoRoom(exc) from None
    except Exception as exc:
        log.warning("before_start failed: %r", exc)
        raise NoRoom(BackendUnavailable(f"cannot start: {exc}")) from None


class InFlight:
    """``async with backend.request() as lease``: admitted on entry, counted done on exit (whatever happened),
    against the process it was admitted to (a rolling replacement may have retired it meanwhile)."""

    __slots__ = ("_backend", "_generation")

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._generation = 0

    async def __aenter__(self) -> Lease:
        lease = await self._backend._admitted()
        self._generation = lease.generation
        return lease

    async def __aexit__(self, *exc_info: object) -> None:
        await self._backend._finished(self._generation)


_WANT_ONE = m.Want(count=True)
_DONE = m.Done()

#: Each event's own bookkeeping before it is decided (:meth:`Backend._handle`).
_BEFORE: dict[type, Callable[[Backend, Any], m.Event]] = {
    m.Close: Backend._closing,
    m.Want: Backend._death_first,
    m.Forgive: Backend._forgiven,
    m.Restart: Backend._restarting,
    m.Retune: Backend._retuned,
    m.Done: Backend._done,
    m.Started: Backend._landed,
}
#: The same for an event the shortcut decided already: it made a Want's death check itself (``heard_first``).
_BEFORE_DECIDED = {kind: hook for kind, hook in _BEFORE.items() if kind is not m.Want}


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # an error nobody awaited any more must not warn at exit


_EFFECTS: dict[type, Callable[..., None]] = {
    m.Admit: Backend._admit,
    m.Park: Backend._park,
    m.Refuse: Backend._refuse,
    m.Wake: Backend._wake,
    m.FailParked: Backend._fail_parked,
    m.Spawn: Backend._spawn,
    m.Abort: Backend._abort_start,
    m.Terminate: Backend._terminate,
    m.Reap: Backend._reap,
    m.Watch: Backend._watch,
    m.Arm: Backend._arm,
    m.Disarm: Backend._disarm,
    m.Notify: Backend._notify,
    m.Blame: Backend._blame,
    m.Swap: Backend._swap,
    m.GiveUp: Backend._give_up,
    m.FollowUp: Backend._follow_up,
}
