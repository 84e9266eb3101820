"""Memory budgets in-process (the router app, procman under fakes, a fake upstream): evictions by the
policy, ``min_residency_s`` making a start wait, a start waiting for room said everywhere, a model that can
never fit. Sizes come from each model's ``fake.memory_mb`` (what the router counts before any
measurement), so no process is needed. Moved from tests/test_router_memory.py with their assertions;
that file keeps the end-to-end proofs (sizes measured from real processes and remembered, rolling and
stop-first changes under load). Every eviction is checked when it happens (its ``EvictionCheck``)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from procman import Evicted, State
from router.statustable import status_table
from tests.router_fakes import FakeRouter, chat, fake_router
from tests.test_router_memory import EvictionCheck

pytestmark = pytest.mark.timeout(30)

MIB = 1024 * 1024
BUDGET = {"memory_budget": {"CPU": "1GiB"}}


def sized(memory_mb: int, **extra: Any) -> dict[str, Any]:
    return {"engine": "fake", "fake": {"memory_mb": memory_mb}, **extra}


async def ask(r: FakeRouter, name: str, text: str = "hello there") -> int:
    return (await r.post("/v1/chat/completions", chat(name, text))).status


def loaded(r: FakeRouter) -> set[str]:
    return {n for n, m in r.service.registry.models.items() if m.backend.state is State.READY}


async def until(predicate: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(10):
        while not predicate():
            await asyncio.sleep(0.005)
    assert predicate(), what


@contextlib.asynccontextmanager
async def ticking(r: FakeRouter, step_s: float = 0.1) -> AsyncIterator[None]:
    """procman's (fake) clock runs meanwhile, ``step_s`` per turn of the loop."""

    async def tick() -> None:
        while True:
            await r.harness.clock.advance(step_s)
            await asyncio.sleep(0.001)

    task = asyncio.ensure_future(tick())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@contextlib.asynccontextmanager
async def three_of_four_loaded(tmp_path: Path, min_residency_s: float) -> AsyncIterator[tuple[FakeRouter,
                                                                                                EvictionCheck]]:
    """Four 300 MiB models under a 1 GiB budget, a, b and c loaded (in that order), evictions checked."""
    models = {name: sized(300, min_residency_s=min_residency_s) for name in "abcd"}
    async with fake_router(tmp_path, models, router=BUDGET) as r:
        check = EvictionCheck(r)
        r.service.registry.manager.subscribe(Evicted, check.check)
        for name in "abc":
            assert await ask(r, name) == 200
        yield r, check


async def test_four_models_under_a_budget_for_three_evict_the_lru_idle_one(tmp_path: Path) -> None:
    async with three_of_four_loaded(tmp_path, 0) as (r, check), r.client() as client:
        assert await ask(r, "a") == 200  # b is now the least recently used
        assert await ask(r, "d") == 200
        assert check.evicted == ["b"] and loaded(r) == {"a", "c", "d"}
        row = next(row for row in (await client.get("/api/models")).json()["models"] if row["name"] == "b")
        assert row["last_eviction"]["reason"] == "memory" and row["last_eviction"]["for"] == "d"
        assert row["memory"]["bytes"] == 300 * MIB and row["memory"]["budget_bytes"] == 1024 * MIB

        # concurrent clients over all four: every request answered, every eviction by the policy
        names = itertools.cycle("abcdbdacdcba")
        statuses = await asyncio.gather(*(ask(r, next(names), f"request {i}") for i in range(48)))
        assert set(statuses) == {200}, statuses
        assert not check.problems, check.problems
        assert len(loaded(r)) <= 3 and len(check.evicted) > 1
        metrics = (await client.get("/metrics")).text
        assert 'ovrouter_evictions_total{reason="memory"}' in metrics
        assert 'ovrouter_memory_budget_bytes{device="CPU"} 1.073741824e+09' in metrics
        memory = (await client.get("/api/status")).json()["memory"]["CPU"]
        assert memory["budget_bytes"] == 1024 * MIB and memory["used_bytes"] <= 1024 * MIB


