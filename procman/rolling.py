"""Replacing a backend's process: rolling (the new one beside the old) where room allows, else stop-first.

``backend.replace(spec, rolling=True)`` is one command to the backend's owner, which owns both
processes of its name — the *current* one (the state machine's) and the *next* one (a rolling
start) — and tells them apart by structure, never by names:

```
Replace ──choose()──> "stop-first": the machine's Restart (same spec) or Update (new spec)
                      "wait":       a replacement is under way; this one follows it (the latest wins)
                      "roll":       start the next process beside the current one (its room is made
                                    beside it, never by evicting it), then landed():
                                      "switch"  the machine's Switched: requests go to the new process;
                                                the old one becomes a Retiree that drains and stops
                                      "fail"    the old one keeps serving; Rolled("failed", error)
                                      "drop"    the current left READY meanwhile (unload, crash, remove):
                                                the new process is stopped, the change kept for the next start
```

A request keeps the process it was admitted to: its lease names the generation, and its end is
counted against that process (a :class:`Retiree` once replaced). A retiree that crashes or hangs
while it drains is killed at once and its death recorded, so the requests it was serving are
retried or resumed on the new process. Both processes hold room while both live
(``Backend.seats()``: the manager's memory accounting counts them).

The decisions (:func:`choose`, :func:`landed`) are pure and tested as tables; the mechanics of the
next process's start and of a retiree's drain are :func:`start_next` and :func:`retire`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from procman import deaths, process
from procman.deaths import Death
from procman.errors import BackendUnavailable
from procman.logbuffer import LogBuffer
from procman.runtime import Runtime, unless_aborted
from procman.spec import BackendSpec

__all__ = [
    "Landed", "Mode", "NextGone", "NextStarted", "Replace", "Retiree", "RetireeGone", "Rollout", "Seat", "choose",
    "landed", "next_key", "old_key", "retire", "start_next",
]

log = logging.getLogger(__name__)

#: The backend type (procman.backend.Backend, which imports this module): a parameter, so the import goes one way.
B = TypeVar("B")

Mode = Literal["roll", "stop-first", "wait"]
Landed = Literal["switch", "fail", "drop"]


# -- commands and reports (the backend's queue carries them beside the machine's events) ---------


@dataclass(frozen=True, slots=True)
class Replace:
    """Replace the process with one running ``spec`` (rolling when asked and room allows)."""

    spec: BackendSpec
    rolling: bool
    reason: str  # manual (the same spec again) or reload


@dataclass(frozen=True, slots=True)
class NextStarted:
    """The next process's start ended: ``ok`` (payload: the Running), ``failed`` (the error) or ``aborted``
    (payload: the live process to stop, or None)."""

    outcome: Literal["ok", "failed", "aborted"]
    payload: Any = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class NextGone:
    """A next process that was dropped is gone (its address released)."""


@dataclass(frozen=True, slots=True)
class RetireeGone:
    """The replaced process of ``generation`` is gone: drained and stopped, or dead and reaped."""

    generation: int


Report = NextStarted | NextGone | RetireeGone
#: what the backend's owner hands to its replacement step instead of ``decide()``
EVENTS = (Replace, NextStarted, NextGone, RetireeGone)


# -- the decisions --------------------------------------------------------------------------------


def choose(rolling: bool, serving: bool, remote: bool, busy: bool, fits: Callable[[], bool]) -> Mode:
    """How a Replace is carried out: ``wait`` behind a replacement under way (``busy``); ``roll`` when asked,
    the current process serves (READY, no stop or reload pending), it is no remote and a second process
    ``fits`` now beside it; else ``stop-first``."""
    if busy:
        return "wait"
    if rolling and serving and not remote and fits():
        return "roll"
    return "stop-first"


def landed(outcome: Literal["ok", "failed", "aborted"], dropping: bool, serving: bool) -> Landed:
    """What the end of the next process's start leads to: ``switch`` to it when it is up and the current one
    still serves; ``drop`` it when the replacement was given up or the current one left READY meanwhile;
    ``fail`` (the current one keeps serving) when it did not come up."""
    if dropping or not serving:
        return "drop"
    return "switch" if outcome == "ok" else "fail"


# -- what the owner keeps -------------------------------------------------------------------------


def next_key(name: str) -> str:
    """The label a rolling start's process is counted under in the room accounting (never parsed)."""
    return f"{name} (new)"


def old_key(name: str, pid: int | None) -> str:
    """The label a replaced process is counted under until it exited (never parsed)."""
    return f"{name} (old pid {pid})"


@dataclass(frozen=True, slots=True)
class Seat:
    """A process of a replacement that holds room beside the current one: the ``next`` one (``starting``)
    or a retiree (leaving)."""

    key: str
    starting: bool


