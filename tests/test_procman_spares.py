"""Spare interpreters (procman.spare, ``python -m modelserver --spare``) as real processes on the fake engine:
the hand-over (readiness still over the pipe), a new spare behind a taken one, a spare that dies or is stale
is replaced, a config change retires them, a different environment starts fresh, the memory budget counts
them and stops them first, and none outlives the manager or a SIGKILLed router."""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import procman.spare
from procman import BackendSpec, HttpProber, ProcessManager, SparePool, SpareSpec, State, SubprocessSpawner
from procman.placement import Claim
from procman.process import READY_ENV
from tests.modelserver_helpers import free_port
from tests.router_helpers import fake_model, write_config
from tests.test_procman_real import NeverReady, eventually, gone
from tests.test_router_process import router_process

pytestmark = [pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parent.parent
MODELSERVER = (sys.executable, "-m", "modelserver")
#: the hand-over of modelserver.spare without its OpenVINO imports, for the tests of the pool around it
LIGHT = (sys.executable, str(Path(__file__).resolve().parent / "procs" / "light_spare.py"))


def spare_spec(real: bool = False, **fields: Any) -> SpareSpec:
    return SpareSpec(argv=(*MODELSERVER, "--spare") if real else LIGHT, serves=MODELSERVER, cwd=str(ROOT),
                     late_env=frozenset({READY_ENV}), **fields)


def fake(name: str, **fields: Any) -> BackendSpec:
    return BackendSpec(name=name, argv=(*MODELSERVER, "--engine", "fake", "--name", name, "--uds", "${SOCKET}"),
                       cwd=str(ROOT), announces_ready=True, startup_timeout_s=60.0, health_interval_s=0.0, **fields)


def ready_pids(pool: SparePool) -> list[int]:
    return [s.handle.pid for s in pool.spares if s.ready and not s.going]


@pytest.fixture(autouse=True)
def quick_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procman.spare, "RETRY_S", 0.05)
    monkeypatch.setattr(procman.spare, "REFILL_DELAY_S", 0.05)


