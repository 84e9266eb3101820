"""Fakes for procman unit tests: a clock whose time only moves when a test says so, a spawner
of pretend processes, a prober that asks those processes whether they are healthy, and a
recorder of procman's notices.

Nothing here sleeps: ``FakeClock.sleep`` waits until ``advance`` moves time past its deadline.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from procman import Address, Backend, BackendSpec, ProcessManager, Restarted, Started, State, Stopped, Transition

T = TypeVar("T")


async def settle(rounds: int = 50) -> None:
    """Let every runnable task run until it waits on something (the loop goes round ``rounds`` times)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class FakeClock:
    """``clock()`` reads the time; ``await clock.sleep(d)`` returns once ``advance`` passed ``now + d``."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def __call__(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + max(delay, 0.0), next(self._seq), future))
        await future

    @property
    def sleepers(self) -> int:
        return sum(1 for *_, f in self._sleepers if not f.done())

    async def settle(self) -> None:
        """How the clock lets wake-ups run (a subclass may settle differently)."""
        await settle()

    async def advance(self, seconds: float) -> None:
        """Move time forward, waking sleepers in deadline order and letting each wake-up run."""
        target = self.now + seconds
        await self.settle()
        while self._sleepers and self._sleepers[0][0] <= target:
            deadline, _, future = heapq.heappop(self._sleepers)
            if future.done():
                continue
            self.now = max(self.now, deadline)
            future.set_result(None)
            await self.settle()
        self.now = target
        await self.settle()

    async def run(self, awaitable: Awaitable[T], step: float = 0.5, limit_s: float = 10_000.0) -> T:
        """Await ``awaitable`` while advancing time ``step`` by ``step`` (for things that wait on timers)."""
        task = asyncio.ensure_future(awaitable)
        spent = 0.0
        await settle()
        while not task.done():
            if spent > limit_s:
                task.cancel()
                raise AssertionError(f"still not done after {limit_s}s of fake time")
            await self.advance(step)
            spent += step
        return task.result()


class FakeProcess:
    """A pretend child. ``exit(code)`` ends it; SIGTERM ends it unless ``ignore_term``; SIGKILL always."""

    def __init__(
        self, pid: int, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, on_line: Callable[[str], None]
    ) -> None:
        self.pid = pid
        self.argv = list(argv)
        self.env = dict(env)
        self.cwd = cwd
        self.healthy = True
        self.health_body: dict[str, Any] = {"status": "ready"}  # what its health path answers while healthy
        self.ignore_term = False
        self.sigstopped = False  # as if SIGSTOPped: stopped() says so
        self.signals: list[int] = []
        self._on_line = on_line
        self._exit: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    @property
    def returncode(self) -> int | None:
        return self._exit.result() if self._exit.done() else None

    @property
    def alive(self) -> bool:
        return not self._exit.done()

    async def wait(self) -> int:
        return await asyncio.shield(self._exit)

    def exit(self, code: int) -> None:
        if not self._exit.done():
            self._exit.set_result(code)

    def stopped(self) -> bool:
        return self.sigstopped and self.alive

    def say(self, *lines: str) -> None:
        for line in lines:
            self._on_line(line)

    def signal_group(self, sig: int) -> None:
        """SIGKILL ends it; SIGTERM too unless ``ignore_term``, but a ``sigstopped`` one acts on it only once a
        SIGCONT lets it run again (as a real stopped process)."""
        self.signals.append(sig)
        if sig == signal.SIGCONT:
            self.sigstopped = False
        if sig == signal.SIGKILL:
            self.exit(-signal.SIGKILL)
        elif signal.SIGTERM in self.signals and not self.ignore_term and not self.sigstopped:
            self.exit(-signal.SIGTERM)

    def serves(self, address: Address) -> bool:
        wanted = address.path if address.kind == "uds" else str(address.port)
        return self.alive and wanted is not None and any(wanted in part for part in self.argv)


class FakeSpawner:
    """Records every spawn; ``on_spawn(proc)`` scripts what a new process does (print, exit, be unhealthy)."""

    def __init__(self) -> None:
        self.procs: list[FakeProcess] = []
        self.on_spawn: Callable[[FakeProcess], None] | None = None
        self.fail_with: OSError | None = None
        self._pids = itertools.count(4000)

    async def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, on_line: Callable[[str], None]
    ) -> FakeProcess:
        if self.fail_with is not None:
            raise self.fail_with
        proc = FakeProcess(next(self._pids), argv, env, cwd, on_line)
        self.procs.append(proc)
        if self.on_spawn is not None:
            self.on_spawn(proc)
        return proc

    @property
    def last(self) -> FakeProcess:
        return self.procs[-1]

    def alive(self) -> list[FakeProcess]:
        return [p for p in self.procs if p.alive]


class FakeProber:
    """Healthy when a live fake process serves the address and says it is healthy; ``remote`` for urls."""

    def __init__(self, spawner: FakeSpawner) -> None:
        self.spawner = spawner
        self.remote: dict[str, bool] = {}
        self.calls: list[tuple[Address, str]] = []
        self.methods: list[str] = []

    async def check(
        self, address: Address, path: str, timeout_s: float, method: str = "GET"
    ) -> tuple[int, bytes] | None:
        self.calls.append((address, path))
        self.methods.append(method)
        if address.url is not None:
            return (200, b"") if self.remote.get(address.url, False) else None
        proc = next((p for p in self.spawner.procs if p.healthy and p.serves(address)), None)
        return None if proc is None else (200, json.dumps(proc.health_body).encode())


class Recorder:
    """Writes down every notice of a manager (:meth:`attach`)."""

    def __init__(self) -> None:
        self.transitions: list[tuple[str, State, State]] = []
        self.starts: list[tuple[str, str, bool]] = []
        self.restarts: list[tuple[str, str]] = []
        self.stops: list[tuple[str, str]] = []
        self.backoffs: list[float | None] = []

    def attach(self, manager: ProcessManager) -> Recorder:
        manager.subscribe(Transition, self.on_transition)
        manager.subscribe(Started, lambda n: self.starts.append((n.name, n.reason, n.ok)))
        manager.subscribe(Restarted, lambda n: self.restarts.append((n.name, n.reason)))
        manager.subscribe(Stopped, lambda n: self.stops.append((n.name, n.reason)))
        return self

    def on_transition(self, news: Transition) -> None:
        self.transitions.append((news.name, news.old, news.new))
        if news.new is State.BACKOFF:
            self.backoffs.append(news.retry_after_s)

    def edges(self, name: str | None = None) -> list[tuple[State, State]]:
        return [(old, new) for n, old, new in self.transitions if name is None or n == name]


def fake_spec(name: str = "m", **overrides: Any) -> BackendSpec:
    """A spawnable spec whose argv carries its address, so the fake prober can tell whose it is."""
    transport = overrides.get("transport", "uds")
    argv = ("server", "--port", "${PORT}") if transport == "tcp" else ("server", "--uds", "${SOCKET}")
    fields: dict[str, Any] = {"argv": argv, "health_interval_s": 10.0, "startup_timeout_s": 30.0, **overrides}
    return BackendSpec(name=name, **fields)


class Harness:
    """A ProcessManager wired to fakes, for tests that want all of them at hand."""

    def __init__(self, runtime_dir: Path, clock: FakeClock | None = None, prober: Any = None,
                 **manager_kw: Any) -> None:
        self.clock = clock or FakeClock()
        self.spawner = FakeSpawner()
        self.prober = prober or FakeProber(self.spawner)
        self.recorder = Recorder()
        self.manager = ProcessManager(
            runtime_dir,
            spawner=self.spawner,
            prober=self.prober,
            clock=self.clock,
            sleep=self.clock.sleep,
            **manager_kw,
        )
        self.recorder.attach(self.manager)

    def add(self, name: str = "m", **overrides: Any) -> Backend:
        return self.manager.add(fake_spec(name, **overrides))

    async def close(self) -> None:
        await self.clock.run(self.manager.shutdown())
