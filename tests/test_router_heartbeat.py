"""The request-level progress watchdog (router/edge/heartbeat.py, modelserver/heartbeat.py): the pure watch, the
HTTP client's handling of interim 102 heartbeats, and the router's answers when they stop (a hang), stand
still (a stall) or keep advancing (a slow but healthy answer), in-process over fakes."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from router.edge.heartbeat import Watch
from router.edge.httpclient import UpstreamError, UpstreamHung
from router.path import recovery
from tests.router_fakes import Call, FakeReply, FakeRouter, chat, echo, fake_router
from tests.test_router_httpclient import Server, backend, get

pytestmark = pytest.mark.timeout(30)

BOUND_S = 10.0
# probes every 0.1 s, 0.1 s timeout, 2 failures: hung after 0.1 * 2 + 0.1 = 0.3 s of silence
QUICK = {"engine": "fake", "loading_progress": "off", "backoff_base_s": 0, "health_interval_s": 0.1,
         "health_timeout_s": 0.1, "health_failures": 2, "stall_timeout_s": 0.5}


# -- the pure watch ------------------------------------------------------------------------------------------


def test_the_silence_a_watch_allows_is_the_silence_the_probes_need() -> None:
    watch = Watch.for_probes(interval_s=2, timeout_s=4, failures=2, stall_s=60)  # the shipped defaults
    assert watch.silent_s == 10 and watch.beat_s == 1 and watch.header() == ("x-ovrouter-heartbeat", "1")


def test_a_watch_is_armed_by_the_first_heartbeat_then_silence_is_a_hang() -> None:
    watch = Watch(silent_s=10, stall_s=60, beat_s=1)
    assert watch.expired(1000.0) is None and not watch.armed  # a server that sends no heartbeat is never judged
    watch.beat(0.0, None)
    assert watch.armed
    assert watch.expired(9.9) is None
    verdict = watch.expired(10.1)
    assert verdict is not None and verdict[0] == "hang"


def test_progress_standing_still_while_alive_is_a_stall_but_a_gap_in_the_beats_counts_nothing() -> None:
    watch = Watch(silent_s=10, stall_s=3, beat_s=1)
    watch.beat(0.0, 5)
    watch.beat(8.0, 5)  # stopped 8 s (SIGSTOP, a long step): no heartbeat in between, not counted as a stall
    assert watch.still_s == 0 and watch.expired(8.5) is None
    for second in range(9, 12):
        watch.beat(float(second), 5)  # alive, one beat a second, the same progress
    assert watch.expired(11.5) is None
    watch.beat(12.0, 5)
    verdict = watch.expired(12.1)
    assert verdict is not None and verdict[0] == "stall"
    watch.beat(12.5, 6)  # it advanced: the count starts again
    assert watch.expired(12.6) is None and watch.still_s == 0


def test_without_progress_figures_only_silence_counts() -> None:
    watch = Watch(silent_s=10, stall_s=1, beat_s=1)
    for second in range(8):
        watch.beat(float(second), None)  # an embedding, a transcription: no pieces of text to count
    assert watch.expired(7.5) is None


# -- the HTTP client: 1xx heartbeats consumed, never relayed ---------------------------------------------------


async def test_interim_responses_feed_the_watch_and_the_answer_is_the_final_response() -> None:
    async def beats(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Server) -> None:
        while await seen.read_request(reader):
            writer.write(b"HTTP/1.1 102 Processing\r\n\r\n")
            for progress in (1, 2):
                writer.write(b"HTTP/1.1 102 Processing\r\nx-progress: %d\r\n\r\n" % progress)
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-answer: yes\r\n\r\nhello")
            await writer.drain()

    async with backend(beats) as (pool, seen):
        for _ in range(2):  # and again on the kept-alive connection
            watch = Watch(silent_s=5, stall_s=5, beat_s=0.01)
            resp = await pool.request("POST", "/x", [], b"{}", head_timeout_s=5, watch=watch)
            try:
                assert resp.status == 200 and resp.header(b"x-answer") == b"yes" and await resp.read(5) == b"hello"
                assert watch.progress == 2 and watch.last_beat is not None
            finally:
                resp.close()
        assert seen.connections == 1
        assert await get(pool) == (200, b"hello")  # no watch asked: the heartbeats are skipped all the same


async def test_heartbeats_that_stop_end_the_wait_as_a_hang() -> None:
    async def wedges(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Server) -> None:
        await seen.read_request(reader)
        writer.write(b"HTTP/1.1 102 Processing\r\n\r\n")
        await writer.drain()
        await reader.read()  # then nothing, as a stopped process

    async with backend(wedges) as (pool, _):
        with pytest.raises(UpstreamHung, match="no heartbeat") as caught:
            await pool.request("POST", "/x", [], b"{}", head_timeout_s=10,
                               watch=Watch(silent_s=0.2, stall_s=5, beat_s=0.05))
        assert caught.value.cause == "hang"


# -- the router, in-process -----------------------------------------------------------------------------------


class Server102:
    """A fake model server that sends heartbeats as the real one does, and answers after ``answer_s``;
    ``mode``: ``advancing`` (progress grows), ``stalled`` (it stands still), ``wedged`` (beats stop at once)."""

    def __init__(self, router: FakeRouter, mode: str, answer_s: float = 1.0) -> None:
        self.router, self.mode, self.answer_s = router, mode, answer_s
        self.seen: list[str] = []

    async def __call__(self, call: Call) -> FakeReply:
        assert call.watch is not None, "the router asks a model server it launched for heartbeats"
        self.seen.append(call.text)
        call.beat()
        if "[[" not in call.text:
            return await echo(call)
        progress, loop = 0, asyncio.get_running_loop()
        until = loop.time() + self.answer_s
        while loop.time() < until:
            await asyncio.sleep(0.02)
            if self.mode == "wedged":
                continue  # no heartbeat: its event loop is blocked
            progress += self.mode == "advancing"
            call.beat(progress)
        return await echo(call)


async def test_a_wedged_process_under_a_lone_request_is_found_by_its_heartbeats_and_the_request_named(
    tmp_path: Path,
) -> None:
    async with fake_router(tmp_path, {"echo": QUICK}) as r:
        server = r.upstream.handler = Server102(r, "wedged", answer_s=BOUND_S)
        reply = await asyncio.wait_for(r.post("/v1/chat/completions", chat("echo", "poison [[hang]]")), BOUND_S)
        assert reply.status == 502 and reply.json()["error"]["code"] == "request_crashed_model", reply.body
        assert server.seen == ["poison [[hang]]"]  # a hang alone: the request is the cause, never sent again
        assert "no heartbeat" in (r.backend("echo").last_error or "")
        after = await r.post("/v1/chat/completions", chat("echo", "next"))
        assert after.status == 200


async def test_a_stalled_generation_is_retried_once_then_named(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": QUICK}) as r:
        server = r.upstream.handler = Server102(r, "stalled", answer_s=BOUND_S)
        reply = await asyncio.wait_for(r.post("/v1/chat/completions", chat("echo", "poison [[stall]]")), BOUND_S)
        assert reply.status == 502 and reply.json()["error"]["code"] == "request_crashed_model", reply.body
        assert server.seen == ["poison [[stall]]"] * 2  # a stall is the device's: one more try, then named
        assert "no progress" in (r.backend("echo").last_error or "")


async def test_a_slow_answer_whose_progress_advances_is_never_killed(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": QUICK}) as r:
        r.upstream.handler = Server102(r, "advancing", answer_s=1.5)  # five times the silence bound, advancing
        reply = await asyncio.wait_for(r.post("/v1/chat/completions", chat("echo", "slow [[long]]")), BOUND_S)
        assert reply.status == 200 and reply.json()["choices"][0]["message"]["content"] == "slow [[long]]"
        assert r.backend("echo").restarts == 0


async def test_a_lone_request_in_a_process_stopped_from_outside_is_retried_and_served(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": QUICK}) as r:
        stopped: list[int] = []

        async def stops_once(call: Call) -> FakeReply:
            assert call.proc is not None
            call.beat()
            if not stopped:  # SIGSTOP: no heartbeat, no answer, and the process is in state T
                stopped.append(call.proc.pid)
                call.proc.sigstopped = True
                await asyncio.sleep(BOUND_S)
            return await echo(call)

        r.upstream.handler = stops_once
        reply = await asyncio.wait_for(r.post("/v1/chat/completions", chat("echo", "innocent")), BOUND_S)
        assert reply.status == 200 and reply.json()["pid"] != stopped[0], reply.body  # served by a fresh process
        assert "no heartbeat" in (r.backend("echo").last_error or "")


async def test_a_model_stopped_from_outside_again_and_again_never_backs_off(tmp_path: Path) -> None:
    """The 30-minute soak's 503s: SIGSTOPs from outside counted toward the backoff like crashes. Each stopped
    process is replaced at once and no failure counted, past max_retries too: every request is served."""
    config = {**QUICK, "max_retries": 1, "backoff_base_s": 30.0}
    async with fake_router(tmp_path, {"echo": config}) as r:
        stopped: dict[str, int] = {}

        async def stopped_under_each_first_try(call: Call) -> FakeReply:
            assert call.proc is not None
            call.beat()
            if call.text not in stopped:  # SIGSTOP: no heartbeat, no answer, no probe answers, state T
                stopped[call.text] = call.proc.pid
                call.proc.sigstopped, call.proc.healthy = True, False
                await asyncio.sleep(BOUND_S)
            return await echo(call)

        r.upstream.handler = stopped_under_each_first_try
        for n in range(4):  # each on the process that served the one before, stopped under it in turn
            reply = await asyncio.wait_for(r.post("/v1/chat/completions", chat("echo", f"innocent {n}")), BOUND_S)
            assert reply.status == 200 and reply.json()["pid"] != stopped[f"innocent {n}"], reply.body
        assert r.backend("echo").failures == 0 and r.backend("echo").restarts >= 4


async def test_only_requests_watched_by_heartbeats_are_listed_among_their_process_s_peers(tmp_path: Path) -> None:
    """The peers of a death are counted by heartbeats: a model without them (health probes off) lists nothing."""
    async with fake_router(tmp_path, {"echo": QUICK, "plain": {**QUICK, "health_interval_s": 0}}) as r:
        listed: dict[str, int] = {}

        def mine(text: str) -> int:  # (other tests' dead requests may linger in the module's table)
            return sum(1 for peers in recovery._ON.values() for job in peers if text.encode() in job.body)

        async def server(call: Call) -> FakeReply:
            listed[call.text] = mine(call.text)
            return await echo(call)

        r.upstream.handler = server
        for model in ("echo", "plain"):
            reply = await r.post("/v1/chat/completions", chat(model, f"peers of {model}"))
            assert reply.status == 200, reply.body
        assert listed == {"peers of echo": 1, "peers of plain": 0} and mine("peers of") == 0


async def _unload(r: FakeRouter) -> int:
    return (await r.post("/api/models/echo/unload")).status


async def _restart(r: FakeRouter) -> int:
    return (await r.post("/api/models/echo/restart")).status


async def _reload(r: FakeRouter) -> int:
    backend = r.backend("echo")
    assert backend.spec.argv is not None
    await backend.update(dataclasses.replace(backend.spec, argv=(*backend.spec.argv, "--changed")))
    return 200


CHANGES = {"unload drain": ({}, _unload), "stop-first reload drain": ({"restart": "stop-first"}, _reload),
           "rolling restart": ({}, _restart)}


@pytest.mark.parametrize("change", list(CHANGES))
async def test_a_request_in_a_sigstopped_process_during_a_drain_is_served(tmp_path: Path, change: str) -> None:
    """Issue 25's H2: in a reload drain, a request to a SIGSTOPped model got a 502 where the same in an unload
    waited and succeeded; both are served now (the hang is from outside: the request goes again)."""
    extra, act = CHANGES[change]
    async with fake_router(tmp_path, {"echo": {**QUICK, **extra}}) as r:
        in_flight = asyncio.Event()
        stopped: list[int] = []

        async def server(call: Call) -> FakeReply:
            assert call.proc is not None
            call.beat()
            if call.text == "innocent" and not stopped:
                in_flight.set()
                await asyncio.sleep(0.2)  # the change begins while it runs
                stopped.append(call.proc.pid)
                call.proc.sigstopped, call.proc.healthy = True, False  # SIGSTOP: no heartbeat, no probe answers
                await asyncio.sleep(BOUND_S)
            return await echo(call)

        r.upstream.handler = server
        assert (await r.post("/v1/chat/completions", chat("echo", "warm"))).status == 200
        request = asyncio.ensure_future(r.post("/v1/chat/completions", chat("echo", "innocent")))
        await asyncio.wait_for(in_flight.wait(), BOUND_S)
        changing = asyncio.ensure_future(act(r))
        done, _ = await asyncio.wait({request, changing}, timeout=BOUND_S)
        assert len(done) == 2, f"something waited forever ({change})"
        reply = request.result()
        assert reply.status == 200 and reply.json()["choices"][0]["message"]["content"] == "innocent", reply.body
        assert reply.json()["pid"] != stopped[0] and changing.result() == 200


async def test_a_request_a_wedged_process_never_began_is_innocent_and_the_poison_named_at_once(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": QUICK}) as r:
        wedged: set[int] = set()
        sent: list[str] = []

        async def server(call: Call) -> FakeReply:
            assert call.proc is not None
            sent.append(call.text)
            if call.proc.pid in wedged:  # its event loop is blocked: not even the first heartbeat goes out
                await silent_until_killed(call)
            call.beat()
            if "[[hang]]" in call.text:
                wedged.add(call.proc.pid)
                await silent_until_killed(call)
            return await echo(call)

        r.upstream.handler = server
        assert (await r.post("/v1/chat/completions", chat("echo", "warm"))).status == 200  # heartbeats heard
        poison = asyncio.ensure_future(r.post("/v1/chat/completions", chat("echo", "poison [[hang]]")))
        await asyncio.wait_for(_until(lambda: bool(wedged)), BOUND_S)
        innocent = await asyncio.wait_for(r.post("/v1/chat/completions", chat("echo", "innocent")), BOUND_S)
        assert innocent.status == 200 and innocent.json()["choices"][0]["message"]["content"] == "innocent"
        named = await asyncio.wait_for(poison, BOUND_S)
        assert named.status == 502 and named.json()["error"]["code"] == "request_crashed_model", named.body
        assert sent.count("innocent") == 2 and sent.count("poison [[hang]]") == 1  # alone among the begun


async def silent_until_killed(call: Call) -> None:
    """Say nothing until the process is killed; then the connection drops, as a real one's does."""
    assert call.proc is not None
    await asyncio.wait_for(call.proc.wait(), BOUND_S)
    raise UpstreamError("backend closed the connection")