async def test_min_residency_makes_a_start_wait_instead_of_thrashing(tmp_path: Path) -> None:
    async with three_of_four_loaded(tmp_path, 1.5) as (r, check):
        d = [asyncio.ensure_future(ask(r, "d", f"d {i}")) for i in range(3)]
        await until(lambda: "d" in r.service.registry.manager.room_waits(), "d waiting for room")
        assert check.evicted == [] and not any(t.done() for t in d)  # it waits, it does not fail
        async with ticking(r):  # d must wait for one of a, b, c to have been loaded 1.5 s
            assert await asyncio.gather(*d) == [200, 200, 200]
        assert check.evicted == ["a"] and not check.problems, check.problems


async def test_a_start_waiting_for_room_says_so_everywhere_instead_of_starting(tmp_path: Path) -> None:
    async with three_of_four_loaded(tmp_path, 60) as (r, check), r.client() as client:  # a, b, c stay young: d waits
        waiting = asyncio.ensure_future(ask(r, "d"))
        manager = r.service.registry.manager
        await until(lambda: "d" in manager.room_waits(), "d waiting for room")
        expected = ("waiting for memory: needs 300 MiB, 900 MiB of 1 GiB CPU in use by a (idle), b (idle), c (idle); "
                    "the idle ones are within min_residency_s")
        rows = {row["name"]: row for row in (await client.get("/api/models")).json()["models"]}
        assert rows["d"]["state"] == "waiting" and rows["d"]["pid"] is None and rows["d"]["waiting"] == expected
        assert rows["a"]["state"] == "ready" and rows["a"]["waiting"] is None
        status = next(m for m in (await client.get("/models")).json()["data"] if m["id"] == "d")["status"]
        assert status["value"] == "loading" and status["waiting"] == expected, status
        assert (await client.get("/api/status")).json()["models"]["d"] == "waiting"
        table = status_table(r.service.console.enrich(r.service.models_table()))
        assert any(line.split()[:3] == ["d", "waiting", "-"] and expected in line for line in table.splitlines()), table
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        assert check.evicted == [] and len(r.harness.spawner.procs) == 3  # no process for d


async def test_a_model_that_can_never_fit_gets_a_503_naming_the_budget_and_sizes(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"big": sized(800), "pinned": sized(300, pin=True)}, router=BUDGET) as r:
        assert await ask(r, "pinned") == 200
        reply = await r.post("/v1/chat/completions", chat("big"))
        assert reply.status == 503
        message = reply.json()["error"]["message"]
        assert "big needs 800 MiB" in message and "pinned pinned (300 MiB)" in message, message
        assert "memory_budget CPU: 1 GiB" in message, message
        assert r.backend("pinned").state is State.READY


async def test_loading_a_model_that_can_never_fit_through_the_model_apis_is_a_503_and_listed_failed(
        tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"huge": sized(2048)}, router=BUDGET) as r, r.client() as client:
        for load in (client.post("/models/load", json={"model": "huge"}), client.post("/api/models/huge/load")):
            reply = await load
            assert reply.status_code == 503, reply.text
            message = reply.json()["error"]["message"]
            assert "huge needs 2 GiB" in message and "memory_budget CPU: 1 GiB" in message, message
            assert "\n" not in message
        listed = (await client.get("/models")).json()["data"]
        status = next(m for m in listed if m["id"] == "huge")["status"]
        assert status["value"] == "failed" and "memory_budget CPU: 1 GiB" in status["last_error"], status
        row = next(row for row in (await client.get("/api/models")).json()["models"] if row["name"] == "huge")
        assert "memory_budget CPU: 1 GiB" in row["last_error"], row
        assert r.backend("huge").state is State.STOPPED and r.harness.spawner.procs == []
