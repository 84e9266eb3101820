"""procman against real processes: the fake-engine model server and a stdlib stand-in server.

Ready over a Unix socket and over TCP, a crash noticed at once and relaunched, a hang
killed after failed probes, a child that ignores SIGTERM, a SIGSTOPped child stopped by its
SIGTERM, the whole process group killed, a crash loop that backs off and recovers, a start
that fails at once with the reason.
Waits are on conditions (readiness, a new generation), bounded, never fixed sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from procman_fakes import Recorder

from procman import (
    Address,
    Backend,
    BackendSpec,
    HttpProber,
    ProcessManager,
    RestartPolicy,
    StartFailed,
    State,
    Transition,
)

pytestmark = [pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parent.parent
STANDIN = str(Path(__file__).resolve().parent / "procs" / "standin.py")


def gone(pid: int) -> bool:
    """No such process any more (a zombie awaiting its reaper counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def eventually(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g}s: {what}")
        await asyncio.sleep(0.02)


def client_for(address: Address, timeout_s: float = 10.0) -> httpx.AsyncClient:
    transport = httpx.AsyncHTTPTransport(uds=address.path) if address.kind == "uds" else None
    return httpx.AsyncClient(base_url=address.base_url, transport=transport, timeout=timeout_s)


@dataclass(frozen=True)
class Server:
    """How to run one kind of backend and make it crash or hang."""

    kind: str

    def argv(self, transport: str, *extra: str) -> tuple[str, ...]:
        where = ("--uds", "${SOCKET}") if transport == "uds" else ("--port", "${PORT}")
        if self.kind == "standin":
            return (sys.executable, STANDIN, *where, *extra)
        return (sys.executable, "-m", "modelserver", "--engine", "fake", "--name", "fake", *where, *extra)

    async def send_fault(self, address: Address, fault: str, timeout_s: float) -> None:
        async with client_for(address, timeout_s) as client:
            with contextlib.suppress(httpx.HTTPError):
                if self.kind == "standin":
                    await client.post(f"/{fault}")
                else:
                    body = {"model": "fake", "messages": [{"role": "user", "content": f"please [[{fault}]]"}]}
                    await client.post("/v1/chat/completions", json=body)


SERVERS = [Server("standin"), Server("modelserver")]


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
async def manager(tmp_path: Path, recorder: Recorder) -> AsyncIterator[ProcessManager]:
    low = random.randrange(30000, 39000, 50)
    pm = ProcessManager(tmp_path / "rt", port_range=(low, low + 49))
    recorder.attach(pm)
    yield pm
    pids = [b.pid for b in pm.backends.values() if b.pid is not None]
    await pm.shutdown()
    assert all(gone(pid) for pid in pids)


def add(manager: ProcessManager, server: Server, transport: str = "uds", *extra: str, **fields: Any) -> Backend:
    settings: dict[str, Any] = {"startup_timeout_s": 60.0, "stop_timeout_s": 5.0, **fields}
    return manager.add(
        BackendSpec(
            name=f"{server.kind}-{transport}",
            argv=server.argv(transport, *extra),
            cwd=str(ROOT),
            transport=transport,
            **settings,
        )  # fmt: skip
    )


@pytest.mark.parametrize("server", SERVERS, ids=lambda s: s.kind)
@pytest.mark.parametrize("transport", ["uds", "tcp"])
async def test_ready_then_stopped(manager: ProcessManager, server: Server, transport: str) -> None:
    backend = add(manager, server, transport)
    address = await backend.ensure_ready()
    assert address.kind == transport and backend.state is State.READY
    assert await HttpProber().probe(address, "/health", 5.0)
    pid = backend.pid
    assert pid is not None and psutil.Process(pid).is_running()
    if transport == "uds":
        assert address.path is not None and Path(address.path).is_socket()
        assert oct(Path(address.path).parent.stat().st_mode & 0o777) == "0o700"
    else:
        assert address.port is not None and manager.backends[backend.name].spec.transport == "tcp"
    log_file = manager.runtime_dir / "logs" / f"{backend.name}.log"
    await backend.stop("unload")
    assert backend.state is State.STOPPED and gone(pid)
    assert backend.exit_code is not None
    if transport == "uds":
        assert not Path(str(address.path)).exists()
    assert f"spawned pid={pid}" in log_file.read_text()


@pytest.mark.parametrize("server", SERVERS, ids=lambda s: s.kind)
async def test_crash_is_noticed_at_once_and_relaunched_with_a_new_pid(
    manager: ProcessManager, recorder: Recorder, server: Server
) -> None:
    backend = add(manager, server, health_interval_s=3600.0)  # only the exit itself can reveal the crash
    address = await backend.ensure_ready()
    old = backend.pid
    assert old is not None
    await server.send_fault(address, "crash", timeout_s=10.0)
    await eventually(lambda: backend.generation == 2 and backend.state is State.READY, 60.0, "relaunch after crash")
    assert backend.pid != old and gone(old)
    assert recorder.restarts == [(backend.name, "crash")]
    assert backend.restarts == 1 and backend.failures == 1 and "exited unexpectedly" in (backend.last_error or "")
    assert await HttpProber().probe(await backend.ensure_ready(), "/health", 5.0)


@pytest.mark.parametrize("server", SERVERS, ids=lambda s: s.kind)
async def test_hang_is_killed_and_relaunched_after_failed_probes(
    manager: ProcessManager, recorder: Recorder, server: Server
) -> None:
    interval, timeout, failures, stop = 0.3, 1.0, 2, 1.0  # 1 s: a healthy server on a busy machine answers late
    backend = add(
        manager, server, health_interval_s=interval, health_timeout_s=timeout, health_failures=failures,
        stop_timeout_s=stop,
    )  # fmt: skip
    address = await backend.ensure_ready()
    old = backend.pid
    assert old is not None
    fault = asyncio.ensure_future(server.send_fault(address, "hang", timeout_s=30.0))
    hung_at = time.monotonic()
    bound = (interval + timeout) * failures + stop + 30.0  # + slack for a loaded 2-core machine
    await eventually(lambda: old != backend.pid, bound, "the hung process is killed")
    assert gone(old), f"pid {old} should have been killed {time.monotonic() - hung_at:.1f}s after the hang"
    await eventually(lambda: backend.state is State.READY and backend.generation == 2, 60.0, "relaunch after hang")
    assert recorder.restarts == [(backend.name, "hang")]
    await fault


async def test_child_that_ignores_sigterm_is_sigkilled(manager: ProcessManager) -> None:
    backend = add(manager, Server("standin"), "uds", "--ignore-term", stop_timeout_s=0.5)
    await backend.ensure_ready()
    pid = backend.pid
    assert pid is not None
    await eventually(lambda: "ignoring SIGTERM" in backend.logs.tail(), 30.0, "the child set SIG_IGN")
    await backend.stop()
    assert backend.exit_code == -signal.SIGKILL and gone(pid)


async def test_a_sigstopped_child_stops_on_its_sigterm_not_after_stop_timeout(manager: ProcessManager) -> None:
    """A stopped process acts on no SIGTERM until it runs again: the stop continues it (SIGCONT), so it exits by
    the SIGTERM, not by the SIGKILL after ``stop_timeout_s`` (600 s here: past the test's own timeout)."""
    backend = add(manager, Server("standin"), "uds", stop_timeout_s=600.0)
    await backend.ensure_ready()
    pid = backend.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    await eventually(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED, 30.0, "the child stopped")
    await backend.stop("unload")
    assert backend.exit_code == -signal.SIGTERM and gone(pid)


async def test_stop_kills_the_whole_process_group(manager: ProcessManager) -> None:
    backend = add(manager, Server("standin"), "uds", "--grandchild")
    await backend.ensure_ready()
    told = "grandchild pid="  # printed before it listens; read from its pipe by a task of its own
    await eventually(lambda: any(line.startswith(told) for line in backend.logs.tail()), 30.0, "the grandchild's pid")
    lines = [m for line in backend.logs.tail() if (m := re.match(r"grandchild pid=(\d+)", line))]
    assert lines, backend.logs.tail()
    grandchild = int(lines[0].group(1))
    assert not gone(grandchild)
    await backend.stop()
    await eventually(lambda: gone(grandchild), 30.0, "the grandchild dies with its group")


async def test_crash_loop_backs_off_and_recovers_when_the_cause_is_gone(
    manager: ProcessManager, tmp_path: Path, recorder: Recorder
) -> None:
    marker = tmp_path / "broken"
    policy = RestartPolicy(max_retries=20, backoff_base_s=0.2, backoff_max_s=0.8, stable_after_s=30.0)
    backend = add(manager, Server("standin"), "uds", "--fail-if-exists", str(marker), policy=policy)
    address = await backend.ensure_ready()
    marker.touch()
    spawned: list[float] = []

    def note(news: Transition) -> None:
        if news.new is State.STARTING:
            spawned.append(time.monotonic())

    manager.subscribe(Transition, note)
    await Server("standin").send_fault(address, "crash", timeout_s=10.0)
    await eventually(lambda: backend.failures >= 6, 60.0, "six failures in a row")
    assert recorder.backoffs[:6] == pytest.approx([0.0, 0.2, 0.4, 0.8, 0.8, 0.8], abs=0.02)
    gaps = [b - a for a, b in zip(spawned, spawned[1:], strict=False)]
    for gap, delay in zip(gaps, [0.2, 0.4, 0.8, 0.8], strict=False):
        assert gap >= delay * 0.95, (gaps, "a relaunch came before its backoff delay")
    assert "cannot start" in (backend.last_error or "")
    marker.unlink()
    await eventually(lambda: backend.state is State.READY, 30.0, "recovery once the cause is gone")
    assert backend.failures >= 6  # the count only resets after stable_after_s of uptime
    assert await HttpProber().probe(await backend.ensure_ready(), "/health", 5.0)


async def test_start_that_exits_reports_code_and_log_at_once(manager: ProcessManager, tmp_path: Path) -> None:
    marker = tmp_path / "broken"
    marker.touch()
    backend = add(manager, Server("standin"), "uds", "--fail-if-exists", str(marker), startup_timeout_s=600.0)
    with pytest.raises(StartFailed) as caught:
        await backend.ensure_ready()  # the 600 s deadline is never waited out: the exit ends the wait
    assert caught.value.exit_code == 4
    assert any("cannot start" in line for line in caught.value.log_tail)
    assert "exited with code 4 while starting" in str(caught.value)


async def test_modelserver_that_cannot_load_fails_with_its_reason(manager: ProcessManager, tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    argv = (sys.executable, "-m", "modelserver", "--task", "llm", "--path", str(missing), "--uds", "${SOCKET}")
    backend = manager.add(BackendSpec(name="broken", argv=argv, cwd=str(ROOT), startup_timeout_s=600.0))
    with pytest.raises(StartFailed) as caught:
        await backend.ensure_ready()
    assert caught.value.exit_code not in (0, None)
    assert "nope.gguf" in str(caught.value)


async def test_tcp_port_held_by_another_process_is_skipped(tmp_path: Path) -> None:
    for low in range(random.randrange(40000, 45000, 2), 46000, 2):
        squatter = socket.socket()
        try:
            squatter.bind(("127.0.0.1", low))
        except OSError:
            squatter.close()
            continue
        break
    squatter.listen()
    pm = ProcessManager(tmp_path / "rt", port_range=(low, low + 1))
    try:
        backend = pm.add(BackendSpec(name="t", argv=Server("standin").argv("tcp"), transport="tcp"))
        address = await backend.ensure_ready()
        assert address.port == low + 1
    finally:
        await pm.shutdown()
        squatter.close()


async def test_request_lease_reaches_the_process(manager: ProcessManager) -> None:
    backend = add(manager, Server("standin"), "uds")
    async with backend.request() as lease, client_for(lease.address) as client:
        response = await client.get("/pid")
        assert int(response.text) == lease.pid == backend.pid and backend.in_flight == 1
    assert backend.in_flight == 0 and backend.last_used is not None


async def test_idle_backend_is_stopped_for_real(manager: ProcessManager, recorder: Recorder) -> None:
    backend = add(manager, Server("standin"), "uds", idle_timeout_s=0.3)
    async with backend.request():
        pass
    pid = backend.pid
    assert pid is not None
    await eventually(lambda: backend.state is State.STOPPED, 30.0, "idle stop")
    assert gone(pid) and recorder.stops == [(backend.name, "idle")]
    await backend.ensure_ready()  # and the next request cold-starts it again
    assert backend.pid not in (None, pid) and os.path.exists(str(backend.address.path if backend.address else ""))


def test_under_uvloop_ready_crash_relaunch_and_stop(tmp_path: Path) -> None:
    """The router runs under uvicorn's uvloop: spawning, exit notice and stop must work there too."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> tuple[int, int, int | None]:
        pm = ProcessManager(tmp_path / "rt")
        try:
            backend = pm.add(BackendSpec(name="u", argv=Server("standin").argv("uds"), health_interval_s=3600.0))
            address = await backend.ensure_ready()
            first = backend.pid
            assert first is not None
            await Server("standin").send_fault(address, "crash", timeout_s=10.0)
            await eventually(lambda: backend.generation == 2 and backend.state is State.READY, 30.0, "relaunch")
            second = backend.pid
            assert second is not None
            await backend.stop()
            return first, second, backend.exit_code
        finally:
            await pm.shutdown()

    first, second, code = uvloop.run(scenario())
    assert first != second and gone(first) and gone(second) and code == -signal.SIGTERM


class NeverReady:
    """A prober that never sees a 200: only the process's own announcement can end its start."""

    async def check(self, address: Address, path: str, timeout_s: float, method: str = "GET") -> tuple[int, bytes]:
        return 503, b""


async def test_model_server_announces_readiness_over_its_output_pipe(tmp_path: Path) -> None:
    low = random.randrange(30000, 39000, 50)
    pm = ProcessManager(tmp_path / "rt", port_range=(low, low + 49), prober=NeverReady())
    try:
        backend = pm.add(
            BackendSpec(
                name="announcer", argv=Server("modelserver").argv("uds"), cwd=str(ROOT), announces_ready=True,
                startup_timeout_s=60.0, health_interval_s=0.0,  # the prober never answers: no probe once ready
            )
        )  # fmt: skip
        address = await backend.ensure_ready()
        assert backend.state is State.READY
        assert await HttpProber().probe(address, "/health", 10.0)  # announced only once it really serves
        assert any(line.startswith("ovrouter-ready ") for line in backend.logs.tail())
        pid = backend.pid
    finally:
        await pm.shutdown()
    assert pid is not None and gone(pid)
