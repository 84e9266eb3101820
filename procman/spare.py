"""Spare interpreters: a process started ahead of need, past its imports, that becomes the next backend.

A :class:`SparePool` is a :class:`~procman.spawner.Spawner` in front of the real one. It
keeps ``count`` spares running :attr:`SpareSpec.argv` (``python -m modelserver --spare``),
each of which imports what a start imports, prints :data:`SPARE_READY` and waits for one
line on stdin. A spawn whose command starts with :attr:`SpareSpec.serves` takes a spare
instead of a fresh process: the pool writes ``{"argv", "env", "cwd"}`` (what the fresh
process would have been started with) to the spare's stdin and hands its handle, output
redirected, to the backend. Everything else about the process is as a fresh spawn's: its
own process group, ``PR_SET_PDEATHSIG``, the group watchdog, the output pipe (a readiness
line arrives on it as from a fresh start). A new spare is started behind a taken one once
that start has announced itself ready (``READY_PREFIX``) and :data:`REFILL_DELAY_S` more have
passed (or after :data:`REFILL_AFTER_S`), so its imports do not compete with the start it
served, nor with that start's first answer.

A spare is used only when it would run exactly what a fresh process would:

- the same command prefix, folder, and environment, except the variables read only after
  the assignment (:attr:`SpareSpec.late_env`: the model's spec, the readiness token);
  anything else (a model's own ``env:``) makes that start a fresh one;
- not stale: the files of :attr:`SpareSpec.watch` / :attr:`SpareSpec.watch_trees` (the
  interpreter, the server's code, its libraries) have the same stat as when it started;
  a stale spare is killed and replaced;
- alive: one that died is replaced (after :data:`RETRY_S`; after :data:`GIVE_UP_AFTER`
  deaths in a row without one that lived to its ready line, the pool stops trying and says so).

A new :class:`SpareSpec` (:meth:`SparePool.configure`; a config change) retires every spare
and starts afresh; ``count`` 0 or ``None`` keeps none. A spare counts in the memory budget
of :attr:`SpareSpec.device` (:meth:`SparePool.holders`: its resident memory, measured once
ready) as the first thing placement stops (:meth:`SparePool.evict`), and one is started only
where it fits (``fits``). The pool never outlives the router: spares die with it by the
death signal, by their stdin's end, and by the watchdog; :meth:`SparePool.close` kills them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from procman.placement import Holder
from procman.process import READY_PREFIX
from procman.procfs import process_memory_bytes
from procman.spawner import LineCallback, ProcessHandle, SubprocessHandle, SubprocessSpawner
from procman.spec import FrozenEnv

__all__ = ["REFILL_AFTER_S", "REFILL_DELAY_S", "SPARE_READY", "Spare", "SparePool", "SpareSpec"]

log = logging.getLogger(__name__)

#: The line a spare prints once past its imports (``modelserver.spare.SPARE_READY``).
SPARE_READY = "ovrouter-spare-ready"
#: The longest a new spare waits for the start before it (a start that never announces itself).
REFILL_AFTER_S = 30.0
#: After that start's readiness line, how long a new spare still waits: its imports (~1 s of CPU) would
#: otherwise compete with the start's first answer (a 2-core box: 0.7 -> 1.6-2.2 s to the first token).
REFILL_DELAY_S = 2.0
#: After a spare died on its own, the wait before the next one.
RETRY_S = 5.0
#: Spares that died in a row before their ready line, after which the pool stops starting them.
GIVE_UP_AFTER = 3
#: What a spare counts in the memory budget until it is measured.
DEFAULT_SIZE_BYTES = 128 << 20
TAIL_LINES = 10


@dataclass(frozen=True, slots=True)
class SpareSpec:
    """What a spare runs, what it can become, and when it is stale."""

    argv: tuple[str, ...]  # the spare's own command
    serves: tuple[str, ...]  # the command prefix of the processes it can become
    count: int = 1
    cwd: str | None = None
    env: Mapping[str, str] = field(default_factory=FrozenEnv)  # over the router's environment
    late_env: frozenset[str] = frozenset()  # variables the process reads only after its assignment
    watch: tuple[str, ...] = ()  # files or folders whose stat, changed, makes a spare stale
    watch_trees: tuple[str, ...] = ()  # folders whose every file is watched so (the server's code)
    device: str | None = "CPU"  # the budget device its memory counts on
    size_bytes: int = DEFAULT_SIZE_BYTES  # counted until measured

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", FrozenEnv(self.env))
        object.__setattr__(self, "argv", tuple(self.argv))
        object.__setattr__(self, "serves", tuple(self.serves))
        if not self.argv or not self.serves:
            raise ValueError("a spare needs its argv and the command prefix it serves")


Fingerprint = tuple[tuple[str, int, int, int], ...]


def fingerprint(spec: SpareSpec) -> Fingerprint:
    """The stat (mtime, size, inode) of every watched path; a missing one counts as (0, 0, 0)."""
    paths = list(spec.watch)
    for tree in spec.watch_trees:
        for folder, dirs, files in os.walk(tree):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            paths += [os.path.join(folder, name) for name in sorted(files)]
    found = []
    for path in paths:
        try:
            info = os.stat(path)
        except OSError:
            found.append((path, 0, 0, 0))
            continue
        found.append((path, info.st_mtime_ns, info.st_size, info.st_ino))
    return tuple(found)


@dataclass(eq=False, slots=True)
class Spare:
    """One waiting process."""

    handle: SubprocessHandle
    env: dict[str, str]
    cwd: str | None
    stamp: Fingerprint
    ready: bool = False
    size_bytes: int = 0
    going: bool = False  # killed, counted until reaped
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    monitor: asyncio.Task[None] | None = None
    reaper: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return f"spare interpreter pid {self.handle.pid}"


class SparePool:
    """The spawner with spares; see the module doc. ``fits(device, size_bytes)`` says whether one more spare
    fits the device's memory budget now; ``on_change()`` is told whenever the spares' memory changed."""

    def __init__(
        self,
        spawner: SubprocessSpawner | None = None,
        spec: SpareSpec | None = None,
        *,
        fits: Callable[[str | None, int], bool] | None = None,
        demand: Callable[[Sequence[str]], tuple[int, int]] | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.inner = spawner or SubprocessSpawner()
        self.spec: SpareSpec | None = None
        self.fits = fits
        self.demand = demand
        self.on_change = on_change
        self.spares: list[Spare] = []
        self.taken = 0  # starts that took a spare
        self.fresh = 0  # starts of the command a spare serves that did not
        self.deaths = 0  # spares that died on their own before their ready line, in a row
        self._starting = 0  # starts served (by a spare or fresh) not yet announced ready
        self._closed = False
        self._refill: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._measured: int | None = None  # the last spare's resident memory
        self._pending = spec

    # -- the Spawner protocol ---------------------------------------------------------------------

    async def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, on_line: LineCallback
    ) -> ProcessHandle:
        self._start_once()
        spec = self.spec
        if spec is None or tuple(argv[: len(spec.serves)]) != spec.serves:
            return await self.inner.spawn(argv, env, cwd, on_line)
        self._starting += 1
        on_line, started = self._watch_start(on_line)
        try:
            spare = self._take(spec, argv, env, cwd)
            if spare is None:
                self.fresh += 1
                return await self.inner.spawn(argv, env, cwd, on_line)
            spare.handle.redirect(on_line)
            try:
                spare.handle.feed(json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd}).encode() + b"\n")
            except (OSError, RuntimeError) as exc:  # it died this moment: a fresh process after all
                log.warning("%s could not take its assignment (%s); starting a fresh process", spare.name, exc)
                self._kill(spare)
                self.fresh += 1
                return await self.inner.spawn(argv, env, cwd, on_line)
            self.taken += 1
            log.info("%s becomes %s", spare.name, " ".join(argv[len(spec.serves):]) or argv[0])
            self._changed()
            return spare.handle
        except BaseException:
            started()
            raise

    def _take(self, spec: SpareSpec, argv: Sequence[str], env: Mapping[str, str], cwd: str | None) -> Spare | None:
        """The first live spare that would run exactly what a fresh process would, out of the pool; stale ones and
        stopped ones (SIGSTOP: taken, it would hang the start until ``startup_timeout_s``) die."""
        stamp: Fingerprint | None = None
        for spare in list(self.spares):
            if spare.going or spare.handle.returncode is not None:
                continue
            if getattr(spare.handle, "stopped", lambda: False)() is True:  # it would hang the start it is given
                log.warning("%s is stopped by a signal (SIGSTOP from outside); replacing it", spare.name)
                self._kill(spare)
                continue
            if spare.cwd != cwd or _comparable(spare.env, spec) != _comparable(env, spec):
                continue
            stamp = fingerprint(spec) if stamp is None else stamp
            if spare.stamp != stamp:
                log.info("%s is stale (the code or the interpreter changed since it started); replacing it",
                         spare.name)
                self._kill(spare)
                continue
            self.spares.remove(spare)
            if spare.monitor is not None:
                spare.monitor.cancel()
            return spare
        return None

    def _watch_start(self, on_line: LineCallback) -> tuple[LineCallback, Callable[[], None]]:
        """``on_line`` that also notices the start's readiness line, and the start's end (idempotent): at that
        line, or after :data:`REFILL_AFTER_S` whatever happened."""
        done = False

        def started() -> None:
            nonlocal done
            if not done:
                done = True
                self._starting -= 1
                self._wake.set()

        def line(text: str) -> None:
            if not done and text.startswith(READY_PREFIX):  # the start a spare served is done
                asyncio.get_running_loop().call_later(REFILL_DELAY_S, started)
            on_line(text)

        asyncio.get_running_loop().call_later(REFILL_AFTER_S, started)
        return line, started

    # -- keeping the pool full --------------------------------------------------------------------

    def wanted(self) -> tuple[int, int]:
        """How many spares to keep now: ``count``, at most one per process not running that would take one
        (``demand``: those stopped, and those starting, which may be about to take one)."""
        spec = self.spec
        if spec is None:
            return 0, 0
        if self.demand is None:
            return spec.count, 0
        cold, starting = self.demand(spec.serves)
        return min(spec.count, cold), starting

    def nudge(self) -> None:
        """Something changed that may change :meth:`wanted` (a backend stopped or started)."""
        self._wake.set()

    def configure(self, spec: SpareSpec | None) -> None:
        """Use ``spec`` from now on: one that runs something else retires every spare (``None``: none); one that
        differs only in ``count`` keeps them (the pool grows or shrinks to it)."""
        if self._refill is None:
            self._pending = spec
            return
        if spec == self.spec:
            return
        if spec is not None and self.spec is not None and replace(spec, count=0) == replace(self.spec, count=0):
            self.spec = spec
            self._wake.set()
            return
        if self.spares:
            log.info("spare interpreters: the settings changed; retiring %d", len(self.spares))
        for spare in list(self.spares):
            self._kill(spare)
        self.spec = spec
        self.deaths = 0
        self._wake.set()

    def _start_once(self) -> None:
        if self._refill is None and not self._closed:
            self.spec = self._pending
            self._refill = asyncio.get_running_loop().create_task(self._keep_full(), name="spare interpreters")

    def start(self) -> None:
        """Begin keeping the pool full (from the event loop's thread: the death signal is bound to it)."""
        self._start_once()

    async def _keep_full(self) -> None:
        while not self._closed:
            self._wake.clear()
            spec = self.spec
            wanted, starting = self.wanted()
            live = [s for s in self.spares if not s.going]
            for spare in live[wanted:] if not starting else ():  # nothing left that would take them
                log.info("%s is not wanted now (the count, or no model is stopped); retiring it", spare.name)
                self._kill(spare)
            if (spec is not None and len(live) < wanted and not self._starting and self.deaths < GIVE_UP_AFTER
                    and (self.fits is None or self.fits(spec.device, self._measured or spec.size_bytes))):
                try:
                    await self._start_spare(spec)
                except OSError as exc:
                    log.warning("cannot start a spare interpreter (%s); cold starts start fresh processes", exc)
                    self.deaths = GIVE_UP_AFTER
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), RETRY_S)

    async def _start_spare(self, spec: SpareSpec) -> None:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")  # as procman.process.child_command has it
        env.update(spec.env)
        stamp = fingerprint(spec)
        holder: list[Spare] = []
        handle = await self.inner.spawn_fed(spec.argv, env, spec.cwd, lambda text: self._spare_line(holder, text))
        spare = Spare(handle, env, spec.cwd, stamp, size_bytes=self._measured or spec.size_bytes)
        holder.append(spare)
        self.spares.append(spare)
        spare.monitor = asyncio.get_running_loop().create_task(self._monitor(spare))
        log.debug("started %s", spare.name)
        self._changed()

    def _spare_line(self, holder: list[Spare], text: str) -> None:
        if not holder:
            return
        spare = holder[0]
        if text == SPARE_READY and not spare.ready:
            spare.ready = True
            self.deaths = 0
            spare.size_bytes = self._measured = process_memory_bytes(spare.handle.pid) or spare.size_bytes
            log.info("%s is ready (%.0f MiB resident)", spare.name, spare.size_bytes / (1 << 20))
            self._changed()
            return
        spare.tail.append(text)
        log.debug("%s: %s", spare.name, text)

    async def _monitor(self, spare: Spare) -> None:
        """A spare that exits while waiting: reaped, forgotten, replaced."""
        code = await spare.handle.exited()
        if spare not in self.spares:
            return
        if not spare.going:
            if not spare.ready:
                self.deaths += 1
            tail = "; ".join(spare.tail) or "it printed nothing"
            log.warning("%s exited with code %s while waiting: %s", spare.name, code, tail)
            if self.deaths >= GIVE_UP_AFTER:
                log.warning("%d spare interpreters in a row died before their imports were done; starting no "
                            "more (cold starts start fresh processes)", self.deaths)
        going = spare.going
        await self._reap(spare)
        await asyncio.sleep(0 if going else RETRY_S)
        self._wake.set()

    def _kill(self, spare: Spare) -> None:
        spare.going = True
        spare.handle.signal_group(signal.SIGKILL)
        self._reap(spare)
        self._changed()

    def _reap(self, spare: Spare) -> asyncio.Task[None]:
        """The one task that reaps ``spare`` (the handle's cleanup runs once) and forgets it."""
        if spare.reaper is None:
            spare.reaper = asyncio.get_running_loop().create_task(self._reaped(spare))
        return spare.reaper

    async def _reaped(self, spare: Spare) -> None:
        await spare.handle.wait()
        with contextlib.suppress(ValueError):
            self.spares.remove(spare)
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # -- memory -----------------------------------------------------------------------------------

    def holders(self) -> list[Holder]:
        """The spares' memory, for placement: idle, used longest ago (the first thing stopped for room)."""
        return [Holder(spare.name, self.spec.device if self.spec is not None else None, spare.size_bytes,
                       idle=not spare.going, last_used=0.0, going=spare.going)
                for spare in self.spares]

    def owns(self, name: str) -> bool:
        return any(spare.name == name for spare in self.spares)

    def evict(self, name: str) -> None:
        """Placement wants the room of spare ``name``: kill it (counted until it has exited)."""
        for spare in self.spares:
            if spare.name == name and not spare.going:
                log.info("stopping %s to make room", spare.name)
                self._kill(spare)

    def snapshot(self) -> dict[str, object]:
        """For ``/api`` and tests: the spares and how starts went."""
        return {"count": self.spec.count if self.spec is not None else 0, "taken": self.taken, "fresh": self.fresh,
                "spares": [{"pid": s.handle.pid, "ready": s.ready, "resident_bytes": s.size_bytes} for s in self.spares
                           if not s.going]}

    async def close(self) -> None:
        """Kill every spare and reap it; start no more."""
        self._closed = True
        if self._refill is not None:
            self._refill.cancel()
            await asyncio.gather(self._refill, return_exceptions=True)
        for spare in list(self.spares):
            if spare.monitor is not None:
                spare.monitor.cancel()
            self._kill(spare)
        await asyncio.gather(*(s.reaper for s in list(self.spares) if s.reaper is not None), return_exceptions=True)
        self.spares.clear()


def _comparable(env: Mapping[str, str], spec: SpareSpec) -> dict[str, str]:
    return {key: value for key, value in env.items() if key not in spec.late_env}