@pytest.fixture
async def pool(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[tuple[ProcessManager, SparePool]]:
    spares = SparePool(SubprocessSpawner(), spare_spec(real=getattr(request, "param", False)))
    low = random.randrange(30000, 39000, 50)
    pm = ProcessManager(tmp_path / "rt", port_range=(low, low + 49), spawner=spares, prober=NeverReady())
    try:
        yield pm, spares
    finally:
        pids = [s.handle.pid for s in spares.spares] + [b.pid for b in pm.backends.values() if b.pid is not None]
        await pm.shutdown()
        assert not spares.spares and all(gone(pid) for pid in pids)


@pytest.mark.parametrize("pool", [True], indirect=True)  # the real python -m modelserver --spare
async def test_a_cold_start_takes_the_spare_announces_over_the_pipe_and_a_new_spare_follows(
    pool: tuple[ProcessManager, SparePool],
) -> None:
    pm, spares = pool
    first, second = pm.add(fake("a")), pm.add(fake("b"))
    spares.start()
    await eventually(lambda: len(ready_pids(spares)) == 1, 60.0, "a spare past its imports")
    spare = ready_pids(spares)[0]
    address = await first.ensure_ready()  # the prober never answers: only the readiness line ends the start
    assert first.state is State.READY and first.pid == spare and spares.taken == 1
    assert await HttpProber().probe(address, "/health", 10.0)
    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=address.path), base_url="http://m") as client:
        marks = (await client.get("/health")).json()["startup"]
        answer = await client.post("/v1/chat/completions", json={"model": "a", "messages": [
            {"role": "user", "content": "hello"}]})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    assert marks["spare"] < marks["assigned"] == marks["process"] <= marks["imports"] <= marks["loaded"]
    assert any(line.startswith("ovrouter-ready ") for line in first.logs.tail())
    shown = Path(f"/proc/{spare}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert "-m modelserver" in shown and "--name a " in shown and "--spare" not in shown, shown  # what ps shows
    # b is still stopped: a new spare starts behind the taken one, and b's start takes it
    await eventually(lambda: len(ready_pids(spares)) == 1, 60.0, "the next spare")
    behind = ready_pids(spares)[0]
    assert behind != spare
    await second.ensure_ready()
    assert second.pid == behind and spares.taken == 2 and spares.fresh == 0
    await eventually(lambda: not spares.spares, 30.0, "no spare once no model is stopped")  # nothing would take it
    await first.stop()
    await eventually(lambda: len(ready_pids(spares)) == 1, 60.0, "a spare once a model stopped")


async def test_a_spare_that_dies_is_replaced(pool: tuple[ProcessManager, SparePool]) -> None:
    pm, spares = pool
    pm.add(fake("a"))
    spares.start()
    await eventually(lambda: len(ready_pids(spares)) == 1, 60.0, "a spare")
    dead = ready_pids(spares)[0]
    os.kill(dead, signal.SIGKILL)
    await eventually(lambda: ready_pids(spares) not in ([], [dead]), 60.0, "a replacement")
    assert gone(dead) and len(spares.spares) == 1


async def test_a_stale_spare_is_killed_and_the_start_is_fresh(tmp_path: Path) -> None:
    code = tmp_path / "code.py"
    code.write_text("x = 1\n")
    spares = SparePool(SubprocessSpawner(), spare_spec(watch_trees=(str(tmp_path),)))
    pm = ProcessManager(tmp_path / "rt", spawner=spares, prober=NeverReady())
    try:
        backend = pm.add(fake("a"))
        spares.start()
        await eventually(lambda: len(ready_pids(spares)) == 1, 60.0, "a spare")
        stale = ready_pids(spares)[0]
        code.write_text("x = 22\n")  # the code changed since the spare imported it
        await backend.ensure_ready()
        assert backend.pid != stale and spares.fresh == 1 and spares.taken == 0
        await eventually(lambda: gone(stale), 30.0, "the stale spare killed")
        await backend.stop()
        await eventually(lambda: len(ready_pids(spares)) == 1, 60.0, "a spare of the new code")
        assert ready_pids(spares)[0] != stale
    finally:
        await pm.shutdown()


async def test_a_spare_stopped_by_sigstop_is_killed_and_the_start_is_fresh(
    pool: tuple[ProcessManager, SparePool],
) -> None:
    # taken, a stopped spare hung the cold start until startup_timeout_s (180 s by default)
    pm, spares = pool
    backend = pm.add(fake("a"))
    spares.start()
    await eventually(lambda: len(ready_pids(spares)) == 1, 60.0, "a spare")
    stopped = ready_pids(spares)[0]
    os.kill(stopped, signal.SIGSTOP)
    await eventually(lambda: spares.spares[0].handle.stopped(), 30.0, "the spare stopped")  # type: ignore[attr-defined]
    await backend.ensure_ready()
    assert backend.pid != stopped and spares.fresh == 1 and spares.taken == 0
    await eventually(lambda: gone(stopped), 30.0, "the stopped spare killed")


async def test_a_config_change_retires_the_spares_and_count_0_keeps_none(pool: tuple[ProcessManager, SparePool],
                                                                        ) -> None:
    pm, spares = pool
    pm.add(fake("a"))
    spares.start()
    await eventually(lambda: len(ready_pids(spares)) == 1, 60.0, "a spare")
    old = ready_pids(spares)[0]
    spares.configure(spare_spec())  # the same settings: kept
    spares.configure(spare_spec(count=2))  # only the count: kept (one model stopped wants one spare)
    assert ready_pids(spares) == [old]
    spares.configure(spare_spec(env={"OVROUTER_EXAMPLE": "1"}))
    await eventually(lambda: gone(old) and len(ready_pids(spares)) == 1, 60.0, "a spare of the new settings")
    new = ready_pids(spares)[0]
    spares.configure(spare_spec(count=0))
    await eventually(lambda: gone(new) and not spares.spares, 30.0, "no spare")


async def test_an_environment_of_its_own_starts_fresh_and_leaves_the_spare(
    pool: tuple[ProcessManager, SparePool],
) -> None:
    pm, spares = pool
    own = pm.add(fake("own", env={"OVROUTER_EXAMPLE": "1"}))  # read at any time: only a fresh process is the same
    pm.add(fake("b"))
    spares.start()
    await eventually(lambda: len(ready_pids(spares)) == 1, 60.0, "a spare")
    spare = ready_pids(spares)[0]
    await own.ensure_ready()
    assert own.pid != spare and spares.fresh == 1 and ready_pids(spares) == [spare]


async def test_the_memory_budget_counts_a_spare_and_stops_it_first(pool: tuple[ProcessManager, SparePool]) -> None:
    pm, spares = pool
    budget = {"CPU": 1 << 40}
    pm.budgets = lambda: budget
    pm.claims = lambda name: Claim("CPU", 64 << 20)
    backend = pm.add(fake("a", env={"OVROUTER_EXAMPLE": "1"}))  # starts fresh: the spare stays a spare
    spares.start()
    await eventually(lambda: len(ready_pids(spares)) == 1, 60.0, "a spare")
    spare = ready_pids(spares)[0]
    held = pm.memory()["CPU"]["used_bytes"]
    assert held == spares.spares[0].size_bytes > 1 << 20  # its measured resident memory
    budget["CPU"] = held + (64 << 20) - 1  # the model fits only without the spare
    await backend.ensure_ready()
    assert gone(spare) and not spares.spares  # and no spare is started where it does not fit
    assert spares.snapshot()["spares"] == []


def router_spares(port: int, count: int, timeout_s: float = 60.0) -> list[int]:
    """The router's spare pids once exactly ``count`` are listed, all past their imports."""
    deadline = time.monotonic() + timeout_s
    while True:
        listed = (httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=5).json()["spares"] or {}).get("spares", [])
        if len(listed) == count and all(spare["ready"] for spare in listed):
            return [spare["pid"] for spare in listed]
        if time.monotonic() > deadline:
            raise AssertionError(f"the router did not settle at {count} spare(s): {listed}")
        time.sleep(0.05)


