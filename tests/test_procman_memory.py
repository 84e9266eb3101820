"""ProcessManager.make_room with memory budgets (rolling replacements: test_procman_rolling.py), under fakes.

No real process and no sleep: the fake clock moves deadlines and min_residency_s.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from procman_fakes import Harness, settle

from procman import BackendUnavailable, State
from procman.placement import Claim
from procman.room import Scope

pytestmark = pytest.mark.timeout(30)

M = 1024 * 1024
SIZES = {"a": 300, "b": 300, "c": 300, "d": 300, "big": 1200, "p": 300}


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = Harness(tmp_path)
    harness.manager.claims = lambda name: Claim("CPU", SIZES.get(name.split()[0], 0) * M, pinned=name == "p",
                                                min_residency_s=5.0 if name == "c" else 0.0)
    harness.manager.budgets = lambda: {"CPU": 1024 * M}
    yield harness
    await harness.close()
    assert harness.spawner.alive() == []


async def use(backend: object) -> None:
    async with backend.request():  # type: ignore[attr-defined]
        pass


async def test_a_start_over_budget_evicts_the_lru_idle_backend(h: Harness) -> None:
    a, b, c, d = (h.add(n) for n in "abcd")
    for backend in (a, b, c):
        await use(backend)
    await h.clock.advance(6.0)  # c is old enough to go
    await use(a)  # b is now the least recently used
    await d.ensure_ready()
    assert [s for s in h.recorder.stops if s[1] == "evict"] == [("b", "evict")]
    assert {x.name for x in (a, b, c, d) if x.state is State.READY} == {"a", "c", "d"}
    assert h.manager.memory() == {"CPU": {"budget_bytes": 1024 * M, "used_bytes": 900 * M}}


async def test_a_young_backend_is_waited_for_not_evicted(h: Harness) -> None:
    a, b, c, d = (h.add(n) for n in "abcd")
    release = asyncio.Event()

    async def hold(backend: object) -> None:
        async with backend.request():  # type: ignore[attr-defined]
            await release.wait()

    busy = [asyncio.ensure_future(hold(x)) for x in (a, b)]
    await settle()
    await use(c)  # idle, but loaded less than its min_residency_s (5 s) ago
    waiter = asyncio.ensure_future(d.ensure_ready())
    await settle()
    assert not waiter.done() and c.state is State.READY
    assert h.manager.room_waits() == {"d": "waiting for memory: needs 300 MiB, 900 MiB of 1 GiB CPU in use by "
                                           "a (busy), b (busy), c (idle); the idle ones are within min_residency_s"}
    await h.clock.advance(5.0)  # c's residency ends: that moment wakes the start
    await waiter
    assert c.state is State.STOPPED and d.state is State.READY and h.manager.room_waits() == {}
    release.set()
    await asyncio.gather(*busy)


async def test_a_backend_that_can_never_fit_is_refused_at_once(h: Harness) -> None:
    p, big = h.add("p"), h.add("big")
    await p.ensure_ready()
    with pytest.raises(BackendUnavailable, match=r"big needs 1.2 GiB.*more than memory_budget CPU: 1 GiB"):
        await big.ensure_ready()
    assert big.state is State.STOPPED and p.state is State.READY


async def test_one_start_per_device_at_a_time(h: Harness) -> None:
    a, b = h.add("a"), h.add("b")
    h.spawner.on_spawn = lambda proc: setattr(proc, "healthy", False)  # a loads (compiles) for a while
    first = asyncio.ensure_future(a.ensure_ready())
    await settle()
    second = asyncio.ensure_future(b.ensure_ready())
    await settle()
    assert len(h.spawner.procs) == 1 and b.state is State.STARTING  # b waits for a's start to end
    h.spawner.on_spawn = None
    h.spawner.procs[0].healthy = True
    await h.clock.advance(2.0)
    await asyncio.gather(first, second)
    assert len(h.spawner.procs) == 2 and a.state is State.READY and b.state is State.READY


async def test_no_rolling_when_the_budget_cannot_hold_both(h: Harness) -> None:
    a, b, c = (h.add(n) for n in "abc")
    for backend in (a, b, c):
        await use(backend)
    assert not h.manager.can_roll("a", [])


async def test_a_start_waiting_for_a_slot_says_which_limit_and_who_holds_it(h: Harness) -> None:
    h.manager.budgets = lambda: {}
    h.manager.scopes = lambda name: (Scope("all models", 1, frozenset("ab")),)
    a, b = h.add("a"), h.add("b")
    release = asyncio.Event()

    async def hold() -> None:
        async with a.request():
            await release.wait()

    busy = asyncio.ensure_future(hold())
    await settle()
    waiter = asyncio.ensure_future(b.ensure_ready())
    await settle()
    assert h.manager.room_waits() == {"b": "waiting for a slot: all models allows 1 loaded model(s), held by a"}
    release.set()
    await asyncio.gather(busy, waiter)
    assert b.state is State.READY and h.manager.room_waits() == {}