async def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


async def test_a_lone_request_to_a_process_wedged_before_it_came_is_retried_not_named(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": QUICK}) as r:
        wedged: set[int] = set()

        async def server(call: Call) -> FakeReply:
            assert call.proc is not None
            if call.proc.pid in wedged:
                await silent_until_killed(call)
            call.beat()
            return await echo(call)

        r.upstream.handler = server
        warm = await r.post("/v1/chat/completions", chat("echo", "warm"))  # its processes send heartbeats
        proc = next(p for p in r.harness.spawner.procs if p.pid == warm.json()["pid"])
        wedged.add(proc.pid)
        proc.healthy = False  # wedged between requests (a driver call that never returned): probes fail too
        asking = r.post("/v1/chat/completions", chat("echo", "innocent"))
        reply = await asyncio.wait_for(r.harness.clock.run(asking, step=0.1), BOUND_S)  # the probes find it
        assert reply.status == 200 and reply.json()["pid"] != proc.pid, reply.body  # it never reached the app



async def test_a_hang_poison_retried_in_its_turn_is_named_though_a_new_request_ran_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recovery, "ORDINARY_WAIT_S", 0.0)  # new requests go beside the suspects at once
    async with fake_router(tmp_path, {"echo": QUICK}) as r:
        wedged: set[int] = set()
        sent: list[str] = []

        async def server(call: Call) -> FakeReply:  # a [[hang]] blocks its process: every request there goes silent
            assert call.proc is not None
            sent.append(call.text)
            call.beat()
            if "[[hang]]" in call.text:
                wedged.add(call.proc.pid)
            for _ in range(10):
                if call.proc.pid in wedged:
                    await silent_until_killed(call)
                await asyncio.sleep(0.02)
                call.beat()
            return await echo(call)

        r.upstream.handler = server
        first = [asyncio.ensure_future(r.post("/v1/chat/completions", chat("echo", t))) for t in ("one", "two")]
        await asyncio.wait_for(_until(lambda: len(sent) == 2), BOUND_S)
        poison = asyncio.ensure_future(r.post("/v1/chat/completions", chat("echo", "poison [[hang]]")))
        await asyncio.wait_for(_until(lambda: sent.count("poison [[hang]]") == 2), BOUND_S)  # its turn came
        beside = await asyncio.wait_for(r.post("/v1/chat/completions", chat("echo", "beside")), BOUND_S)
        assert beside.status == 200, beside.body
        for reply, text in zip(await asyncio.gather(*first), ("one", "two"), strict=True):
            assert reply.status == 200 and reply.json()["choices"][0]["message"]["content"] == text, reply.body
        named = await asyncio.wait_for(poison, BOUND_S)
        assert named.status == 502 and named.json()["error"]["code"] == "request_crashed_model", named.body
        assert sent.count("poison [[hang]]") == 2  # named on the death in its turn: no third process hung


async def test_a_request_two_wedged_processes_never_began_takes_no_try_and_is_served(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": QUICK}) as r:
        to_wedge, wedged = [2], set[int]()

        async def server(call: Call) -> FakeReply:
            assert call.proc is not None
            if call.text != "warm" and to_wedge[0] and call.proc.pid not in wedged:
                to_wedge[0] -= 1  # this process is wedged before the request comes
                wedged.add(call.proc.pid)
                call.proc.healthy = False
            if call.proc.pid in wedged:
                await silent_until_killed(call)
            call.beat()
            return await echo(call)

        r.upstream.handler = server
        assert (await r.post("/v1/chat/completions", chat("echo", "warm"))).status == 200
        asking = r.post("/v1/chat/completions", chat("echo", "innocent"))
        reply = await asyncio.wait_for(r.harness.clock.run(asking, step=0.1), BOUND_S)
        assert reply.status == 200 and reply.json()["pid"] not in wedged and len(wedged) == 2, reply.body
