"""``Backend.replace``: procman's one owner of a name replaces its process, rolling where room allows.

Under the fake spawner and clock: the pure decisions as tables, then the backend's replacement —
a switch under a request in flight, a new process that fails, no room, the old process dying
during the overlap, and a remove or shutdown in the middle.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from procman_fakes import FakeProcess, FakeSpawner, Harness, fake_spec, settle

from procman import Backend, Rolled, State, deaths
from procman import rolling as r
from procman.deaths import Death
from procman.nodes import Node
from procman.placement import Claim
from procman.spawner import Where

pytestmark = pytest.mark.timeout(30)

M = 1024 * 1024
SIZES = {"a": 300, "b": 300, "c": 300}
NEW_SPEC = {"env": {"V": "2"}}


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = Harness(tmp_path)
    harness.manager.claims = lambda name: Claim("CPU", SIZES.get(name, 0) * M)
    harness.manager.budgets = lambda: {"CPU": 1024 * M}
    yield harness
    await harness.close()
    assert harness.spawner.alive() == []


def rolled(h: Harness) -> list[Rolled]:
    heard: list[Rolled] = []
    h.manager.subscribe(Rolled, heard.append)
    return heard


def used(h: Harness) -> int:
    return h.manager.memory()["CPU"]["used_bytes"] // M


class Held:
    """A request held open on a backend until ``release()``."""

    def __init__(self, backend: Backend) -> None:
        self.lease: Any = None
        self._go = asyncio.Event()
        self._in = asyncio.Event()
        self.task = asyncio.ensure_future(self._hold(backend))

    async def _hold(self, backend: Backend) -> None:
        async with backend.request() as lease:
            self.lease = lease
            self._in.set()
            await self._go.wait()

    async def admitted(self) -> Held:
        await self._in.wait()
        return self

    async def release(self) -> None:
        self._go.set()
        await self.task


def unhealthy_next(h: Harness) -> None:
    """The next spawned process does not answer its health path until told."""
    def script(proc: FakeProcess) -> None:
        proc.healthy = False
    h.spawner.on_spawn = script


# -- the decisions, as tables --------------------------------------------------------------------

CHOOSE = [
    ("busy-waits", (True, True, False, True, True), "wait"),
    ("rolling-serving-fits-rolls", (True, True, False, False, True), "roll"),
    ("no-room-is-stop-first", (True, True, False, False, False), "stop-first"),
    ("not-asked-is-stop-first", (False, True, False, False, True), "stop-first"),
    ("not-serving-is-stop-first", (True, False, False, False, True), "stop-first"),
    ("remote-is-stop-first", (True, True, True, False, True), "stop-first"),
]


@pytest.mark.parametrize(("args", "expected"), [c[1:] for c in CHOOSE], ids=[c[0] for c in CHOOSE])
def test_choose(args: tuple[bool, bool, bool, bool, bool], expected: str) -> None:
    rolling, serving, remote, busy, fits = args
    assert r.choose(rolling, serving, remote, busy, lambda: fits) == expected


LANDED = [
    ("up-and-serving-switches", ("ok", False, True), "switch"),
    ("failed-keeps-the-old", ("failed", False, True), "fail"),
    ("aborted-keeps-the-old", ("aborted", False, True), "fail"),
    ("current-left-drops", ("ok", False, False), "drop"),
    ("given-up-drops", ("ok", True, True), "drop"),
    ("given-up-and-failed-drops", ("failed", True, False), "drop"),
]


@pytest.mark.parametrize(("args", "expected"), [c[1:] for c in LANDED], ids=[c[0] for c in LANDED])
def test_landed(args: tuple[Any, bool, bool], expected: str) -> None:
    assert r.landed(*args) == expected


# -- the backend -----------------------------------------------------------------------------------


async def test_a_rolling_change_switches_new_requests_while_the_old_one_finishes_its_own(h: Harness) -> None:
    heard = rolled(h)
    a = h.add("a")
    held = await Held(a).admitted()
    old_proc, old_gen = h.spawner.last, a.generation
    unhealthy_next(h)
    change = asyncio.ensure_future(a.replace(fake_spec("a", **NEW_SPEC), rolling=True))
    await h.clock.advance(1.0)
    assert len(h.spawner.alive()) == 2 and used(h) == 600  # both processes count while both live
    assert a.pid == old_proc.pid and not change.done()  # the old one serves until the new one is READY
    h.spawner.last.healthy = True
    await h.clock.run(change)
    new_proc = h.spawner.last
    assert a.pid == new_proc.pid and a.spec.env["V"] == "2" and a.state is State.READY
    assert [n.phase for n in heard] == ["starting", "switched"] and heard[-1].old_pid == old_proc.pid
    fresh = await Held(a).admitted()  # a new request goes to the new process
    assert fresh.lease.generation == old_gen + 1 and fresh.lease.pid == new_proc.pid
    assert a.in_flight == 1 and a.in_flight_of(old_gen) == 1 and old_proc.alive  # the old one still serves its own
    await held.release()  # ...and its end counts against the old process, which then stops
    await settle()
    assert not old_proc.alive and new_proc.alive and a.in_flight == 1 and used(h) == 300
    await fresh.release()
    assert a.in_flight == 0 and a.failures == 0 and len(h.spawner.procs) == 2


async def test_a_request_ending_as_the_new_process_is_found_ready_counts_against_the_old_one(h: Harness) -> None:
    # The request's end reaches the owner's queue just behind the news that the new process is READY: the
    # owner switches first (the old process retires holding that request), then takes the end, which must
    # count against the old process — not the new one, leaving the old one draining until drain_timeout_s.
    a = h.add("a", drain_timeout_s=300.0)
    held = await Held(a).admitted()
    old_proc, old_gen = h.spawner.last, a.generation
    post = a._post

    def ending_with_the_start(event: Any, want_reply: bool = False) -> Any:
        if isinstance(event, r.NextStarted):
            held._go.set()  # the request's end runs before the owner takes the news, and finds it busy
        return post(event, want_reply)

    a._post = ending_with_the_start  # type: ignore[method-assign]
    await h.clock.run(a.replace(fake_spec("a", drain_timeout_s=300.0, **NEW_SPEC), rolling=True))
    await held.task
    await settle()
    assert a.in_flight_of(old_gen) == 0 and not old_proc.alive  # drained and stopped, no drain timeout
    assert a.in_flight == 0 and a.state is State.READY and a.generation == old_gen + 1 and used(h) == 300


async def test_a_rolling_restart_of_the_same_spec_is_told_as_a_restart(h: Harness) -> None:
    a = h.add("a")
    await a.ensure_ready()
    await h.clock.run(a.replace(rolling=True))
    assert a.restarts == 1 and h.recorder.restarts == [("a", "manual")]
    assert h.recorder.starts[-1] == ("a", "manual", True) and len(h.spawner.alive()) == 1


async def test_a_new_process_that_fails_leaves_the_old_one_serving(h: Harness) -> None:
    heard = rolled(h)
    a = h.add("a")
    await a.ensure_ready()
    pid = a.pid

    def broken(proc: FakeProcess) -> None:
        proc.say("the new weights are corrupt")
        proc.exit(1)

    h.spawner.on_spawn = broken
    await h.clock.run(a.replace(fake_spec("a", **NEW_SPEC), rolling=True))
    assert a.pid == pid and a.state is State.READY and "V" not in a.spec.env
    assert [n.phase for n in heard] == ["starting", "failed"] and "corrupt" in (heard[-1].error or "")
    assert "old one keeps serving" in (a.last_error or "") and used(h) == 300
    assert h.recorder.starts[-1] == ("a", "reload", False) and a.failures == 0
    async with a.request() as lease:
        assert lease.pid == pid


async def test_a_new_process_stopped_by_a_signal_as_it_starts_is_killed_and_the_old_one_keeps_serving(
        h: Harness) -> None:
    heard = rolled(h)
    a = h.add("a", startup_timeout_s=120.0)
    await a.ensure_ready()
    pid = a.pid

    def stopped(proc: FakeProcess) -> None:
        proc.sigstopped, proc.healthy = True, False  # SIGSTOP: state T, its probes go unanswered

    h.spawner.on_spawn = stopped
    await h.clock.run(a.replace(fake_spec("a", **NEW_SPEC), rolling=True))
    assert h.spawner.last.signals == [signal.SIGKILL] and not h.spawner.last.alive
    assert a.pid == pid and a.state is State.READY and a.failures == 0
    assert [n.phase for n in heard] == ["starting", "failed"] and "found stopped" in (heard[-1].error or "")


async def test_without_room_for_both_the_change_is_stop_first(h: Harness) -> None:
    heard = rolled(h)
    a, b, c = h.add("a"), h.add("b"), h.add("c")
    for backend in (a, b, c):
        await backend.ensure_ready()
    old = h.spawner.procs[0]
    assert not h.manager.can_roll("a", [])
    await h.clock.run(a.replace(fake_spec("a", **NEW_SPEC), rolling=True))
    assert heard == [] and not old.alive and a.spec.env["V"] == "2" and a.state is State.READY
    assert h.recorder.edges("a")[-3:] == [(State.READY, State.STOPPING), (State.STOPPING, State.STARTING),
                                         (State.STARTING, State.READY)]
    assert used(h) == 900 and b.state is State.READY and c.state is State.READY  # nobody was evicted


async def test_the_old_process_dying_while_it_drains_is_reaped_not_relaunched(h: Harness) -> None:
    a = h.add("a")
    held = await Held(a).admitted()
    old_proc, old_gen = h.spawner.last, a.generation
    await h.clock.run(a.replace(fake_spec("a", **NEW_SPEC), rolling=True))
    old_proc.exit(1)  # the request it serves crashed it
    await h.clock.advance(1.0)
    death = a.death(old_gen)
    assert death is not None and death.cause == "crash" and death.in_flight == 1 and death.blamed
    assert a.state is State.READY and a.failures == 0 and len(h.spawner.procs) == 2 and used(h) == 300
    await held.release()  # the request of the dead process still ends cleanly
    assert a.in_flight == 0


async def test_the_old_process_dying_while_the_new_one_starts_gives_the_roll_up_and_keeps_the_change(
        h: Harness) -> None:
    heard = rolled(h)
    a = h.add("a")
    await a.ensure_ready()
    old_proc = h.spawner.last
    unhealthy_next(h)
    change = asyncio.ensure_future(a.replace(fake_spec("a", **NEW_SPEC), rolling=True))
    await h.clock.advance(1.0)
    h.spawner.on_spawn = None
    old_proc.exit(1)
    await h.clock.run(change)
    await h.clock.run(a.ensure_ready())
    assert [n.phase for n in heard] == ["starting", "interrupted"]
    assert a.spec.env["V"] == "2" and a.state is State.READY and len(h.spawner.alive()) == 1
    assert h.spawner.alive()[0].env.get("V") == "2" and used(h) == 300


async def test_a_request_that_saw_the_old_process_hang_kills_it_at_once(h: Harness) -> None:
    a = h.add("a", drain_timeout_s=300.0)
    held = await Held(a).admitted()
    old_proc, old_gen = h.spawner.last, a.generation
    await h.clock.run(a.replace(fake_spec("a", drain_timeout_s=300.0, **NEW_SPEC), rolling=True))
    old_proc.ignore_term = True
    await a.restart("hang", generation=old_gen)  # the new process is not touched
    await h.clock.advance(1.0)
    assert not old_proc.alive and old_proc.signals[-1] == 9 and a.state is State.READY and a.generation == old_gen + 1
    await held.release()


async def test_an_old_process_stopped_from_outside_while_it_drains_is_not_blamed_on_its_request(h: Harness) -> None:
    """A retiree found hung while SIGSTOPped is judged as the current process would be: silenced from outside,
    so the one request it drained is innocent (before, the retiree's death was blamed on it)."""
    a = h.add("a", drain_timeout_s=300.0)
    held = await Held(a).admitted()
    old_proc, old_gen = h.spawner.last, a.generation
    await h.clock.run(a.replace(fake_spec("a", drain_timeout_s=300.0, **NEW_SPEC), rolling=True))
    old_proc.sigstopped, old_proc.healthy = True, False  # SIGSTOP: state T, its probes go unanswered
    await h.clock.advance(120.0)
    death = a.death(old_gen)
    assert not old_proc.alive and old_proc.signals[-1] == signal.SIGKILL
    assert death == Death("hang", -signal.SIGSTOP, 1) and deaths.external(death) and not death.blamed
    assert a.state is State.READY and a.failures == 0
    await held.release()


async def test_a_request_of_an_old_process_killed_as_hung_ends_without_uncounting_the_new_ones(h: Harness) -> None:
    a = h.add("a", drain_timeout_s=300.0)
    held = await Held(a).admitted()
    old_gen = a.generation
    await h.clock.run(a.replace(fake_spec("a", drain_timeout_s=300.0, **NEW_SPEC), rolling=True))
    fresh = await Held(a).admitted()  # on the new process
    await a.restart("hang", generation=old_gen)  # the old one is killed while its request still holds it
    await h.clock.advance(1.0)
    await settle()
    await held.release()  # its end is the gone process's: the new process still counts its own request
    assert a.in_flight == 1 and not a.is_idle()
    await fresh.release()
    assert a.in_flight == 0 and a.is_idle()


async def test_remove_during_a_rolling_start_leaves_no_process(h: Harness) -> None:
    a = h.add("a")
    await a.ensure_ready()
    unhealthy_next(h)
    change = asyncio.ensure_future(a.replace(fake_spec("a", **NEW_SPEC), rolling=True))
    await h.clock.advance(1.0)
    assert len(h.spawner.alive()) == 2
    await h.clock.run(h.manager.remove("a"))
    await h.clock.run(change)
    assert h.spawner.alive() == [] and used(h) == 0


async def test_shutdown_while_the_old_process_drains_leaves_no_process(h: Harness) -> None:
    a = h.add("a", drain_timeout_s=300.0)
    held = await Held(a).admitted()
    await h.clock.run(a.replace(fake_spec("a", drain_timeout_s=300.0, **NEW_SPEC), rolling=True))
    assert len(h.spawner.alive()) == 2
    await h.clock.run(h.manager.shutdown())
    assert h.spawner.alive() == []
    await held.release()


async def test_a_second_change_during_a_rolling_one_follows_it(h: Harness) -> None:
    a = h.add("a")
    await a.ensure_ready()
    unhealthy_next(h)
    first = asyncio.ensure_future(a.replace(fake_spec("a", env={"V": "2"}), rolling=True))
    await h.clock.advance(1.0)
    h.spawner.on_spawn = None
    second = asyncio.ensure_future(a.replace(fake_spec("a", env={"V": "3"}), rolling=True))
    await settle()
    h.spawner.last.healthy = True
    await h.clock.run(asyncio.gather(first, second))
    assert a.spec.env["V"] == "3" and a.state is State.READY and len(h.spawner.alive()) == 1
    assert h.spawner.alive()[0].env["V"] == "3"


class NodeSpawner(FakeSpawner):
    """A fake engine with nodes: remembers where each process was placed."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[str] = []

    async def spawn(self, argv: Any, env: Any, cwd: Any, on_line: Any, where: Where | None = None) -> FakeProcess:
        self.nodes.append(where.node if where is not None else "")
        return await super().spawn(argv, env, cwd, on_line)


async def test_on_a_cluster_the_new_process_takes_the_name_and_its_node(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = [Node("n1", "one", "127.0.0.1"), Node("n2", "two", "127.0.0.1")]

    async def cluster() -> list[Node]:
        return nodes

    h = Harness(tmp_path, cluster=cluster)
    spawner = h.manager._runtime.spawner = NodeSpawner()
    h.prober.spawner = spawner
    try:
        a = h.add("a", transport="tcp")
        held = await Held(a).admitted()
        first = h.manager.node_of(a)
        await h.clock.run(a.replace(fake_spec("a", transport="tcp", **NEW_SPEC), rolling=True))
        assert len(spawner.nodes) == 2 and h.manager.node_of(a) is not None
        assert h.manager.node_of(a).id == spawner.nodes[-1] and first is not None  # type: ignore[union-attr]
        assert sorted(h.manager._placed) == sorted(["a", r.old_key("a", spawner.procs[0].pid)])
        await held.release()
        await settle()
        assert list(h.manager._placed) == ["a"] and len(spawner.alive()) == 1  # the old one's room is gone
        asked: list[int] = []
        monkeypatch.setattr(a, "seats", lambda: asked.append(1) or [])
        for _ in range(3):
            async with a.request():
                pass
        assert asked == [] and h.manager._seated == {}  # no replacement: a request's admit and done scan nothing
    finally:
        await h.close()
    assert spawner.alive() == []
