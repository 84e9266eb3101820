"""Memory end to end over real fake-engine processes (``fake.memory_mb`` sizes them): sizes measured from a
real process's ``/health`` and remembered under ``state_dir``, rolling and stop-first changes under load.
The budget's decisions (evictions, ``min_residency_s``, waiting for room, a model that can never fit) are
tested in-process: tests/test_router_memory_inprocess.py, with :class:`EvictionCheck` below, which checks
each eviction when it happens (a subscriber of procman's notices): the victim is idle, the least recently
used of the idle models old enough to go, and loaded at least ``min_residency_s``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from modelserver.spec import SPEC_ENV
from procman import Evicted, State
from tests.router_fakes import FakeRouter
from tests.router_helpers import RunningRouter, fake_model, running_router, write_config
from tests.test_router_proxy import alive, chat, wait_for
from tests.test_router_reload import rewrite

pytestmark = pytest.mark.timeout(120)

MIB = 1024 * 1024


def sized(memory_mb: int, **extra: Any) -> dict[str, Any]:
    fake = {"load_s": 0.05, "token_delay_s": 0.002, "memory_mb": memory_mb, **extra.pop("fake", {})}
    return fake_model(fake=fake, **extra)


class EvictionCheck:
    """A subscriber of procman's Evicted notices that checks every eviction against the policy when it happens."""

    def __init__(self, router: RunningRouter | FakeRouter) -> None:
        self.router = router
        self.evicted: list[str] = []
        self.problems: list[str] = []

    def check(self, news: Evicted) -> None:
        manager = self.router.service.registry.manager
        backend, target = manager.backends[news.name], news.target
        now = manager._runtime.clock()
        claim = manager.claims(backend.name) if manager.claims else None
        self.evicted.append(backend.name)
        if not backend.is_idle():
            self.problems.append(f"{backend.name} was evicted while busy")
        ready_at = backend.counters.ready_at or 0.0
        if claim is not None and now - ready_at < claim.min_residency_s:
            self.problems.append(f"{backend.name} was evicted {now - ready_at:.2f}s after it loaded")
        others = [b for b in manager.backends.values()
                  if b is not backend and b.is_idle() and b.name != target
                  and now - (b.counters.ready_at or 0.0) >= (manager.claims(b.name).min_residency_s if manager.claims
                                                               else 0)]
        older = [b.name for b in others if (b.last_used or 0.0) < (backend.last_used or 0.0)]
        if older:
            self.problems.append(f"{backend.name} was evicted before the less recently used {older}")


async def ask(router: RunningRouter, name: str, text: str = "hello there") -> int:
    return (await router.client.post("/v1/chat/completions", json=chat(name, text))).status_code


async def test_sizes_are_measured_and_remembered_under_state_dir(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"m": sized(123)}, router={"memory_budget": "auto"})
    async with running_router(path) as router:
        assert await ask(router, "m") == 200
        store = router.service.registry.residency.store
        await wait_for(lambda: "m" in store.models, 60, "a measurement of m")
        row = next(r for r in (await router.client.get("/api/models")).json()["models"] if r["name"] == "m")
        assert row["memory"]["source"] == "measured" and row["memory"]["bytes"] == 123 * MIB
        assert row["memory"]["reported"]["fake"] is True
    saved = json.loads((tmp_path / "state" / "memory.json").read_text())
    assert saved["models"]["m"]["peak_bytes"] == 123 * MIB


async def steady_load(router: RunningRouter, name: str, stop: asyncio.Event, statuses: list[int]) -> None:
    async def client(index: int) -> None:
        for count in itertools.count():
            if stop.is_set():
                return
            statuses.append(await ask(router, name, f"client {index} request {count}"))

    await asyncio.gather(*(client(i) for i in range(4)))


