"""Making room: the pure ``victims`` as a table, then ``ProcessManager.make_room`` under fakes.

No polling anywhere: make_room wakes on backend changes; the fake clock only moves deadlines.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from procman_fakes import Harness, settle

from procman import BackendUnavailable, Member, Room, Scope, State, victims

pytestmark = pytest.mark.timeout(30)

ALL = Scope("all models", 2, frozenset("abcd"))
GPU = Scope("group 'gpu0'", 1, frozenset("ab"))


def idle(name: str, last_used: float) -> Member:
    return Member(name, idle=True, last_used=last_used)


def busy(name: str) -> Member:
    return Member(name, idle=False, last_used=0.0)


ALL3 = Scope("all models", 3, frozenset("abcd"))
NO_LIMIT = Scope("all models", 0, frozenset("abc"))
GOING_BUSY, GOING_IDLE = Member("a", False, 0, going=True), Member("a", True, 0, going=True)
TABLE = [
    ("nothing-loaded-fits", "c", [], [ALL], Room((), True)),
    ("under-the-limit-fits", "c", [idle("a", 1)], [ALL], Room((), True)),
    ("full-stops-the-lru-idle", "c", [idle("a", 5), idle("b", 1)], [ALL], Room(("b",), False)),
    ("full-never-stops-the-busy", "c", [busy("a"), idle("b", 9)], [ALL], Room(("b",), False)),
    ("all-busy-waits", "c", [busy("a"), busy("b")], [ALL], Room((), False, ALL)),
    ("a-victim-going-is-waited-for", "c", [GOING_BUSY, busy("b")], [ALL], Room((), False)),
    ("going-counts-until-gone", "c", [GOING_IDLE, idle("b", 1)], [ALL3], Room((), True)),
    ("two-scopes-two-victims", "b", [idle("a", 1), idle("c", 0)], [ALL, GPU], Room(("c", "a"), False)),
    ("group-of-one", "b", [idle("a", 1)], [GPU], Room(("a",), False)),
    ("scope-without-the-target-ignored", "c", [idle("a", 1)], [GPU], Room((), True)),
    ("the-target-never-counts", "a", [idle("a", 1), idle("b", 1)], [GPU], Room(("b",), False)),
    ("zero-is-no-limit", "c", [busy("a"), busy("b")], [NO_LIMIT], Room((), True)),
]


@pytest.mark.parametrize(("target", "loaded", "scopes", "expected"), [t[1:] for t in TABLE], ids=[t[0] for t in TABLE])
def test_victims(target: str, loaded: list[Member], scopes: list[Scope], expected: Room) -> None:
    assert victims(target, loaded, scopes) == expected


# -- make_room, carried out ---------------------------------------------------------------------


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = Harness(tmp_path)
    harness.manager.scopes = lambda name: [Scope("group 'g'", 1, frozenset({"a", "b", "c"}))]
    yield harness
    await harness.close()
    assert harness.spawner.alive() == []


async def test_start_evicts_the_least_recently_used_idle_backend(h: Harness) -> None:
    a, b = h.add("a"), h.add("b")
    async with a.request():
        pass
    await b.ensure_ready()  # a was idle: stopped first
    assert a.state is State.STOPPED and b.state is State.READY and h.recorder.stops == [("a", "evict")]
    assert h.spawner.procs[0].alive is False


async def test_start_waits_for_a_busy_backend_then_evicts_it(h: Harness) -> None:
    a, b = h.add("a"), h.add("b")
    release = asyncio.Event()

    async def long_request() -> None:
        async with a.request():
            await release.wait()

    req = asyncio.ensure_future(long_request())
    await settle()
    waiter = asyncio.ensure_future(b.ensure_ready())
    await h.clock.advance(10.0)
    assert not waiter.done() and a.state is State.READY and b.state is State.STARTING and len(h.spawner.procs) == 1
    release.set()  # a becomes idle: that change alone wakes the waiting start
    await req
    await waiter
    assert a.state is State.STOPPED and b.state is State.READY


async def test_start_gives_up_when_busy_backends_stay_busy(h: Harness) -> None:
    a, b = h.add("a"), h.add("b", startup_timeout_s=30.0)
    release = asyncio.Event()

    async def long_request() -> None:
        async with a.request():
            await release.wait()

    req = asyncio.ensure_future(long_request())
    await settle()
    waiter = asyncio.ensure_future(b.ensure_ready())
    await h.clock.advance(31.0)
    with pytest.raises(BackendUnavailable, match=r"group 'g' allows 1 loaded model\(s\) and all are busy \(a\)") as e:
        await waiter
    assert e.value.retry_after_s == 5.0 and b.state is State.STOPPED and len(h.spawner.procs) == 1
    release.set()
    await req


async def test_concurrent_starts_never_exceed_the_limit(h: Harness) -> None:
    backends = [h.add(name) for name in "abc"]
    results = await asyncio.gather(*(b.ensure_ready() for b in backends), return_exceptions=True)
    await settle()
    assert sum(1 for b in backends if b.state is State.READY) == 1
    assert len(h.spawner.alive()) == 1
    assert all(not isinstance(r, BaseException) or isinstance(r, BackendUnavailable) for r in results)


async def test_a_restart_keeps_its_room(h: Harness) -> None:
    a = h.add("a")
    await a.ensure_ready()
    calls: list[str] = []

    async def counting(backend: object) -> None:
        calls.append("room")

    h.manager.add_before_start(counting)
    await a.restart("manual")
    assert a.state is State.READY and calls == []  # the replacement never asked for room
