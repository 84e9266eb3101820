"""No innocent request lost to a poison one (router/path/recovery.py's suspect lane, router/path/blame.py's rule),
in-process over fakes: a poison request crashes every process it reaches; the requests caught beside it
are retried one at a time, so they are served and the poison one is named — also when the death lands
in an unload's drain, a rolling or stop-first restart, or an eviction. Every test is bounded: nothing
waits forever."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from router.edge.httpclient import UpstreamError
from router.path import recovery
from router.state.lane import SuspectLane
from tests.router_fakes import Call, Exchange, FakeReply, FakeRouter, chat, echo, fake_router

pytestmark = pytest.mark.timeout(30)

BOUND_S = 10.0
POISON = "[[crash]]"


def model(**overrides: object) -> dict[str, object]:
    return {"engine": "fake", "loading_progress": "off", "backoff_base_s": 0, **overrides}


class PoisonServer:
    """A fake model server: clean requests take ``hold_s`` (so several are in flight together); a poison
    request makes its process exit with status 86 (a crash of its own, not a signal from outside), and
    every request in flight in that process sees the connection drop."""

    def __init__(self, router: FakeRouter, hold_s: float = 0.2) -> None:
        self.router, self.hold_s = router, hold_s
        self.sent: dict[str, int] = {}  # text -> times it reached a process
        self.in_flight = 0

    async def __call__(self, call: Call) -> FakeReply:
        assert call.proc is not None
        self.sent[call.text] = self.sent.get(call.text, 0) + 1
        if POISON in call.text:
            await asyncio.sleep(0.02)  # the neighbours are in flight when it strikes
            call.proc.exit(86)
            raise UpstreamError("backend closed the connection")
        self.in_flight += 1
        try:
            exited = asyncio.ensure_future(call.proc.wait())
            await asyncio.wait({exited}, timeout=self.hold_s)
            if exited.done():
                raise UpstreamError("backend closed the connection")
            exited.cancel()
            return await echo(call)
        finally:
            self.in_flight -= 1


async def post_all(r: FakeRouter, texts: list[str], model_name: str = "echo") -> list[Exchange]:
    return [await task for task in [asyncio.ensure_future(r.post("/v1/chat/completions", chat(model_name, t)))
                                    for t in texts]]


async def until(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(BOUND_S):
        while not predicate():
            await asyncio.sleep(0.005)


def assert_served(replies: list[Exchange], texts: list[str]) -> None:
    for reply, text in zip(replies, texts, strict=True):
        assert reply.status == 200, (text, reply.body)
        assert reply.json()["choices"][0]["message"]["content"] == text


def assert_named(reply: Exchange) -> None:
    assert reply.status == 502 and reply.json()["error"]["code"] == "request_crashed_model", reply.body


async def test_two_innocents_and_a_poison_the_innocents_are_served_the_poison_named(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r:
        server = r.upstream.handler = PoisonServer(r)
        clean = ["first innocent", "second innocent"]
        innocents = asyncio.ensure_future(post_all(r, clean))
        await until(lambda: server.in_flight == 2)
        poison = await asyncio.wait_for(r.post("/v1/chat/completions", chat("echo", f"bad {POISON}")), BOUND_S)
        assert_served(await asyncio.wait_for(innocents, BOUND_S), clean)
        assert_named(poison)  # its retry ran alone in the suspect lane and took that process down alone
        assert server.sent[f"bad {POISON}"] == 2 and all(server.sent[t] == 2 for t in clean)
        assert r.backend("echo").failures == 0  # a poison request's deaths count no failure toward backoff


async def test_a_poison_request_alone_is_named_at_once_and_sent_once(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r:
        server = r.upstream.handler = PoisonServer(r)
        assert_named(await asyncio.wait_for(r.post("/v1/chat/completions", chat("echo", POISON)), BOUND_S))
        assert server.sent[POISON] == 1
        assert_served(await post_all(r, ["next"]), ["next"])


async def _unload(r: FakeRouter) -> Any:
    return await r.post("/api/models/echo/unload")


async def _restart(r: FakeRouter) -> Any:
    return await r.post("/api/models/echo/restart")


async def _reload(r: FakeRouter) -> Any:
    """A reload that changes what the process runs, stop-first: drain, stop, start the new spec."""
    backend = r.backend("echo")
    assert backend.spec.argv is not None
    await backend.update(dataclasses.replace(backend.spec, argv=(*backend.spec.argv, "--changed")))
    return Exchange(status=200)


CHANGES: dict[str, tuple[dict[str, object], Callable[[FakeRouter], Awaitable[Any]]]] = {
    "unload drain": (model(), _unload),
    "rolling restart": (model(), _restart),
    "stop-first reload drain": (model(restart="stop-first"), _reload),
}


@pytest.mark.parametrize("change", list(CHANGES))
async def test_a_poison_request_during_a_drain_takes_no_innocent_down(tmp_path: Path, change: str) -> None:
    spec, act = CHANGES[change]
    async with fake_router(tmp_path, {"echo": spec}) as r:
        server = r.upstream.handler = PoisonServer(r, hold_s=0.3)
        assert_served(await post_all(r, ["warm"]), ["warm"])
        clean = ["innocent one", "innocent two", "innocent three"]
        innocents = asyncio.ensure_future(post_all(r, clean))
        await until(lambda: server.in_flight == 3)
        changing = asyncio.ensure_future(act(r))  # a drain waits for the three (or a new process starts beside)
        poison = asyncio.ensure_future(r.post("/v1/chat/completions", chat("echo", f"bad {POISON}")))
        done, _ = await asyncio.wait({innocents, changing, poison}, timeout=BOUND_S)
        assert len(done) == 3, f"something waited forever ({change})"
        assert_served(innocents.result(), clean)
        assert poison.result().status == 502 and server.sent[f"bad {POISON}"] <= 2
        assert changing.result().status == 200
        assert_served(await post_all(r, ["after"]), ["after"])


async def test_a_poison_request_to_a_model_being_evicted_takes_no_innocent_down(tmp_path: Path) -> None:
    models = {"echo": model(group="g"), "other": model(group="g")}
    async with fake_router(tmp_path, models, groups={"g": {"max_loaded": 1}}) as r:
        server = r.upstream.handler = PoisonServer(r, hold_s=0.3)
        assert_served(await post_all(r, ["warm"]), ["warm"])
        evicting = asyncio.ensure_future(post_all(r, ["for the other model"], "other"))  # echo is evicted
        clean = ["innocent one", "innocent two"]
        innocents = asyncio.ensure_future(post_all(r, clean))
        await until(lambda: server.in_flight >= 2)
        poison = asyncio.ensure_future(r.post("/v1/chat/completions", chat("echo", f"bad {POISON}")))
        done, _ = await asyncio.wait({evicting, innocents, poison}, timeout=BOUND_S)
        assert len(done) == 3, "something waited forever"
        assert_served(innocents.result(), clean)
        assert_served(evicting.result(), ["for the other model"])
        assert poison.result().status == 502 and server.sent[f"bad {POISON}"] <= 2


async def test_the_lane_runs_suspects_one_at_a_time_and_holds_new_requests_a_bounded_time() -> None:
    lane, order = SuspectLane(), []
    first_in = asyncio.Event()

    async def suspect(name: str, hold_s: float = 5.0, leave_early: bool = False) -> None:
        async with lane.suspect(hold_s) as leave:
            order.append(f"{name} in")
            first_in.set()
            if leave_early:
                leave()  # its answer began: the next one goes while it finishes
            await asyncio.sleep(0.05)
            order.append(f"{name} out")

    one = asyncio.ensure_future(suspect("a", leave_early=True))
    two = asyncio.ensure_future(suspect("b"))
    await first_in.wait()
    ordinary = asyncio.ensure_future(lane.ordinary(bound_s=5.0))
    await asyncio.sleep(0)
    assert not ordinary.done() and lane.pending == 2  # new requests wait while suspects are served
    await asyncio.wait_for(asyncio.gather(one, two, ordinary), BOUND_S)
    assert order[:2] == ["a in", "b in"] and lane.pending == 0  # a left early: b did not wait for its end

    stuck = asyncio.ensure_future(suspect("c", hold_s=0.05))  # holds past its bound: the lane goes on anyway
    await asyncio.sleep(0)
    await asyncio.wait_for(asyncio.gather(suspect("d"), lane.ordinary(bound_s=0.01)), BOUND_S)
    await stuck


async def test_a_request_whose_cold_start_an_unload_interrupts_waits_for_the_next_start(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r:
        r.harness.spawner.on_spawn = lambda proc: setattr(proc, "healthy", False)  # the start takes its time
        waiting = asyncio.ensure_future(r.post("/v1/chat/completions", chat("echo", "patient")))
        await until(lambda: r.backend("echo").state.value == "starting")
        r.harness.spawner.on_spawn = None
        unload = await asyncio.wait_for(r.post("/api/models/echo/unload"), BOUND_S)  # cuts the start short
        assert unload.status == 200
        reply = await asyncio.wait_for(r.harness.clock.run(waiting, step=0.1), BOUND_S)
        assert_served([reply], ["patient"])  # it waited for the next start instead of a 503
        assert len(r.harness.spawner.procs) == 2 and not r.harness.spawner.procs[0].alive


async def test_a_suspect_caught_again_beside_a_second_poison_goes_again_and_is_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recovery, "ORDINARY_WAIT_S", 0.0)  # new requests go beside the suspects at once
    async with fake_router(tmp_path, {"echo": model()}) as r:
        server = r.upstream.handler = PoisonServer(r, hold_s=0.3)
        clean = ["first innocent", "second innocent"]
        innocents = asyncio.ensure_future(post_all(r, clean))
        await until(lambda: server.in_flight == 2)
        first = asyncio.ensure_future(r.post("/v1/chat/completions", chat("echo", f"one {POISON}")))
        await until(lambda: any(server.sent.get(t, 0) == 2 for t in clean) and server.in_flight == 1)
        # a suspect's retry runs: a second poison arrives beside it and takes that process down too
        second = await asyncio.wait_for(r.post("/v1/chat/completions", chat("echo", f"two {POISON}")), BOUND_S)
        assert_served(await asyncio.wait_for(innocents, BOUND_S), clean)  # a second shared death: again, served
        assert_named(await asyncio.wait_for(first, BOUND_S))
        assert_named(second)  # shared first, then alone in the lane: named
        assert max(server.sent[t] for t in clean) == 3