def test_a_reload_to_0_retires_the_spare_and_back_to_1_starts_one(tmp_path: Path) -> None:
    port = free_port()
    config = write_config(tmp_path, {"a": fake_model()}, router={"spare_interpreters": 1})
    with router_process(config, port):
        [first] = router_spares(port, 1)
        for count in (0, 1):
            write_config(tmp_path, {"a": fake_model()}, router={"spare_interpreters": count})
            assert httpx.post(f"http://127.0.0.1:{port}/api/reload", timeout=30).status_code == 200
            if count == 0:
                router_spares(port, 0)
                deadline = time.monotonic() + 30
                while not gone(first) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert gone(first), "the retired spare is still running"
        [second] = router_spares(port, 1)
        assert second != first


def test_no_spare_outlives_a_sigkilled_router(tmp_path: Path) -> None:
    port = free_port()
    config = write_config(tmp_path, {"a": fake_model()}, router={"spare_interpreters": 1})
    with router_process(config, port) as proc:
        spares = router_spares(port, 1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        deadline = time.monotonic() + 30
        while not all(gone(pid) for pid in spares) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(gone(pid) for pid in spares), "a spare interpreter outlived a SIGKILLed router"


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as environ:
        pairs = (entry.decode(errors="replace").partition("=") for entry in environ.read().split(b"\0") if entry)
        return {key: value for key, _, value in pairs}


def test_a_model_with_its_own_environment_starts_fresh_with_it_and_the_others_take_the_spare(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a variable read at the interpreter's start (glibc reads MALLOC_ARENA_MAX then) would be lost on a spare
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    port = free_port()
    models = {"a": fake_model(), "own": fake_model(env={"MALLOC_ARENA_MAX": "2"})}
    config = write_config(tmp_path, models, router={"spare_interpreters": 1})
    with router_process(config, port):
        [spare] = router_spares(port, 1)
        assert "MALLOC_ARENA_MAX" not in _environ(spare)  # no default of ovrouter's own (it cost ~6% tokens/s)
        assert httpx.post(f"http://127.0.0.1:{port}/api/models/own/load", timeout=60).status_code == 200
        rows = httpx.get(f"http://127.0.0.1:{port}/api/models", timeout=5).json()["models"]
        own = next(row["pid"] for row in rows if row["name"] == "own")
        assert own != spare and _environ(own)["MALLOC_ARENA_MAX"] == "2"
        assert httpx.post(f"http://127.0.0.1:{port}/api/models/a/load", timeout=60).status_code == 200
        rows = httpx.get(f"http://127.0.0.1:{port}/api/models", timeout=5).json()["models"]
        assert next(row["pid"] for row in rows if row["name"] == "a") == spare  # the spare became it


def test_router_spare_interpreters_becomes_the_pools_settings(tmp_path: Path) -> None:
    from modelserver.spec import SPEC_ENV
    from router.config import load_config
    from router.state.launch import backend_spec
    from router.state.launch import spare_spec as router_spare_spec

    config = load_config(write_config(tmp_path, {"a": fake_model()}, router={"spare_interpreters": 2}))
    spec = router_spare_spec(config)
    model = backend_spec(config.models["a"], config.router, config.path)
    assert spec is not None and spec.count == 2 and spec.argv == (*spec.serves, "--spare", "--warm", "fake:llm")
    assert model.argv is not None and model.argv[:len(spec.serves)] == spec.serves and model.cwd == spec.cwd
    assert {SPEC_ENV, READY_ENV} <= spec.late_env and spec.device == "CPU"
    assert any(tree.endswith("modelserver") for tree in spec.watch_trees) and sys.executable in spec.watch
    assert router_spare_spec(load_config(write_config(tmp_path, {"a": fake_model()}))) is None  # the helper's 0
    ray = {"spare_interpreters": 1, "engine": {"kind": "ray"}}
    assert router_spare_spec(load_config(write_config(tmp_path, {"a": fake_model()}, router=ray))) is None
