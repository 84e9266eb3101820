"""Memory budgets and rolling changes over real fake-engine processes (``fake.memory_mb`` sizes them).

Each eviction is checked when it happens (a subscriber of procman's notices): the victim is idle, the least
recently used of the idle models old enough to go, and loaded at least ``min_residency_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from modelserver.spec import SPEC_ENV
from procman import Evicted, State
from router.statustable import status_table
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

    def __init__(self, router: RunningRouter) -> None:
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


def loaded(router: RunningRouter) -> set[str]:
    return {n for n, m in router.service.registry.models.items() if m.backend.state is State.READY}


@contextlib.asynccontextmanager
async def three_of_four_loaded(tmp_path: Path, min_residency_s: float) -> AsyncIterator[tuple[RunningRouter,
                                                                                                EvictionCheck]]:
    """Four 300 MiB models under a 1 GiB budget, a, b and c loaded (in that order), evictions checked."""
    models = {name: sized(300) for name in "abcd"}
    defaults = {"min_residency_s": min_residency_s}
    path = write_config(tmp_path, models, router={"memory_budget": {"CPU": "1GiB"}}, defaults=defaults)
    async with running_router(path) as router:
        check = EvictionCheck(router)
        router.service.registry.manager.subscribe(Evicted, check.check)
        for name in "abc":
            assert await ask(router, name) == 200
        yield router, check


async def test_four_models_under_a_budget_for_three_evict_the_lru_idle_one(tmp_path: Path) -> None:
    async with three_of_four_loaded(tmp_path, 0) as (router, check):
        assert await ask(router, "a") == 200  # b is now the least recently used
        assert await ask(router, "d") == 200
        assert check.evicted == ["b"] and loaded(router) == {"a", "c", "d"}
        row = next(r for r in (await router.client.get("/api/models")).json()["models"] if r["name"] == "b")
        assert row["last_eviction"]["reason"] == "memory" and row["last_eviction"]["for"] == "d"
        assert row["memory"]["bytes"] == 300 * MIB and row["memory"]["budget_bytes"] == 1024 * MIB

        # concurrent clients over all four: every request answered, every eviction by the policy
        names = itertools.cycle("abcdbdacdcba")
        statuses = await asyncio.gather(*(ask(router, next(names), f"request {i}") for i in range(48)))
        assert set(statuses) == {200}, statuses
        assert not check.problems, check.problems
        assert len(loaded(router)) <= 3
        metrics = (await router.client.get("/metrics")).text
        assert 'ovrouter_evictions_total{reason="memory"}' in metrics
        assert 'ovrouter_memory_budget_bytes{device="CPU"} 1.073741824e+09' in metrics
        memory = (await router.client.get("/api/status")).json()["memory"]["CPU"]
        assert memory["budget_bytes"] == 1024 * MIB and memory["used_bytes"] <= 1024 * MIB


async def test_min_residency_makes_a_start_wait_instead_of_thrashing(tmp_path: Path) -> None:
    async with three_of_four_loaded(tmp_path, 1.5) as (router, check):
        # d must wait for one of a, b, c to have been loaded 1.5 s: it waits, it does not fail
        assert await asyncio.gather(*(ask(router, "d", f"d {i}") for i in range(3))) == [200, 200, 200]
        assert check.evicted == ["a"] and not check.problems, check.problems


async def test_a_start_waiting_for_room_says_so_everywhere_instead_of_starting(tmp_path: Path) -> None:
    async with three_of_four_loaded(tmp_path, 60) as (router, check):  # a, b, c stay young for a minute: d waits
        waiting = asyncio.ensure_future(ask(router, "d"))
        manager = router.service.registry.manager
        await wait_for(lambda: "d" in manager.room_waits(), what="d waiting for room")
        expected = ("waiting for memory: needs 300 MiB, 900 MiB of 1 GiB CPU in use by a (idle), b (idle), c (idle); "
                    "the idle ones are within min_residency_s")
        rows = {r["name"]: r for r in (await router.client.get("/api/models")).json()["models"]}
        assert rows["d"]["state"] == "waiting" and rows["d"]["pid"] is None and rows["d"]["waiting"] == expected
        assert rows["a"]["state"] == "ready" and rows["a"]["waiting"] is None
        status = next(m for m in (await router.client.get("/models")).json()["data"] if m["id"] == "d")["status"]
        assert status["value"] == "loading" and status["waiting"] == expected, status
        assert (await router.client.get("/api/status")).json()["models"]["d"] == "waiting"
        table = status_table(router.service.console.enrich(router.service.models_table()))
        assert any(line.split()[:3] == ["d", "waiting", "-"] and expected in line for line in table.splitlines()), table
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        assert check.evicted == []


async def test_a_model_that_can_never_fit_gets_a_503_naming_the_budget_and_sizes(tmp_path: Path) -> None:
    models = {"big": sized(800), "pinned": sized(300, pin=True)}
    path = write_config(tmp_path, models, router={"memory_budget": {"CPU": "1GiB"}})
    async with running_router(path) as router:
        assert await ask(router, "pinned") == 200
        reply = await router.client.post("/v1/chat/completions", json=chat("big"))
        assert reply.status_code == 503
        message = reply.json()["error"]["message"]
        assert "big needs 800 MiB" in message and "pinned pinned (300 MiB)" in message, message
        assert "memory_budget CPU: 1 GiB" in message, message
        assert router.backend("pinned").state is State.READY


async def test_loading_a_model_that_can_never_fit_through_the_model_apis_is_a_503_and_listed_failed(
        tmp_path: Path) -> None:
    path = write_config(tmp_path, {"huge": sized(2048)}, router={"memory_budget": {"CPU": "1GiB"}})
    async with running_router(path) as router:
        for load in (router.client.post("/models/load", json={"model": "huge"}),
                     router.client.post("/api/models/huge/load")):
            reply = await load
            assert reply.status_code == 503, reply.text
            message = reply.json()["error"]["message"]
            assert "huge needs 2 GiB" in message and "memory_budget CPU: 1 GiB" in message, message
            assert "\n" not in message
        listed = (await router.client.get("/models")).json()["data"]
        status = next(m for m in listed if m["id"] == "huge")["status"]
        assert status["value"] == "failed" and "memory_budget CPU: 1 GiB" in status["last_error"], status
        row = next(r for r in (await router.client.get("/api/models")).json()["models"] if r["name"] == "huge")
        assert "memory_budget CPU: 1 GiB" in row["last_error"], row
        assert router.backend("huge").state is State.STOPPED


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
        old = router.backend("m")
        rewrite(path, lambda d: d["models"]["m"]["fake"].update(token_delay_s=0.001))
        await router.client.post("/api/reload")
        manager = router.service.registry.manager
        await wait_for(lambda: "m (new)" in [h.name for h in manager.holders()], 60, "the new process to start")
        assert (await router.client.post("/api/models/m/unload")).status_code == 200
        await wait_for(lambda: json.loads(old.spec.env[SPEC_ENV])["fake"]["token_delay_s"] == 0.001, 60,
                       "the change to be kept for the next start")
        assert "m (new)" not in [h.name for h in manager.holders()]
        assert router.backend("m") is old and old.state is State.STOPPED
        assert await ask(router, "m") == 200  # a cold start of the new spec