@dataclass(slots=True, eq=False)
class Rollout:
    """A rolling start under way. Written only by the backend's owner (and ``holds`` by its start helper)."""

    spec: BackendSpec
    reason: str
    restart: bool  # the same spec again (a manual restart)
    key: str
    began: float  # clock time of the start (its duration is the start's)
    old_pid: int | None
    replies: list[asyncio.Future[Any]] = field(default_factory=list)
    abort: asyncio.Event = field(default_factory=asyncio.Event)
    holds: bool = False  # its room was granted: counted until the replacement ends
    dropping: bool = False  # given up: its process (if any) is being stopped
    pending: tuple[Replace, asyncio.Future[Any] | None] | None = None  # the Replace that follows this one


@dataclass(slots=True, eq=False)
class Retiree:
    """A replaced process draining its requests. ``in_flight`` is written by the request path (``done``)."""

    running: process.Running
    generation: int
    in_flight: int
    key: str
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    condemned: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""  # why it was condemned (hang, fatal: a request saw it fail)

    def __post_init__(self) -> None:
        if self.in_flight <= 0:
            self.drained.set()

    def done(self) -> None:
        """One of its requests ended; the last one lets it stop."""
        self.in_flight = max(0, self.in_flight - 1)
        if self.in_flight == 0:
            self.drained.set()

    def condemn(self, reason: str) -> None:
        """SIGKILL it now (a request saw it hang or fail fatally): it is never waited for."""
        self.reason = reason
        self.condemned.set()


# -- the mechanics --------------------------------------------------------------------------------


async def start_next(rt: Runtime[B], backend: B, name: str, logs: LogBuffer, roll: Rollout) -> NextStarted:
    """Make room for the next process of ``backend`` (``name``) beside the current one, spawn it and wait for its
    readiness."""
    try:
        if rt.beside is not None and not await unless_aborted(roll.abort, rt.beside(backend, roll.key)):
            return NextStarted("aborted")
        roll.holds = True
        rt.changed(backend)
        where = rt.locate(backend, roll.key) if rt.locate is not None else None
        running = await process.launch(rt, roll.spec, logs, roll.abort, where)
    except process.Stopped as outside:  # stopped by a signal as it started: killed, and the old one keeps serving
        try:
            await process.kill(rt, roll.spec, outside.running, logs)
        finally:
            rt.allocator.release(outside.running.address)
        return NextStarted("failed", BackendUnavailable(f"{name}: {outside}"))
    except process.Aborted as stopped:
        return NextStarted("aborted", stopped.running)
    except BackendUnavailable as exc:
        return NextStarted("failed", exc)
    except Exception as exc:  # a bug or an odd OS error fails the replacement, never wedges it
        log.exception("%s: the new process failed to start unexpectedly", name)
        return NextStarted("failed", BackendUnavailable(f"{name}: start failed unexpectedly: {exc!r}"))
    return NextStarted("ok", running)


async def retire(rt: Runtime[Any], spec: Callable[[], BackendSpec], retiree: Retiree, logs: LogBuffer) -> Death | None:
    """Drain ``retiree`` (its requests end, or ``drain_timeout_s`` passes), then SIGTERM it; a retiree that
    exits, hangs or is condemned meanwhile is killed at once and its death returned (None: a clean stop), judged
    as the current process's would be (a hang of a process found stopped by a signal is from outside)."""
    running = retiree.running
    watch = asyncio.ensure_future(process.watch(rt, spec, running))
    waits = [asyncio.ensure_future(retiree.drained.wait()), asyncio.ensure_future(retiree.condemned.wait()),
             asyncio.ensure_future(rt.sleep(spec().drain_timeout_s))]
    try:
        await asyncio.wait({watch, *waits}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (watch, *waits):
            task.cancel()
    in_flight = retiree.in_flight
    if watch.done() and not watch.cancelled() and watch.result() == "crash":
        death = process.exit_death(running, logs, spec(), in_flight)  # (by its own lines, before our note)
        process.kill_now(running)  # whatever it left in its group
        logs.note(f"pid={running.pid} exited with code {running.exit_code} (replaced, draining)")
        return death
    hung = watch.done() and not watch.cancelled()
    if hung or retiree.condemned.is_set():
        reason = "hang" if hung else retiree.reason
        stopped = process.stopped(running)  # SIGSTOP: silenced from outside, as Backend._watch_process asks too
        log.warning("%s pid=%s (replaced, draining): killing it at once (SIGKILL): %s", spec().name, running.pid,
                    reason)
        await process.kill(rt, spec(), running, logs)
        return deaths.of_hang(in_flight, stopped) if reason == "hang" else Death("fatal", None, in_flight)
    await process.terminate(rt, spec(), running, logs)
    return None
