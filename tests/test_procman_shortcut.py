"""The request path's shortcut (``Backend._shortcut``) holds by construction: a differential test.

Random, seeded sequences of what happens to a backend — requests that come and go, ensure_ready,
stops, restarts (manual and fatal), keep-alive, forgiveness, reloads, retunes and replacements
(rolling or stop-first), the process
exiting, its health failing and coming back, time passing — are played against two backends under
the fake spawner, prober and clock, one with the shortcut and one without. After every step both
must show the same state, counters, processes (spawned, alive, signalled), answers to every caller,
listener calls, and manager notifications (``Runtime.changed``).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from procman_fakes import FakeClock, Harness

from procman import Backend, BackendSpec, Lease, RestartPolicy

pytestmark = pytest.mark.timeout(120)

SEQUENCES = 200
STEPS = 50
OPS = (  # (name, weight)
    ("want", 24), ("done", 20), ("ensure", 4), ("tick", 22), ("exit", 4), ("sick", 3), ("well", 4),
    ("stop", 3), ("restart", 2), ("fatal", 2), ("keep", 3), ("forgive", 2), ("update", 2), ("retune", 2),
    ("roll", 2),
)
NAMES = [name for name, _ in OPS]
WEIGHTS = [weight for _, weight in OPS]


@dataclass
class Side:
    """One backend under its own fakes, and everything a caller, a listener or the manager saw of it."""

    harness: Harness
    backend: Backend
    root: Path
    calls: list[asyncio.Future[Any]] = field(default_factory=list)  # every caller's task, in order
    held: list[tuple[Any, asyncio.Task[Any]]] = field(default_factory=list)  # (request context, its entry)
    changes: list[tuple[str, int]] = field(default_factory=list)  # Runtime.changed: (state, in flight)

    def answer(self, task: asyncio.Future[Any]) -> object:
        if not task.done():
            return "pending"
        if task.cancelled():
            return "cancelled"
        if (error := task.exception()) is not None:
            return (type(error).__name__, str(error).replace(str(self.root), "<dir>"))
        result = task.result()
        if isinstance(result, Lease):
            return ("lease", result.pid, result.generation)
        return ("ok", None if result is None else str(result).replace(str(self.root), "<dir>"))

    def seen(self) -> object:
        b, h = self.backend, self.harness
        procs = [(p.pid, p.alive, p.returncode, tuple(p.signals), p.healthy) for p in h.spawner.procs]
        recorder = h.recorder
        return {
            "state": b.state, "counters": b.counters, "pid": b.pid, "failures": b.failures,
            "retry_after_s": b.retry_after_s, "last_error": (b.last_error or "").replace(str(self.root), "<dir>"),
            "used": b.last_used is not None, "spec": b.spec, "procs": procs,
            "answers": [self.answer(t) for t in self.calls],
            "listener": (recorder.transitions, recorder.starts, recorder.restarts, recorder.stops, recorder.backoffs),
            "changes": self.changes, "now": h.clock.now,
        }


async def settle() -> None:
    """Let every runnable task run until none is left (procman_fakes.settle's fixed 50 rounds, made quick:
    this test takes some 20,000 steps)."""
    loop = asyncio.get_running_loop()
    quiet = 0
    while quiet < 2:
        await asyncio.sleep(0)
        quiet = quiet + 1 if not loop._ready else 0  # type: ignore[attr-defined]


class QuickClock(FakeClock):
    """procman_fakes.FakeClock, settling by quiescence rather than by a fixed number of rounds."""

    async def settle(self) -> None:
        await settle()


def spec(version: int = 0, idle_timeout_s: float = 30.0) -> BackendSpec:
    return BackendSpec(
        name="m", argv=("server", "--uds", "${SOCKET}"), env={"V": str(version)}, health_interval_s=5.0,
        health_failures=2, startup_timeout_s=20.0, idle_timeout_s=idle_timeout_s, drain_timeout_s=15.0,
        stop_timeout_s=3.0, policy=RestartPolicy(backoff_base_s=1.0, backoff_max_s=4.0, max_retries=3),
    )


def side(root: Path, fast: bool) -> Side:
    harness = Harness(root, clock=QuickClock())
    backend = harness.manager.add(spec())
    backend._fast = fast
    one = Side(harness, backend, root)
    on_change = backend._rt.on_change
    assert on_change is not None

    def changed(b: Backend) -> None:
        one.changes.append((b.state.name, b.in_flight))
        on_change(b)

    backend._rt.on_change = changed
    return one


def play(one: Side, op: str, arg: float) -> None:
    """Do ``op`` to one side; whatever a caller awaits runs as a task of its own (in order, like a client)."""
    b, h = one.backend, one.harness
    loop = asyncio.get_running_loop()
    if op == "want":
        ctx = b.request()
        entry = loop.create_task(ctx.__aenter__())
        one.calls.append(entry)
        one.held.append((ctx, entry))
    elif op == "done":
        admitted = [(ctx, entry) for ctx, entry in one.held if entry.done() and not entry.exception()]
        if admitted:
            ctx, entry = admitted[int(arg * len(admitted)) % len(admitted)]
            one.held.remove((ctx, entry))
            one.calls.append(loop.create_task(ctx.__aexit__(None, None, None)))
    elif op == "ensure":
        one.calls.append(loop.create_task(b.ensure_ready()))
    elif op in ("exit", "sick", "well"):
        live = h.spawner.alive()
        if live:
            proc = live[-1]
            if op == "exit":
                proc.exit(1 if arg < 0.5 else -9)
            else:
                proc.healthy = op == "well"
    elif op == "stop":
        one.calls.append(loop.create_task(b.stop("unload", drain=arg < 0.5)))
    elif op == "restart":
        one.calls.append(b.restart("manual"))
    elif op == "fatal":
        one.calls.append(b.restart("fatal", generation=b.generation))
    elif op == "keep":
        b.keep_alive((0.0, float("inf"), None, 50.0)[int(arg * 4)])
    elif op == "forgive":
        b.forgive([b.generation])
    elif op == "update":
        one.calls.append(loop.create_task(b.update(spec(version=int(arg * 3)))))
    elif op == "roll":  # a rolling replacement: the new process beside the old one, then the switch
        one.calls.append(loop.create_task(b.replace(spec(version=int(arg * 3)), rolling=arg < 0.7)))
    elif op == "retune":
        one.calls.append(loop.create_task(b.update(spec(version=int(b.spec.env["V"]), idle_timeout_s=arg * 60))))


async def tick(sides: list[Side], seconds: float) -> None:
    for one in sides:
        await one.harness.clock.advance(seconds)


async def run_sequence(root: Path, seed: int) -> None:
    rng = random.Random(seed)
    fast, slow = side(root / "fast", True), side(root / "slow", False)
    sides = [fast, slow]
    try:
        for step in range(STEPS):
            op, arg = rng.choices(NAMES, WEIGHTS)[0], rng.random()
            if op == "tick":
                await tick(sides, (0.05, 0.5, 2.0, 6.0, 20.0)[int(arg * 5)])
            else:
                for one in sides:
                    play(one, op, arg)
                await settle()
            assert fast.seen() == slow.seen(), f"seed {seed}, step {step} ({op}): the paths differ"
    finally:
        for one in sides:
            for _, entry in one.held:
                entry.cancel()
            await one.harness.clock.run(one.harness.manager.shutdown())
            for task in one.calls:
                task.cancel()
        await settle()


async def test_the_shortcut_and_the_owner_path_agree_on_random_sequences(tmp_path: Path) -> None:
    for seed in range(SEQUENCES):
        await run_sequence(tmp_path / str(seed), seed)


async def test_the_shortcut_is_taken(tmp_path: Path) -> None:
    """The differential test compares something: with the shortcut on, admits and dones take it."""
    one = side(tmp_path, True)
    taken: list[str] = []
    shortcut = one.backend._shortcut

    def spy(event: Any) -> bool:
        took = shortcut(event)
        if took:
            taken.append(type(event).__name__)
        return took

    one.backend._shortcut = spy  # type: ignore[method-assign]
    try:
        await one.backend.ensure_ready()
        async with one.backend.request(), one.backend.request():
            pass
        assert taken == ["Want", "Want", "Done"]  # the last done arms the idle timer: the owner's way
    finally:
        await one.harness.clock.run(one.harness.manager.shutdown())
