"""procman's typed notices (``manager.subscribe``) and ``before_start`` hooks, under a fake spawner and clock."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from procman_fakes import Harness

from procman import (
    Backend,
    BackendUnavailable,
    Evicted,
    Restarted,
    Rolled,
    Scope,
    Started,
    State,
    Stopped,
    Transition,
)

pytestmark = pytest.mark.timeout(30)

KINDS: tuple[type[Any], ...] = (Transition, Started, Restarted, Stopped, Evicted, Rolled)


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = Harness(tmp_path)
    yield harness
    await harness.close()


async def test_every_kind_of_notice_reaches_its_subscribers_once_as_a_frozen_value(h: Harness) -> None:
    h.manager.scopes = lambda name: (Scope("all models", 1, frozenset("ab")),)
    heard: list[Any] = []
    for kind in KINDS:
        h.manager.subscribe(kind, heard.append)
    a, b = h.add("a"), h.add("b")
    await a.ensure_ready()
    await a.restart("manual")
    await b.ensure_ready()  # a is evicted to make room
    await b.stop("unload")
    c = h.add("c")  # outside the scope: room for two of it
    await c.ensure_ready()
    await c.replace(rolling=True)
    kinds = [type(n) for n in heard]
    assert set(kinds) == set(KINDS)
    assert [(n.name, n.target, n.reason) for n in heard if isinstance(n, Evicted)] == [("a", "b", "max_loaded")]
    assert [(n.name, n.reason) for n in heard if isinstance(n, Restarted)] == [("a", "manual"), ("c", "manual")]
    assert [(n.name, n.reason, n.ok) for n in heard if isinstance(n, Started)] == [
        ("a", "cold", True), ("a", "manual", True), ("b", "cold", True), ("c", "cold", True), ("c", "manual", True)]
    assert [(n.name, n.phase) for n in heard if isinstance(n, Rolled)] == [("c", "starting"), ("c", "switched")]
    assert [(n.name, n.reason) for n in heard if isinstance(n, Stopped)] == [("a", "evict"), ("b", "unload")]
    assert [(n.name, n.old, n.new) for n in heard if isinstance(n, Transition)] == h.recorder.transitions
    for notice in heard:
        assert dataclasses.is_dataclass(notice) and not any(isinstance(v, Backend) for v in vars_of(notice))
        with pytest.raises(dataclasses.FrozenInstanceError):
            notice.name = "other"


def vars_of(notice: Any) -> list[Any]:
    return [getattr(notice, f.name) for f in dataclasses.fields(notice)]


async def test_a_transition_carries_the_figures_of_its_moment(h: Harness) -> None:
    heard: list[Transition] = []
    h.manager.subscribe(Transition, heard.append)
    backend = h.add()
    await backend.ensure_ready()
    ready = heard[-1]
    assert (ready.old, ready.new, ready.pid, ready.generation) == (State.STARTING, State.READY, backend.pid, 1)
    await backend.stop()
    assert ready.pid is not None and backend.pid is None  # the value kept what it saw


async def test_a_subscriber_that_raises_is_logged_and_the_others_still_hear(
        h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    first: list[State] = []
    last: list[State] = []

    def broken(news: Transition) -> None:
        raise RuntimeError("metrics are down")

    h.manager.subscribe(Transition, lambda n: first.append(n.new))
    h.manager.subscribe(Transition, broken)
    h.manager.subscribe(Transition, lambda n: last.append(n.new))
    backend = h.add()
    with caplog.at_level(logging.ERROR, logger="procman.notices"):
        await backend.ensure_ready()
    assert first == last == [State.STARTING, State.READY] and backend.state is State.READY
    assert "a subscriber of Transition failed" in caplog.text and "metrics are down" in caplog.text
    h.manager.unsubscribe(Transition, broken)
    caplog.clear()
    await backend.stop()
    assert "failed" not in caplog.text and last[-1] is State.STOPPED


async def test_before_start_hooks_run_in_order_and_the_first_refusal_stops_the_start(h: Harness) -> None:
    calls: list[str] = []

    async def device_check(backend: Backend) -> None:
        calls.append("device")
        if backend.name == "sick":
            raise BackendUnavailable("device GPU.0 is unhealthy")

    async def audit(backend: Backend) -> None:
        calls.append("audit")

    h.manager.add_before_start(device_check)
    h.manager.add_before_start(audit)
    await h.add("well").ensure_ready()
    assert calls == ["device", "audit"]
    with pytest.raises(BackendUnavailable, match="unhealthy"):
        await h.add("sick").ensure_ready()
    assert calls == ["device", "audit", "device"] and len(h.spawner.procs) == 1
