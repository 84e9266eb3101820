"""Every allowed transition, driven through the real Backend with a fake spawner and clock; every forbidden one refused.

One test per edge, named after it: each makes the backend take that edge the way it happens
in production and checks that the listener saw it.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from procman_fakes import FakeClock, FakeProber, FakeSpawner, Recorder, fake_spec, settle

from procman import (
    ALLOWED,
    BackendUnavailable,
    InvalidTransition,
    ProcessManager,
    RestartPolicy,
    StartInterrupted,
    State,
)

S = State


pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def spawner() -> FakeSpawner:
    return FakeSpawner()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
async def manager(
    tmp_path: Path, clock: FakeClock, spawner: FakeSpawner, recorder: Recorder
) -> AsyncIterator[ProcessManager]:
    pm = ProcessManager(tmp_path, spawner=spawner, prober=FakeProber(spawner), clock=clock, sleep=clock.sleep)
    recorder.attach(pm)
    yield pm
    await clock.run(pm.shutdown())


def test_table_has_every_state_and_no_self_loops() -> None:
    assert set(ALLOWED) == set(State)
    for state, targets in ALLOWED.items():
        assert state not in targets
        assert targets <= set(State)


async def test_stopped_to_starting_on_cold_start(
    manager: ProcessManager, recorder: Recorder, spawner: FakeSpawner
) -> None:
    backend = manager.add(fake_spec())
    assert backend.state is S.STOPPED and spawner.procs == []
    await backend.ensure_ready()
    assert (S.STOPPED, S.STARTING) in recorder.edges()
    assert len(spawner.procs) == 1


async def test_starting_to_ready_when_health_answers_200(
    manager: ProcessManager, clock: FakeClock, spawner: FakeSpawner, recorder: Recorder
) -> None:
    spawner.on_spawn = lambda proc: setattr(proc, "healthy", False)
    backend = manager.add(fake_spec())
    task = asyncio.ensure_future(backend.ensure_ready())
    await clock.advance(1.0)
    assert backend.state is S.STARTING
    spawner.last.healthy = True
    await clock.advance(1.0)
    address = await task
    assert backend.state is S.READY and address == backend.address
    assert recorder.edges()[-1] == (S.STARTING, S.READY)
    assert backend.generation == 1


async def test_starting_to_backoff_when_process_exits_while_starting(
    manager: ProcessManager, spawner: FakeSpawner, recorder: Recorder
) -> None:
    spawner.on_spawn = lambda proc: proc.exit(1)
    backend = manager.add(fake_spec())
    with pytest.raises(BackendUnavailable):
        await backend.ensure_ready()
    assert recorder.edges() == [(S.STOPPED, S.STARTING), (S.STARTING, S.BACKOFF)]
    assert backend.state is S.BACKOFF


async def test_starting_to_stopping_when_stop_interrupts_a_start(
    manager: ProcessManager, clock: FakeClock, spawner: FakeSpawner, recorder: Recorder
) -> None:
    spawner.on_spawn = lambda proc: setattr(proc, "healthy", False)
    backend = manager.add(fake_spec())
    waiter = asyncio.ensure_future(backend.ensure_ready())
    await clock.advance(1.0)
    assert backend.state is S.STARTING
    await clock.run(backend.stop("unload"))
    with pytest.raises(StartInterrupted):
        await waiter
    assert (S.STARTING, S.STOPPING) in recorder.edges()
    assert backend.state is S.STOPPED
    assert signal.SIGTERM in spawner.last.signals and not spawner.last.alive
    assert backend.failures == 0  # an interrupted start is no failure


async def test_ready_to_stopping_on_stop(manager: ProcessManager, recorder: Recorder, spawner: FakeSpawner) -> None:
    backend = manager.add(fake_spec())
    await backend.ensure_ready()
    await backend.stop("unload")
    assert (S.READY, S.STOPPING) in recorder.edges()
    assert spawner.last.signals[0] == signal.SIGTERM


async def test_ready_to_backoff_when_the_process_crashes(
    manager: ProcessManager, spawner: FakeSpawner, recorder: Recorder
) -> None:
    backend = manager.add(fake_spec())
    await backend.ensure_ready()
    spawner.last.exit(-11)
    await settle()
    assert (S.READY, S.BACKOFF) in recorder.edges()
    assert backend.failures == 1
    assert "code -11" in (backend.last_error or "")


async def test_stopping_to_stopped_once_the_group_is_reaped(
    manager: ProcessManager, recorder: Recorder, spawner: FakeSpawner
) -> None:
    backend = manager.add(fake_spec())
    await backend.ensure_ready()
    proc = spawner.last
    await backend.stop()
    assert recorder.edges()[-1] == (S.STOPPING, S.STOPPED)
    assert not proc.alive and proc.signals == [signal.SIGTERM, signal.SIGKILL]  # SIGKILL: leftovers in the group
    assert backend.pid is None and backend.address is None and backend.exit_code == -signal.SIGTERM


async def test_stopping_to_starting_on_manual_restart(
    manager: ProcessManager, recorder: Recorder, spawner: FakeSpawner
) -> None:
    backend = manager.add(fake_spec())
    await backend.ensure_ready()
    first = spawner.last
    await backend.restart("manual")
    assert recorder.edges()[-3:] == [(S.READY, S.STOPPING), (S.STOPPING, S.STARTING), (S.STARTING, S.READY)]
    assert not first.alive and spawner.last is not first
    assert backend.failures == 0 and backend.restarts == 1


async def test_stopping_to_backoff_when_a_hung_process_is_killed(
    manager: ProcessManager, clock: FakeClock, recorder: Recorder, spawner: FakeSpawner
) -> None:
    backend = manager.add(fake_spec(health_interval_s=1.0, health_failures=2))
    await backend.ensure_ready()
    spawner.last.healthy = False
    await clock.advance(2.5)
    assert (S.STOPPING, S.BACKOFF) in recorder.edges()
    assert recorder.restarts == [("m", "hang")]


async def test_backoff_to_starting_when_the_delay_is_over(
    manager: ProcessManager, clock: FakeClock, recorder: Recorder, spawner: FakeSpawner
) -> None:
    spawner.on_spawn = lambda proc: proc.exit(1)
    backend = manager.add(fake_spec())
    for _ in range(2):
        with pytest.raises(BackendUnavailable):
            await backend.ensure_ready()
    assert backend.retry_after_s == pytest.approx(1.0)
    await clock.advance(1.0)
    spawner.on_spawn = None
    await backend.ensure_ready()
    assert recorder.edges()[-2:] == [(S.BACKOFF, S.STARTING), (S.STARTING, S.READY)]


async def test_backoff_to_stopped_when_stopped_while_waiting(
    manager: ProcessManager, clock: FakeClock, recorder: Recorder, spawner: FakeSpawner
) -> None:
    backend = manager.add(fake_spec(policy=RestartPolicy(backoff_base_s=5.0)))
    await backend.ensure_ready()
    spawner.on_spawn = lambda proc: proc.exit(1)
    spawner.last.exit(1)  # crash; the immediate relaunch fails too -> a relaunch is pending in 5 s
    await settle()
    assert backend.state is S.BACKOFF and backend.retry_after_s == pytest.approx(5.0)
    await backend.stop("unload")
    assert recorder.edges()[-1] == (S.BACKOFF, S.STOPPED)
    spawned = len(spawner.procs)
    await clock.advance(60.0)
    assert backend.state is S.STOPPED and len(spawner.procs) == spawned  # the pending relaunch was cancelled


FORBIDDEN = [(old, new) for old in State for new in State if new not in ALLOWED[old]]


@pytest.mark.parametrize(("old", "new"), FORBIDDEN, ids=[f"{a.name}->{b.name}" for a, b in FORBIDDEN])
async def test_forbidden_transition_raises(manager: ProcessManager, recorder: Recorder, old: State, new: State) -> None:
    backend = manager.add(fake_spec())
    backend.state = old
    with pytest.raises(InvalidTransition, match=f"{old.name}->{new.name}"):
        backend._set_state(new)
    assert backend.state is old
    assert recorder.transitions == []
    backend.state = S.STOPPED