async def change_under_load(router: RunningRouter, name: str, change: Any) -> tuple[int, int, list[int]]:
    """Run a steady load on ``name``, apply ``change``, wait for a new pid; (old pid, new pid, statuses)."""
    assert await ask(router, name) == 200
    old = router.backend(name).pid
    stop, statuses = asyncio.Event(), []
    load = asyncio.create_task(steady_load(router, name, stop, statuses))
    await wait_for(lambda: len(statuses) >= 10, 60, "the steady load to run")
    await change()
    await wait_for(lambda: router.backend(name).pid not in (None, old), 60, "a new process")
    served = len(statuses)
    await wait_for(lambda: len(statuses) >= served + 10, 60, "requests on the new process")
    stop.set()
    await load
    return old, router.backend(name).pid, statuses


async def test_a_rolling_reload_under_load_fails_no_request(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"m": sized(300)}, router={"memory_budget": {"CPU": "1GiB"}})
    async with running_router(path) as router:
        async def reload() -> None:
            rewrite(path, lambda d: d["models"]["m"]["fake"].update(token_delay_s=0.001))
            assert (await router.client.post("/api/reload")).json()["diff"]["changed"] == ["m"]

        old, new, statuses = await change_under_load(router, "m", reload)
        assert set(statuses) == {200} and new != old
        await wait_for(lambda: not alive(old), 60, "the old process to exit")


async def test_a_rolling_restart_under_load_fails_no_request(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"m": sized(300)})
    async with running_router(path) as router:
        async def restart() -> None:
            assert (await router.client.post("/api/models/m/restart")).status_code == 200

        async with router.service.events.subscribe({"rolling", "state"}) as events:
            old, new, statuses = await change_under_load(router, "m", restart)
            seen = [await events.get() for _ in range(events.pending())]
        assert set(statuses) == {200} and new != old
        assert [e.data["phase"] for e in seen if e.kind == "rolling"] == ["starting", "switched"]
        assert any(e.kind == "state" and e.data["pid"] == new for e in seen)  # the dashboard learns the new pid
        await wait_for(lambda: not alive(old), 60, "the old process to exit")


async def test_too_small_a_budget_for_both_is_stop_first_and_clients_wait(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"m": sized(600)}, router={"memory_budget": {"CPU": "1GiB"}})
    async with running_router(path) as router:
        async def reload() -> None:
            rewrite(path, lambda d: d["models"]["m"]["fake"].update(token_delay_s=0.001))
            await router.client.post("/api/reload")

        old, new, statuses = await change_under_load(router, "m", reload)
        assert set(statuses) == {200} and new != old
        assert not alive(old), "stop-first: the old process is gone before the new one serves"


async def test_a_failed_new_process_leaves_the_old_one_serving(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"m": sized(100)})
    async with running_router(path) as router:
        assert await ask(router, "m") == 200
        old = router.backend("m").pid
        rewrite(path, lambda d: d["models"]["m"]["fake"].update(fail_load="the new weights are corrupt"))
        await router.client.post("/api/reload")
        residency = router.service.registry.residency
        await wait_for(lambda: "m" in residency.rolling_errors, 60, "the failed rolling change")
        assert "the new weights are corrupt" in residency.rolling_errors["m"]
        assert await ask(router, "m") == 200 and router.backend("m").pid == old
        row = next(r for r in (await router.client.get("/api/models")).json()["models"] if r["name"] == "m")
        assert "old one keeps serving" in row["rolling_error"]


async def test_an_unload_during_a_rolling_change_wins(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"m": sized(100, fake={"load_s": 1.0})})
    async with running_router(path) as router:
        assert await ask(router, "m") == 200
        backend = router.backend("m")
        rewrite(path, lambda d: d["models"]["m"]["fake"].update(token_delay_s=0.001))
        await router.client.post("/api/reload")
        manager = router.service.registry.manager
        await wait_for(lambda: len(manager.holders()) == 2, 60, "the new process to start beside the old one")
        assert (await router.client.post("/api/models/m/unload")).status_code == 200
        await wait_for(lambda: json.loads(backend.spec.env[SPEC_ENV])["fake"]["token_delay_s"] == 0.001, 60,
                       "the change to be kept for the next start")
        await wait_for(lambda: manager.holders() == [], 60, "both processes to be gone")
        assert router.backend("m") is backend and backend.state is State.STOPPED
        assert await ask(router, "m") == 200  # a cold start of the new spec
