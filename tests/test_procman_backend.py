"""The Backend's behaviour under a fake spawner, prober and clock: starts, failures, backoff,
the in-flight guard, idle stop, restart and update. No sleeps: fake time moves when a test says so.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from procman_fakes import FakeProcess, Harness, settle

from procman import (
    Backend,
    BackendClosed,
    BackendSpec,
    BackendUnavailable,
    InBackoff,
    RestartPolicy,
    StartFailed,
    StartInterrupted,
    StartTimeout,
    State,
    Transition,
)
from procman.process import READY_ENV, READY_PREFIX

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = Harness(tmp_path)
    yield harness
    await harness.close()
    assert harness.spawner.alive() == [], "every fake process must be gone after shutdown"


def unhealthy(proc: FakeProcess) -> None:
    proc.healthy = False


def exits(code: int, *lines: str) -> object:
    def script(proc: FakeProcess) -> None:
        proc.say(*lines)
        proc.exit(code)

    return script


# -- starting ---------------------------------------------------------------------------


async def test_concurrent_ensure_ready_share_one_start(h: Harness) -> None:
    h.spawner.on_spawn = unhealthy
    calls: list[str] = []

    async def before_start(backend: Backend) -> None:
        calls.append(backend.name)

    h.manager.add_before_start(before_start)
    backend = h.add()
    waiters = [asyncio.ensure_future(backend.ensure_ready()) for _ in range(5)]
    await h.clock.advance(2.0)
    assert backend.state is State.STARTING and not any(w.done() for w in waiters)
    h.spawner.last.healthy = True
    await h.clock.advance(1.0)
    addresses = await asyncio.gather(*waiters)
    assert len(set(addresses)) == 1 and addresses[0] == backend.address
    assert len(h.spawner.procs) == 1
    assert calls == ["m"]


async def test_callers_queued_behind_a_failed_start_get_its_error(h: Harness) -> None:
    h.spawner.on_spawn = unhealthy
    backend = h.add()
    waiters = [asyncio.ensure_future(backend.ensure_ready()) for _ in range(3)]
    await h.clock.advance(1.0)
    h.spawner.last.say("loading weights", "Error: unsupported quantization Q9_9")
    h.spawner.last.exit(2)
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, StartFailed) and r.exit_code == 2 for r in results)
    assert len({id(r) for r in results}) == 1  # the very same error, not three starts
    assert len(h.spawner.procs) == 1


async def test_start_whose_process_exits_early_reports_exit_code_and_log_tail(h: Harness) -> None:
    lines = [f"line {i}" for i in range(30)] + ["RuntimeError: cannot open model.gguf"]
    h.spawner.on_spawn = exits(3, *lines)  # type: ignore[assignment]
    backend = h.add()
    with pytest.raises(StartFailed) as caught:
        await backend.ensure_ready()
    error = caught.value
    assert type(error) is StartFailed
    assert error.exit_code == 3 and backend.exit_code == 3
    assert error.log_tail == lines[-20:]
    assert "code 3" in str(error) and "cannot open model.gguf" in str(error) and "line 10" not in str(error)
    assert backend.state is State.BACKOFF and backend.failures == 1
    assert backend.last_error == str(error)
    assert h.recorder.starts == [("m", "cold", False)]


async def test_start_that_times_out_kills_the_process(h: Harness) -> None:
    h.spawner.on_spawn = unhealthy
    backend = h.add(startup_timeout_s=5.0)
    waiter = asyncio.ensure_future(backend.ensure_ready())
    await h.clock.advance(4.0)
    assert not waiter.done()
    h.spawner.last.say("still compiling")
    await h.clock.advance(2.0)
    with pytest.raises(StartTimeout) as caught:
        await waiter
    assert "startup_timeout_s=5" in str(caught.value) and "still compiling" in str(caught.value)
    proc = h.spawner.last
    assert not proc.alive and proc.signals[0] == signal.SIGTERM
    assert backend.state is State.BACKOFF and backend.pid is None


async def test_readiness_polls_with_growing_intervals(h: Harness) -> None:
    h.spawner.on_spawn = unhealthy
    backend = h.add(startup_timeout_s=10.0)
    waiter = asyncio.ensure_future(backend.ensure_ready())
    await h.clock.advance(5.0)
    probes = len(h.prober.calls)
    assert 8 <= probes <= 20  # 20 ms doubling to 500 ms: about 14 probes in 5 s, not 250
    h.spawner.last.healthy = True
    await h.clock.advance(0.5)
    await waiter


def announces(proc: FakeProcess) -> None:
    """A process that never answers a probe but prints its readiness line at once."""
    proc.healthy = False
    proc.say("loading", READY_PREFIX + proc.env[READY_ENV])


async def test_announced_readiness_ends_the_start_without_a_successful_probe(h: Harness) -> None:
    h.spawner.on_spawn = announces
    backend = h.add(announces_ready=True)
    address = await asyncio.wait_for(backend.ensure_ready(), 5.0)  # no fake time passes: the line alone did it
    assert backend.state is State.READY and address == backend.address
    assert len(h.prober.calls) <= 2  # at most one while starting, and the health watch's first at READY
    assert len(h.spawner.last.env[READY_ENV]) >= 16


async def test_an_announced_process_is_probed_once_at_ready_for_its_last_health(h: Harness) -> None:
    def ready_with_figures(proc: FakeProcess) -> None:
        proc.health_body = {"status": "ready", "memory": {"counted_bytes": 7}}
        proc.healthy = Path(proc.argv[-1]).name.startswith("a")  # b's process (its socket b-N.sock) answers none
        proc.say(READY_PREFIX + proc.env[READY_ENV])

    h.spawner.on_spawn = ready_with_figures
    quiet = {"announces_ready": True, "health_interval_s": 0}  # no probes while READY...
    a, b = h.add("a", **quiet), h.add("b", **quiet)
    await asyncio.wait_for(asyncio.gather(a.ensure_ready(), b.ensure_ready()), 5.0)
    await settle()
    health = a.last_health  # ...but one at READY, for what the process reports
    assert health is not None and health.ok and health.body == {"status": "ready", "memory": {"counted_bytes": 7}}
    assert health.at == h.clock.now and b.last_health is None
    probes = len(h.prober.calls)
    await h.clock.advance(100.0)
    assert len(h.prober.calls) == probes  # and none after it
    assert a.state is State.READY and b.state is State.READY  # that probe checks nothing: b is not hung


async def test_a_readiness_line_with_another_token_is_ignored(h: Harness) -> None:
    h.spawner.on_spawn = unhealthy
    backend = h.add(announces_ready=True)
    waiter = asyncio.ensure_future(backend.ensure_ready())
    await h.clock.advance(0.1)
    h.spawner.last.say(READY_PREFIX + "0" * 16, "ovrouter-ready", READY_PREFIX.strip())
    await h.clock.advance(3.0)
    assert backend.state is State.STARTING and not waiter.done()
    h.spawner.last.say(READY_PREFIX + h.spawner.last.env[READY_ENV])
    await settle()
    assert waiter.done() and backend.state is State.READY


async def test_an_announcing_process_is_still_probed_seldom_as_a_safety_net(h: Harness) -> None:
    h.spawner.on_spawn = unhealthy
    backend = h.add(announces_ready=True, startup_timeout_s=30.0)
    waiter = asyncio.ensure_future(backend.ensure_ready())
    await h.clock.advance(10.0)
    assert 2 <= len(h.prober.calls) <= 7  # every 2 s, not the 20 ms doubling of a silent process
    h.spawner.last.healthy = True  # it never printed the line: the probe still finds it
    await h.clock.advance(2.5)
    await waiter


async def test_each_spawn_gets_a_fresh_token_and_silent_specs_get_none(h: Harness) -> None:
    h.spawner.on_spawn = announces
    backend = h.add(announces_ready=True)
    await backend.ensure_ready()
    first = h.spawner.last.env[READY_ENV]
    await backend.stop()
    await backend.ensure_ready()
    assert h.spawner.last.env[READY_ENV] != first
    h.spawner.on_spawn = None
    await h.add("silent").ensure_ready()
    assert READY_ENV not in h.spawner.last.env


async def test_command_that_cannot_run_is_a_start_failure(h: Harness) -> None:
    h.spawner.fail_with = FileNotFoundError(2, "No such file or directory")
    backend = h.add()
    with pytest.raises(StartFailed, match="cannot run 'server': No such file or directory"):
        await backend.ensure_ready()
    assert backend.state is State.BACKOFF


async def test_placeholders_are_substituted_in_argv_and_env(h: Harness) -> None:
    backend = h.manager.add(
        BackendSpec(
            name="x", argv=("srv", "--listen=${HOST}:${PORT}"), env={"P": "${PORT}", "H": "$HOME"}, transport="tcp"
        )
    )
    address = await backend.ensure_ready()
    proc = h.spawner.last
    assert proc.argv == ["srv", f"--listen=127.0.0.1:{address.port}"]
    assert proc.env["P"] == str(address.port) and proc.env["H"] == "$HOME"
    assert proc.env["PYTHONUNBUFFERED"] == "1"


async def test_tcp_port_clash_reported_by_the_child_tries_the_next_port(h: Harness) -> None:
    def first_clashes(proc: FakeProcess) -> None:
        if len(h.spawner.procs) == 1:
            proc.say("OSError: [Errno 98] error while attempting to bind: address already in use")
            proc.exit(1)

    h.spawner.on_spawn = first_clashes
    backend = h.add(transport="tcp")
    address = await backend.ensure_ready()
    first_port = h.spawner.procs[0].argv[-1]
    assert len(h.spawner.procs) == 2 and str(address.port) != first_port
    assert backend.failures == 0 and h.recorder.starts == [("m", "cold", True)]


async def test_before_start_error_prevents_the_spawn(h: Harness) -> None:
    async def no_room(backend: Backend) -> None:
        raise BackendUnavailable("group gpu0 is full: 1 busy model")

    h.manager.add_before_start(no_room)
    backend = h.add()
    with pytest.raises(BackendUnavailable, match="gpu0 is full"):
        await backend.ensure_ready()
    assert h.spawner.procs == [] and backend.state is State.STOPPED


async def test_before_start_runs_once_per_cold_start(h: Harness) -> None:
    calls: list[State] = []

    async def before_start(backend: Backend) -> None:
        calls.append(backend.state)

    h.manager.add_before_start(before_start)
    backend = h.add()
    await backend.ensure_ready()
    await backend.ensure_ready()
    async with backend.request():
        pass
    assert calls == [State.STARTING]  # room is made after STOPPED -> STARTING, before the spawn
    await backend.stop()
    await backend.ensure_ready()
    assert calls == [State.STARTING, State.STARTING]


# -- failures and backoff ---------------------------------------------------------------


async def test_crash_is_noticed_at_once_and_relaunched(h: Harness) -> None:
    backend = h.add(health_interval_s=3600.0)
    await backend.ensure_ready()
    first = h.spawner.last
    first.exit(139)
    await settle()  # no fake time passes: the exit itself woke the monitor
    assert backend.state is State.READY and backend.pid != first.pid
    assert backend.generation == 2 and backend.restarts == 1 and backend.failures == 1
    assert h.recorder.restarts == [("m", "crash")]
    assert h.recorder.starts[-1] == ("m", "crash", True)


async def test_crash_loop_backs_off_doubling_then_gives_up(h: Harness) -> None:
    policy = RestartPolicy(max_retries=4, backoff_base_s=1.0, backoff_max_s=4.0, stable_after_s=30.0)
    backend = h.add(policy=policy)
    await backend.ensure_ready()
    h.spawner.on_spawn = exits(1, "boom")  # type: ignore[assignment]
    h.spawner.last.exit(1)
    await h.clock.advance(100.0)
    assert h.recorder.backoffs == [0.0, 1.0, 2.0, 4.0, 4.0]
    assert len(h.spawner.procs) == 1 + 4  # the first process, then max_retries relaunches
    assert backend.state is State.BACKOFF and backend.failures == 5
    await h.clock.advance(1000.0)
    assert len(h.spawner.procs) == 5  # gave up relaunching by itself...
    h.spawner.on_spawn = None
    await backend.ensure_ready()  # ...but a request after the delay still tries
    assert backend.state is State.READY and len(h.spawner.procs) == 6


async def test_in_backoff_fails_fast_with_the_remaining_delay(h: Harness) -> None:
    h.spawner.on_spawn = exits(1)  # type: ignore[assignment]
    backend = h.add(policy=RestartPolicy(backoff_base_s=2.0))
    for _ in range(2):
        with pytest.raises(StartFailed):
            await backend.ensure_ready()
    await h.clock.advance(0.5)
    with pytest.raises(InBackoff) as caught:
        await backend.ensure_ready()
    assert caught.value.retry_after_s == pytest.approx(1.5)
    assert "2 failure(s)" in str(caught.value) and "exited with code 1" in str(caught.value)
    assert len(h.spawner.procs) == 2
    assert backend.snapshot()["retry_after_s"] == pytest.approx(1.5)
    await h.clock.advance(1.5)
    h.spawner.on_spawn = None
    await backend.ensure_ready()
    assert backend.state is State.READY


async def test_failed_start_error_carries_retry_after(h: Harness) -> None:
    h.spawner.on_spawn = exits(1)  # type: ignore[assignment]
    backend = h.add(policy=RestartPolicy(backoff_base_s=3.0))
    with pytest.raises(StartFailed) as first:
        await backend.ensure_ready()
    with pytest.raises(StartFailed) as second:
        await backend.ensure_ready()
    assert first.value.retry_after_s == 0.0 and second.value.retry_after_s == 3.0


async def test_cold_start_failure_is_not_retried_in_the_background(h: Harness) -> None:
    h.spawner.on_spawn = exits(1)  # type: ignore[assignment]
    backend = h.add()
    with pytest.raises(StartFailed):
        await backend.ensure_ready()
    await h.clock.advance(600.0)
    assert len(h.spawner.procs) == 1 and backend.state is State.BACKOFF


async def test_failure_count_resets_after_stable_uptime(h: Harness) -> None:
    backend = h.add(policy=RestartPolicy(backoff_base_s=1.0, stable_after_s=30.0))
    await backend.ensure_ready()
    h.spawner.last.exit(1)
    await settle()
    h.spawner.last.exit(1)
    await settle()
    assert backend.failures == 2 and backend.state is State.BACKOFF
    await h.clock.advance(1.0)
    assert backend.state is State.READY and backend.failures == 2
    await h.clock.advance(29.0)
    assert backend.snapshot()["failures"] == 2
    await h.clock.advance(1.0)
    assert backend.snapshot()["failures"] == 0
    h.spawner.last.exit(1)
    await settle()
    assert backend.failures == 1 and backend.state is State.READY  # a first failure again: relaunched at once


async def test_hang_is_killed_and_relaunched_after_n_failed_probes(h: Harness) -> None:
    backend = h.add(health_interval_s=10.0, health_failures=3, stop_timeout_s=5.0)
    await backend.ensure_ready()
    hung = h.spawner.last
    hung.healthy = False
    hung.ignore_term = True  # a frozen process does not act on SIGTERM
    await h.clock.advance(29.0)
    assert backend.pid == hung.pid
    await h.clock.advance(1.0)  # third failed probe
    assert hung.signals == [signal.SIGKILL] and not hung.alive  # a hung process is never asked politely
    assert backend.state is State.READY and backend.pid != hung.pid
    assert h.recorder.restarts == [("m", "hang")] and h.recorder.starts[-1] == ("m", "hang", True)
    assert f"pid={hung.pid} was killed: /health failed 3 probes in a row" in (backend.last_error or "")


async def test_a_process_stopped_from_outside_again_and_again_is_relaunched_at_once_and_never_backs_off(
        h: Harness) -> None:
    """SIGSTOP is someone else's doing: each stopped process is killed as hung and relaunched at once, with no
    failure counted (past max_retries too); a kill -9 after that still counts (it may be the OOM killer)."""
    policy = RestartPolicy(max_retries=2, backoff_base_s=30.0, backoff_max_s=60.0, stable_after_s=3600.0)
    backend = h.add(health_interval_s=10.0, health_failures=3, policy=policy)
    await backend.ensure_ready()
    for _ in range(policy.max_retries + 2):
        stopped = h.spawner.last
        stopped.sigstopped, stopped.healthy = True, False  # state T: no probe answers
        await h.clock.advance(30.0)
        assert not stopped.alive and stopped.signals == [signal.SIGKILL]
        assert backend.state is State.READY and backend.pid != stopped.pid and backend.failures == 0
    h.spawner.last.exit(-signal.SIGKILL)
    await settle()
    assert backend.state is State.READY and backend.failures == 1


async def test_a_hang_restart_of_a_process_stopped_from_outside_counts_no_failure(h: Harness) -> None:
    """The router's restart for a request whose heartbeats stopped: no failure when the process is found stopped
    by a signal, one when it hung by itself."""
    backend = h.add(health_interval_s=3600.0)
    await backend.ensure_ready()
    h.spawner.last.sigstopped = True
    await backend.restart("hang", generation=backend.generation)
    assert backend.state is State.READY and backend.failures == 0 and backend.restarts == 1
    await backend.restart("hang", generation=backend.generation)  # not stopped: it hung by itself
    assert backend.state is State.READY and backend.failures == 1 and backend.restarts == 2


async def test_a_process_stopped_from_outside_while_it_starts_is_killed_and_started_again_at_once(
        h: Harness) -> None:
    """SIGSTOP during the load hung the start until startup_timeout_s, then counted a failed start: found stopped
    at a readiness poll, it is killed and started again at once (past max_retries too, no failure counted), and
    the waiting caller gets the process that answers."""
    policy = RestartPolicy(max_retries=1, backoff_base_s=30.0, backoff_max_s=60.0)
    stops = 3

    def stopped_while_loading(proc: FakeProcess) -> None:
        if len(h.spawner.procs) <= stops:
            proc.sigstopped, proc.healthy = True, False  # state T: no probe answers

    h.spawner.on_spawn = stopped_while_loading
    backend = h.add(startup_timeout_s=120.0, policy=policy)
    began = h.clock.now
    waiter = asyncio.ensure_future(backend.ensure_ready())
    for _ in range(20):
        if waiter.done():
            break
        await h.clock.advance(1.0)
    address = await asyncio.wait_for(waiter, 5.0)
    assert h.clock.now - began < 60.0 and address == backend.address  # fake seconds: far below startup_timeout_s
    assert [p.signals for p in h.spawner.procs] == [[signal.SIGKILL]] * stops + [[]]
    assert backend.state is State.READY and backend.pid == h.spawner.last.pid
    assert backend.failures == 0 and backend.restarts == stops and backend.starts == 1


async def test_one_good_probe_resets_the_hang_count(h: Harness) -> None:
    backend = h.add(health_interval_s=10.0, health_failures=3)
    await backend.ensure_ready()
    proc = h.spawner.last
    proc.healthy = False
    await h.clock.advance(20.0)
    proc.healthy = True
    await h.clock.advance(10.0)
    proc.healthy = False
    await h.clock.advance(20.0)
    assert backend.pid == proc.pid and h.recorder.restarts == []


# -- restart ----------------------------------------------------------------------------


async def test_restart_with_an_old_generation_is_a_no_op(h: Harness) -> None:
    backend = h.add()
    await backend.ensure_ready()
    gen = backend.generation
    await asyncio.gather(*(backend.restart("fatal", generation=gen) for _ in range(5)))
    assert len(h.spawner.procs) == 2 and backend.generation == gen + 1
    await backend.restart("fatal", generation=gen)
    assert len(h.spawner.procs) == 2 and h.recorder.restarts == [("m", "fatal")]


async def test_fatal_restart_counts_as_failure_manual_does_not(h: Harness) -> None:
    backend = h.add()
    await backend.ensure_ready()
    await backend.restart("manual")
    assert backend.failures == 0 and backend.state is State.READY
    await backend.restart("fatal")
    assert backend.failures == 1 and backend.state is State.READY and backend.generation == 3


async def test_restart_of_a_stopped_backend_starts_it(h: Harness) -> None:
    backend = h.add()
    await backend.restart("manual")
    assert backend.state is State.READY and h.recorder.starts == [("m", "manual", True)]


async def test_failed_restart_does_not_raise_and_next_caller_hears_why(h: Harness) -> None:
    backend = h.add(policy=RestartPolicy(backoff_base_s=10.0))
    await backend.ensure_ready()
    h.spawner.on_spawn = exits(7, "CL_OUT_OF_RESOURCES")  # type: ignore[assignment]
    await backend.restart("fatal")
    assert backend.state is State.BACKOFF
    with pytest.raises(InBackoff, match="CL_OUT_OF_RESOURCES"):
        await backend.ensure_ready()


# -- in-flight guard, drain, idle ---------------------------------------------------------


async def test_in_flight_request_blocks_stop_until_it_finishes(h: Harness) -> None:
    backend = h.add()
    proceed = asyncio.Event()

    async def one_request() -> None:
        async with backend.request() as lease:
            assert lease.address == backend.address and lease.generation == 1 and lease.pid == backend.pid
            await proceed.wait()

    req = asyncio.ensure_future(one_request())
    await settle()
    assert backend.in_flight == 1 and not backend.is_idle()
    stopping = asyncio.ensure_future(backend.stop("unload"))
    await h.clock.advance(100.0)
    assert backend.state is State.READY and h.spawner.last.signals == [] and not stopping.done()
    late = asyncio.ensure_future(backend.ensure_ready())  # a new caller waits on the lock meanwhile
    await settle()
    assert not late.done()
    proceed.set()
    await req
    await stopping
    assert backend.in_flight == 0 and h.recorder.stops == [("m", "unload")]
    await late  # ...and then cold-starts a fresh process
    assert len(h.spawner.procs) == 2 and backend.state is State.READY


async def test_overlapping_requests_only_the_last_done_starts_the_idle_clock(h: Harness) -> None:
    backend = h.add(idle_timeout_s=60.0)
    async with backend.request():
        async with backend.request():
            assert backend.in_flight == 2
        assert backend.in_flight == 1 and backend.last_used is not None
        await h.clock.advance(120.0)
        assert backend.state is State.READY  # one still in flight
    assert backend.in_flight == 0
    await h.clock.advance(59.0)
    assert backend.state is State.READY
    await h.clock.advance(1.0)
    assert backend.state is State.STOPPED and h.recorder.stops == [("m", "idle")]


async def test_a_drain_waits_for_every_overlapping_request_and_admits_none_meanwhile(h: Harness) -> None:
    backend = h.add()
    async with backend.request():
        async with backend.request():
            stopping = asyncio.ensure_future(backend.stop("unload"))
            await settle()
        late = asyncio.ensure_future(backend.ensure_ready())
        await settle()
        assert backend.in_flight == 1 and backend.state is State.READY
        assert not stopping.done() and not late.done()
    await stopping
    assert h.recorder.stops == [("m", "unload")] and backend.in_flight == 0
    await late  # parked through the drain, then a fresh start
    assert len(h.spawner.procs) == 2


async def test_drain_is_bounded_by_drain_timeout(h: Harness) -> None:
    backend = h.add(drain_timeout_s=5.0)
    entered = asyncio.Event()

    async def stuck() -> None:
        async with backend.request():
            entered.set()
            await asyncio.Event().wait()

    req = asyncio.ensure_future(stuck())
    await entered.wait()
    await h.clock.run(backend.stop("reload"))
    assert backend.state is State.STOPPED and h.clock.now >= 1005.0
    req.cancel()
    await asyncio.gather(req, return_exceptions=True)
    assert backend.in_flight == 0


async def test_stop_without_drain_kills_at_once(h: Harness) -> None:
    backend = h.add()
    async with backend.request():
        await backend.stop("shutdown", drain=False)
        assert backend.state is State.STOPPED
    assert backend.in_flight == 0


async def test_an_unload_of_a_process_stopped_from_outside_continues_it_so_its_sigterm_acts(h: Harness) -> None:
    """A SIGSTOPped process acts on no SIGTERM: the unload waited stop_timeout_s, then SIGKILLed it (the model's
    next start waiting meanwhile). A SIGCONT after the SIGTERM lets it stop gracefully, with no wait."""
    backend = h.add(stop_timeout_s=600.0)
    await backend.ensure_ready()
    proc = h.spawner.last
    proc.sigstopped = True
    await backend.stop("unload")  # no clock advance: the fake clock never reaches stop_timeout_s
    assert proc.signals[:2] == [signal.SIGTERM, signal.SIGCONT] and proc.returncode == -signal.SIGTERM
    assert backend.state is State.STOPPED


async def test_a_running_process_gets_no_sigcont_on_its_stop(h: Harness) -> None:
    backend = h.add()
    await backend.ensure_ready()
    proc = h.spawner.last
    await backend.stop("unload")
    assert signal.SIGCONT not in proc.signals and proc.returncode == -signal.SIGTERM


async def test_idle_stop_after_the_last_request_finishes(h: Harness) -> None:
    backend = h.add(idle_timeout_s=60.0)
    async with backend.request():
        pass
    await h.clock.advance(30.0)
    async with backend.request():
        pass  # the idle clock starts again here
    await h.clock.advance(59.0)
    assert backend.state is State.READY
    await h.clock.advance(1.0)
    assert backend.state is State.STOPPED and h.recorder.stops == [("m", "idle")]
    assert backend.last_used is not None


async def test_idle_stop_never_while_a_request_is_in_flight(h: Harness) -> None:
    backend = h.add(idle_timeout_s=60.0)
    release = asyncio.Event()

    async def long_stream() -> None:
        async with backend.request():
            await release.wait()

    req = asyncio.ensure_future(long_stream())
    await settle()
    await h.clock.advance(3600.0)
    assert backend.state is State.READY and backend.in_flight == 1
    release.set()
    await req
    await h.clock.advance(59.0)
    assert backend.state is State.READY
    await h.clock.advance(2.0)
    assert backend.state is State.STOPPED


async def test_loaded_but_never_used_backend_idles_out(h: Harness) -> None:
    backend = h.add(idle_timeout_s=10.0)
    await backend.ensure_ready()
    await h.clock.advance(10.0)
    assert backend.state is State.STOPPED


async def test_zero_idle_timeout_never_stops(h: Harness) -> None:
    backend = h.add(idle_timeout_s=0.0, health_interval_s=3600.0)
    async with backend.request():
        pass
    await h.clock.advance(30 * 86400.0)
    assert backend.state is State.READY


async def test_cancelled_waiter_does_not_abort_the_shared_start(h: Harness) -> None:
    h.spawner.on_spawn = unhealthy
    backend = h.add()
    first = asyncio.ensure_future(backend.ensure_ready())
    await h.clock.advance(1.0)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert backend.state is State.STARTING and h.spawner.last.alive
    h.spawner.last.healthy = True
    second = asyncio.ensure_future(backend.ensure_ready())
    await h.clock.advance(1.0)
    assert await second == backend.address and len(h.spawner.procs) == 1


async def test_cancelled_stop_still_finishes(h: Harness) -> None:
    backend = h.add(stop_timeout_s=10.0)
    await backend.ensure_ready()
    h.spawner.last.ignore_term = True
    stopping = asyncio.ensure_future(backend.stop())
    await h.clock.advance(1.0)
    stopping.cancel()
    await asyncio.gather(stopping, return_exceptions=True)
    assert backend.state is State.STOPPING
    await h.clock.advance(10.0)
    assert backend.state is State.STOPPED and not h.spawner.last.alive


# -- update, remove, remote ----------------------------------------------------------------


async def test_update_with_an_equal_spec_does_nothing(h: Harness) -> None:
    backend = h.add()
    await backend.ensure_ready()
    await backend.update(replace(backend.spec))
    assert len(h.spawner.procs) == 1 and backend.generation == 1


async def test_update_of_a_loaded_backend_drains_and_starts_the_new_spec(h: Harness) -> None:
    backend = h.add(env={"V": "1"})
    release = asyncio.Event()

    async def in_flight() -> None:
        async with backend.request():
            await release.wait()

    req = asyncio.ensure_future(in_flight())
    await settle()
    updating = asyncio.ensure_future(backend.update(replace(backend.spec, env={"V": "2"})))
    await h.clock.advance(10.0)
    assert not updating.done() and h.spawner.procs[0].alive  # waits for the request in flight
    release.set()
    await req
    await updating
    assert not h.spawner.procs[0].alive and h.spawner.last.env["V"] == "2"
    assert backend.state is State.READY and h.recorder.starts[-1] == ("m", "reload", True)


async def test_update_of_supervision_settings_retunes_the_running_process(h: Harness) -> None:
    backend = h.add(idle_timeout_s=600.0, health_interval_s=60.0)
    await backend.ensure_ready()
    pid = backend.pid
    tuned = replace(backend.spec, idle_timeout_s=10.0, health_interval_s=1.0, policy=RestartPolicy(max_retries=1))
    await backend.update(tuned)
    assert backend.pid == pid and len(h.spawner.procs) == 1 and backend.spec == tuned
    probes = len(h.prober.calls)
    await h.clock.advance(9.0)
    assert len(h.prober.calls) - probes >= 8  # the watch took the new health_interval_s
    await h.clock.advance(1.0)
    assert backend.state is State.STOPPED and h.recorder.stops == [("m", "idle")]  # and the new idle_timeout_s


async def test_update_of_a_stopped_backend_stays_stopped(h: Harness) -> None:
    backend = h.add(env={"V": "1"})
    await backend.update(replace(backend.spec, env={"V": "2"}))
    assert backend.state is State.STOPPED and h.spawner.procs == [] and backend.spec.env["V"] == "2"
    await backend.ensure_ready()
    assert h.spawner.last.env["V"] == "2"


async def test_update_clears_the_backoff_of_the_old_spec(h: Harness) -> None:
    h.spawner.on_spawn = exits(1)  # type: ignore[assignment]
    backend = h.add(policy=RestartPolicy(backoff_base_s=100.0))
    for _ in range(2):
        with pytest.raises(StartFailed):
            await backend.ensure_ready()
    h.spawner.on_spawn = None
    await backend.update(replace(backend.spec, argv=("fixed", "--uds", "${SOCKET}")))
    await backend.ensure_ready()
    assert h.spawner.last.argv[0] == "fixed" and backend.failures == 0


async def test_removed_backend_raises_backend_closed(h: Harness) -> None:
    backend = h.add()
    await backend.ensure_ready()
    proc = h.spawner.last
    await h.manager.remove("m")
    assert h.manager.get("m") is None and not proc.alive
    with pytest.raises(BackendClosed):
        await backend.ensure_ready()


async def test_add_twice_is_refused(h: Harness) -> None:
    h.add()
    with pytest.raises(ValueError, match="already exists"):
        h.add()


async def test_remote_backend_is_probed_never_spawned(h: Harness) -> None:
    backend = h.manager.add(BackendSpec(name="r", argv=None, url="http://10.1.2.3:9000/", health_path="/ping"))
    with pytest.raises(BackendUnavailable, match=r"http://10\.1\.2\.3:9000/ping did not answer 200"):
        await backend.ensure_ready()
    h.prober.remote["http://10.1.2.3:9000/"] = True
    address = await backend.ensure_ready()
    assert address.base_url == "http://10.1.2.3:9000" and backend.pid is None
    assert h.spawner.procs == [] and backend.state is State.READY
    await backend.stop()
    assert backend.state is State.STOPPED


async def test_remote_backend_that_stops_answering_becomes_unavailable(h: Harness) -> None:
    url = "http://10.1.2.3:9000"
    h.prober.remote[url] = True
    backend = h.manager.add(BackendSpec(name="r", argv=None, url=url, health_interval_s=5.0, health_failures=2))
    await backend.ensure_ready()
    h.prober.remote[url] = False
    await h.clock.advance(10.0)
    assert backend.state is State.BACKOFF and "did not answer" in (backend.last_error or "")


async def test_snapshot_is_json(h: Harness) -> None:
    backend = h.add()
    await backend.ensure_ready()
    snap = json.loads(json.dumps(backend.snapshot()))
    assert snap["state"] == "ready" and snap["pid"] == backend.pid and snap["address"].startswith("unix:")
    assert set(snap) >= {
        "name", "state", "pid", "address", "started_at", "last_used", "in_flight",
        "starts", "restarts", "failures", "last_error", "retry_after_s",
    }  # fmt: skip


async def test_shutdown_kills_every_backend_concurrently(h: Harness) -> None:
    backends = [h.add(f"m{i}", stop_timeout_s=10.0) for i in range(3)]
    for backend in backends:
        await backend.ensure_ready()
    for proc in h.spawner.procs:
        proc.ignore_term = True
    began = h.clock.now
    await h.clock.run(h.manager.shutdown(), step=0.5)
    assert h.clock.now - began < 20.0  # concurrently: one stop_timeout_s, not three
    assert all(b.state is State.STOPPED for b in backends) and h.spawner.alive() == []
    with pytest.raises(BackendClosed):
        await backends[0].ensure_ready()


async def test_reload_during_a_cold_start_serves_the_waiter_from_the_new_spec(h: Harness) -> None:
    h.spawner.on_spawn = unhealthy
    backend = h.add(env={"V": "1"})
    waiter = asyncio.ensure_future(backend.ensure_ready())
    await h.clock.advance(1.0)
    assert backend.state is State.STARTING
    h.spawner.on_spawn = None
    updating = asyncio.ensure_future(backend.update(replace(backend.spec, env={"V": "2"})))
    await h.clock.advance(1.0)
    await updating
    address = await waiter  # not an error: the reload's start is the one it gets
    assert address == backend.address and h.spawner.last.env["V"] == "2"
    assert not h.spawner.procs[0].alive and len(h.spawner.procs) == 2


async def test_unload_during_a_cold_start_fails_the_waiter(h: Harness) -> None:
    h.spawner.on_spawn = unhealthy
    backend = h.add()
    waiter = asyncio.ensure_future(backend.ensure_ready())
    await h.clock.advance(1.0)
    await h.clock.run(backend.stop("unload"))
    with pytest.raises(StartInterrupted, match=r"interrupted \(unload\)") as caught:
        await waiter
    assert caught.value.by == "unload" and backend.state is State.STOPPED and len(h.spawner.procs) == 1


async def test_a_failing_subscriber_does_not_break_the_state_machine(h: Harness) -> None:
    def broken(news: Transition) -> None:
        raise RuntimeError("metrics are down")

    h.manager.subscribe(Transition, broken)
    backend = h.add()
    await backend.ensure_ready()
    await backend.stop()
    assert backend.state is State.STOPPED


async def test_cancelled_request_while_waiting_for_a_start_is_not_counted(h: Harness) -> None:
    h.spawner.on_spawn = unhealthy
    backend = h.add()

    async def one_request() -> None:
        async with backend.request():
            raise AssertionError("never admitted")

    req = asyncio.ensure_future(one_request())
    await h.clock.advance(1.0)
    req.cancel()
    await asyncio.gather(req, return_exceptions=True)
    h.spawner.last.healthy = True
    await h.clock.advance(1.0)
    assert backend.state is State.READY and backend.in_flight == 0 and backend.is_idle()


# -- health probes that do not disturb -----------------------------------------------------


async def test_interval_0_probes_while_starting_and_never_once_ready(h: Harness) -> None:
    backend = h.add(health_interval_s=0.0)
    await backend.ensure_ready()
    probes_to_start = len(h.prober.calls)
    assert probes_to_start >= 1  # readiness is still a probe that answered 200
    h.spawner.last.healthy = False  # a probe now would fail; three in a row would kill it as hung
    await h.clock.advance(3600.0)
    assert len(h.prober.calls) == probes_to_start
    assert backend.state is State.READY and backend.pid == h.spawner.last.pid and backend.restarts == 0


async def test_interval_0_still_notices_an_exit_at_once(h: Harness) -> None:
    backend = h.add(health_interval_s=0.0)
    await backend.ensure_ready()
    first = h.spawner.last
    first.exit(-signal.SIGKILL)
    await h.clock.run(backend.ensure_ready())
    assert backend.pid != first.pid and backend.restarts == 1
    assert "code -9 (SIGKILL)" in (backend.last_error or "")


async def test_a_retune_from_interval_0_starts_probing(h: Harness) -> None:
    backend = h.add(health_interval_s=0.0)
    await backend.ensure_ready()
    before = len(h.prober.calls)
    await backend.retune(replace(backend.spec, health_interval_s=10.0))
    await h.clock.advance(10.0)
    assert len(h.prober.calls) == before + 1


async def test_the_probe_uses_the_configured_method_and_path(h: Harness) -> None:
    backend = h.add(health_method="HEAD", health_path="/v2/health/ready")
    await backend.ensure_ready()
    await h.clock.advance(10.0)
    assert set(h.prober.methods) == {"HEAD"} and len(h.prober.methods) >= 2
    assert {path for _, path in h.prober.calls} == {"/v2/health/ready"}
