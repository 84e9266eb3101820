"""Every proxy behaviour in-process, in milliseconds: the real router app, procman under fakes and a
fake upstream (tests/router_fakes.py). test_router_proxy.py keeps the end-to-end proof over real
model-server processes."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest

import router.path.loading
import router.path.recovery
from procman import State
from router.edge.httpclient import UpstreamError, UpstreamTimeout
from tests.router_fakes import Call, FakeReply, chat, echo, fake_router

pytestmark = pytest.mark.timeout(30)

FATAL = (b"x-backend-fatal", b"1")


def model(**overrides: object) -> dict[str, object]:
    return {"engine": "fake", "loading_progress": "off", **overrides}


def fatal_reply() -> FakeReply:
    return FakeReply.json(500, {"error": {"message": "CL_OUT_OF_RESOURCES in step()"}}, headers=[FATAL])


async def test_stream_is_relayed_chunk_by_chunk(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r:
        events = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]

        async def stream(call: Call) -> FakeReply:
            return FakeReply(chunks=events, content_type=b"text/event-stream")

        r.upstream.handler = stream
        reply = await r.post("/v1/chat/completions", chat("echo", stream=True))
        assert reply.status == 200 and reply.chunks == events  # never buffered into one
        assert r.upstream.replies[0].closed and r.backend("echo").in_flight == 0


async def test_unknown_model_is_404_naming_the_known_and_starts_nothing(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r:
        reply = await r.post("/v1/chat/completions", chat("nope"))
        assert reply.status == 404 and "echo" in reply.json()["error"]["message"]
        assert r.harness.spawner.procs == [] and r.upstream.calls == []


async def test_fatal_non_streamed_request_is_retried_once_on_a_fresh_process(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r:
        async def first_fatal(call: Call) -> FakeReply:
            return fatal_reply() if len(r.upstream.calls) == 1 else await echo(call)

        r.upstream.handler = first_fatal
        reply = await r.post("/v1/chat/completions", chat("echo", "hi"))
        first, second = r.harness.spawner.procs
        assert reply.status == 200 and reply.json()["pid"] == second.pid
        assert not first.alive and first.signals[0] == signal.SIGKILL  # killed at once, never asked politely
        assert r.backend("echo").restarts == 1 and r.harness.recorder.restarts == [("echo", "fatal")]


async def test_fatal_that_follows_the_retry_names_the_request(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r:
        async def always_fatal(call: Call) -> FakeReply:
            return fatal_reply()

        r.upstream.handler = always_fatal
        reply = await r.post("/v1/chat/completions", chat("echo"))
        assert reply.status == 502 and reply.json()["error"]["code"] == "request_crashed_model"
        assert len(r.upstream.calls) == 2  # one retry, never a second


async def test_streamed_fatal_before_the_stream_starts_is_retried_once(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r:
        async def first_fatal(call: Call) -> FakeReply:
            if len(r.upstream.calls) == 1:
                return fatal_reply()
            return FakeReply(chunks=[b"data: {}\n\n", b"data: [DONE]\n\n"], content_type=b"text/event-stream")

        r.upstream.handler = first_fatal
        reply = await r.post("/v1/chat/completions", chat("echo", stream=True))
        assert reply.status == 200 and reply.body.endswith(b"data: [DONE]\n\n")
        assert len(r.upstream.calls) == 2 and len(r.harness.spawner.procs) == 2  # on the fresh process


async def test_retry_on_fatal_false_answers_503_and_restarts_in_the_background(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model(retry_on_fatal=False)}) as r:
        async def first_fatal(call: Call) -> FakeReply:
            return fatal_reply() if len(r.upstream.calls) == 1 else await echo(call)

        r.upstream.handler = first_fatal
        assert (await r.post("/v1/chat/completions", chat("echo"))).status == 503
        ok = await r.post("/v1/chat/completions", chat("echo", "fine now"))
        first, last = r.harness.spawner.procs[0], r.harness.spawner.procs[-1]
        assert ok.status == 200 and ok.json()["pid"] == last.pid != first.pid


async def test_a_process_killed_under_a_request_is_retried_once_on_a_fresh_process(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r:
        async def first_killed(call: Call) -> FakeReply:
            if len(r.upstream.calls) == 1:
                assert call.proc is not None
                call.proc.exit(-signal.SIGKILL)  # kill -9 from outside: not the request's doing
                raise UpstreamError("backend closed the connection")
            return await echo(call)

        r.upstream.handler = first_killed
        reply = await r.post("/v1/chat/completions", chat("echo"))
        assert reply.status == 200 and reply.json()["pid"] == r.harness.spawner.procs[1].pid
        assert r.harness.recorder.restarts == [("echo", "crash")]


async def test_a_lone_request_whose_process_crashes_by_itself_is_named_and_not_retried(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model(backoff_base_s=0)}) as r:
        async def crashes(call: Call) -> FakeReply:
            assert call.proc is not None
            call.proc.exit(139)
            raise UpstreamError("backend closed the connection")

        r.upstream.handler = crashes
        reply = await r.post("/v1/chat/completions", chat("echo", "[[crash]]"))
        assert reply.status == 502 and reply.json()["error"]["code"] == "request_crashed_model"
        assert len(r.upstream.calls) == 1  # a poison request is never sent again
        r.upstream.handler = echo
        assert (await r.post("/v1/chat/completions", chat("echo"))).status == 200
        assert r.backend("echo").failures == 0  # the request's doing: no failure counted toward backoff


async def test_a_request_killed_twice_from_outside_is_a_502_never_a_hang(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model(backoff_base_s=0)}) as r:
        async def always_killed(call: Call) -> FakeReply:
            assert call.proc is not None
            call.proc.exit(-signal.SIGKILL)
            raise UpstreamError("backend closed the connection")

        r.upstream.handler = always_killed
        reply = await r.post("/v1/chat/completions", chat("echo", stream=True))
        assert reply.status == 502 and "died" in reply.json()["error"]["message"]
        assert reply.json()["error"]["code"] == "backend_error"
        assert len(r.upstream.calls) == 2  # retried once, never twice
        r.upstream.handler = echo
        assert (await r.post("/v1/chat/completions", chat("echo"))).status == 200


def sse(*texts: str, role: bool = False, id_: str = "first") -> list[bytes]:
    """Chat chunks of one stream (``id_`` and ``created`` shared, as a model server sends them)."""
    envelope = '{"id":"%s","created":%d,"model":"echo","choices":[{"index":0,"delta":%s}]}'
    created = 1 if id_ == "first" else 2
    deltas = (['{"role":"assistant"}'] if role else []) + [json.dumps({"content": t}) for t in texts]
    return [b"data: " + (envelope % (id_, created, delta)).encode() + b"\n\n" for delta in deltas]


async def test_a_stream_cut_by_a_death_is_resumed_with_the_text_so_far(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r:
        async def dies_mid_stream(call: Call) -> FakeReply:
            if len(r.upstream.calls) == 1:
                assert call.proc is not None
                proc = call.proc
                boom = UpstreamError("backend closed the connection")
                proc.exit(-signal.SIGKILL)
                return FakeReply(chunks=[*sse("one", " two", role=True), boom], content_type=b"text/event-stream")
            return FakeReply(chunks=[*sse(" three", role=True, id_="second"), b"data: [DONE]\n\n"],
                             content_type=b"text/event-stream")

        r.upstream.handler = dies_mid_stream
        reply = await r.post("/v1/chat/completions", chat("echo", stream=True, max_tokens=10))
        assert reply.status == 200 and reply.body.count(b"[DONE]") == 1 and b'"error"' not in reply.body
        assert reply.body.count(b'"role"') == 1 and b"second" not in reply.body  # the first stream's id, created
        assert b'"created":2' not in reply.body and reply.body.count(b'"id":"first"') == 4
        second = json.loads(r.upstream.calls[1].body)
        assert second["continue_final_message"] is True and second["max_tokens"] == 8
        assert second["messages"][-1] == {"role": "assistant", "content": "one two"}


async def test_a_stalled_stream_kills_its_process_as_hung_and_resumes(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model(stall_timeout_s=0.05)}) as r:
        async def stalls_once(call: Call) -> FakeReply:
            if len(r.upstream.calls) == 1:
                return FakeReply(chunks=[*sse("one", role=True), asyncio.Event()], content_type=b"text/event-stream")
            return FakeReply(chunks=[*sse(" two", id_="second"), b"data: [DONE]\n\n"],
                             content_type=b"text/event-stream")

        r.upstream.handler = stalls_once
        reply = await r.post("/v1/chat/completions", chat("echo", stream=True))
        assert reply.status == 200 and reply.body.count(b"[DONE]") == 1 and b'"error"' not in reply.body
        first = r.harness.spawner.procs[0]
        assert not first.alive and first.signals[0] == signal.SIGKILL
        assert r.harness.recorder.restarts == [("echo", "hang")]


async def test_unreachable_live_backend_is_502_not_a_retry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router.path.recovery, "DEATH_GRACE_S", 0.01)
    async with fake_router(tmp_path, {"echo": model()}) as r:
        async def refuse(call: Call) -> FakeReply:
            raise UpstreamError("cannot connect to the backend: connection refused")

        r.upstream.handler = refuse
        reply = await r.post("/v1/chat/completions", chat("echo"))
        assert reply.status == 502 and "could not be reached" in reply.json()["error"]["message"]
        assert len(r.upstream.calls) == 1 and r.backend("echo").state is State.READY


async def test_no_response_head_in_time_is_504(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model(request_timeout_s=0.05)}) as r:
        async def never(call: Call) -> FakeReply:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        r.upstream.handler = never
        reply = await r.post("/v1/chat/completions", chat("echo"))
        assert reply.status == 504 and "request_timeout_s=0.05s" in reply.json()["error"]["message"]


async def test_upstream_timeout_error_is_504(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r:
        async def slow_connect(call: Call) -> FakeReply:
            raise UpstreamTimeout("connecting to the backend took over 5s")

        r.upstream.handler = slow_connect
        assert (await r.post("/v1/chat/completions", chat("echo"))).status == 504


async def test_silence_mid_stream_ends_it_with_an_error_event(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model(stream_idle_timeout_s=0.05)}) as r:
        async def stalls(call: Call) -> FakeReply:
            return FakeReply(chunks=[b"data: one\n\n", asyncio.Event()], content_type=b"text/event-stream")

        r.upstream.handler = stalls
        reply = await r.post("/v1/chat/completions", chat("echo", stream=True))
        assert reply.status == 200 and reply.chunks[0] == b"data: one\n\n"
        assert b"stream_idle_timeout_s=0.05s" in reply.body and b'"code": "backend_error"' in reply.body
        assert reply.body.endswith(b"\n\ndata: [DONE]\n\n")
        assert r.upstream.replies[0].closed


async def test_queue_full_is_429_with_retry_after(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model(max_concurrency=1, max_queue=1)}) as r:
        release = asyncio.Event()

        async def slow(call: Call) -> FakeReply:
            await release.wait()
            return await echo(call)

        r.upstream.handler = slow
        busy = [asyncio.ensure_future(r.post("/v1/chat/completions", chat("echo"))) for _ in range(2)]
        while r.service.registry.models["echo"].limiter.queued < 1:
            await asyncio.sleep(0)
        refused = await r.post("/v1/chat/completions", chat("echo"))
        assert refused.status == 429 and int(refused.headers["retry-after"]) >= 1
        assert "max_queue=1" in refused.json()["error"]["message"]
        release.set()
        assert [x.status for x in await asyncio.gather(*busy)] == [200, 200]


async def test_body_over_the_model_limit_is_413_and_reaches_nobody(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"small": model(max_request_mb=0.01), "big": model()}) as r:
        too_big = await r.post("/v1/chat/completions", chat("small", "x " * 20000))
        assert too_big.status == 413 and "0.01 MiB" in too_big.json()["error"]["message"]
        assert r.upstream.calls == [] and r.backend("small").state is State.STOPPED
        assert (await r.post("/v1/chat/completions", chat("big", "x " * 20000))).status == 200


async def test_failed_start_is_503_with_the_reason_then_backs_off(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"broken": model(backoff_base_s=5)}) as r:
        def fails(proc: object) -> None:
            proc.say("RuntimeError: weights are corrupt")  # type: ignore[attr-defined]
            proc.exit(1)  # type: ignore[attr-defined]

        r.harness.spawner.on_spawn = fails
        first = await r.post("/v1/chat/completions", chat("broken"))
        assert first.status == 503 and "weights are corrupt" in first.json()["error"]["message"]
        second = await r.post("/v1/chat/completions", chat("broken"))
        assert second.status == 503 and int(second.headers["retry-after"]) >= 1
        assert r.backend("broken").state is State.BACKOFF and r.upstream.calls == []


async def test_client_disconnect_mid_stream_closes_the_upstream(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r:
        never = asyncio.Event()

        async def long_stream(call: Call) -> FakeReply:
            return FakeReply(chunks=[b"data: one\n\n", never], content_type=b"text/event-stream")

        r.upstream.handler = long_stream
        hang_up = asyncio.Event()
        exchange = asyncio.ensure_future(r.post("/v1/chat/completions", chat("echo", stream=True), disconnect=hang_up))
        while not r.upstream.replies:
            await asyncio.sleep(0)
        hang_up.set()
        reply = await asyncio.wait_for(exchange, 5)
        assert reply.status == 200 and reply.chunks == [b"data: one\n\n"]
        assert r.upstream.replies[0].closed and r.backend("echo").in_flight == 0  # the model server sees it go


async def test_group_evicts_the_idle_model_and_waits_for_a_busy_one(tmp_path: Path) -> None:
    models = {"a": model(group="gpu0"), "b": model(group="gpu0")}
    async with fake_router(tmp_path, models, groups={"gpu0": {"max_loaded": 1}}) as r:
        assert (await r.post("/v1/chat/completions", chat("a"))).status == 200
        proc_a = r.harness.spawner.procs[0]
        assert (await r.post("/v1/chat/completions", chat("b"))).status == 200
        assert r.backend("a").state is State.STOPPED and not proc_a.alive
        release = asyncio.Event()

        async def b_is_busy(call: Call) -> FakeReply:
            if len(r.upstream.calls) == 3:  # the stream on b
                return FakeReply(chunks=[b"data: one\n\n", release, b"data: [DONE]\n\n"],
                                 content_type=b"text/event-stream")
            return await echo(call)

        r.upstream.handler = b_is_busy
        stream = asyncio.ensure_future(r.post("/v1/chat/completions", chat("b", stream=True)))
        while len(r.upstream.calls) < 3:
            await asyncio.sleep(0)
        waiting = asyncio.ensure_future(r.post("/v1/chat/completions", chat("a")))
        while not r.harness.manager._room_waiters:  # a's start now waits for room, woken by changes only
            await asyncio.sleep(0)
        assert not waiting.done() and r.backend("b").state is State.READY  # a busy model is never killed for room
        release.set()
        assert (await stream).status == 200 and (await waiting).status == 200
        assert r.backend("b").state is State.STOPPED and r.backend("a").state is State.READY
        assert r.harness.recorder.stops == [("a", "evict"), ("b", "evict")]


async def test_the_loading_ticker_stops_once_the_model_is_ready(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router.path.loading, "TICK_S", 0.01)
    async with fake_router(tmp_path, {"echo": model(loading_progress="reasoning")}) as r:
        arrived, answer = asyncio.Event(), asyncio.Event()

        async def slow_head(call: Call) -> FakeReply:  # a [[hang]] before the response head
            arrived.set()
            await answer.wait()
            return FakeReply(chunks=[b"data: one\n\n", b"data: [DONE]\n\n"], content_type=b"text/event-stream")

        r.upstream.handler = slow_head
        request = asyncio.ensure_future(r.post("/v1/chat/completions", chat("echo", stream=True)))
        await asyncio.wait_for(arrived.wait(), 10)
        assert r.backend("echo").state is State.READY
        async with asyncio.timeout(10):  # it ends by itself, the model being loaded (perhaps already has)
            while any(t.get_name() == "loading echo" and not t.done() for t in asyncio.all_tasks()):
                await asyncio.sleep(0.01)
        answer.set()
        reply = await asyncio.wait_for(request, 10)
        assert reply.status == 200 and reply.body.endswith(b"data: one\n\ndata: [DONE]\n\n")


async def test_an_endpoint_of_another_task_is_a_400_naming_the_task_and_starts_nothing(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model(), "emb": model(task="embeddings")}) as r:
        reply = await r.post("/v1/embeddings", {"model": "echo", "input": "hi"})
        assert reply.status == 400, reply.body
        error = reply.json()["error"]
        assert error["param"] == "model" and "'echo' has task llm" in error["message"], error
        assert "/v1/embeddings needs task embeddings (models: emb)" in error["message"], error
        assert r.upstream.calls == [] and r.backend("echo").state is State.STOPPED


def test_the_routers_endpoint_tasks_match_what_each_task_serves() -> None:
    from modelserver.tasks import TASK_ROUTES
    from router.path.request import ENDPOINT_TASKS

    served = {(route.path, task) for task, routes in TASK_ROUTES.items() for route in routes}  # type: ignore[attr-defined]
    wanted = {(path, task) for path, tasks in ENDPOINT_TASKS.items() for task in tasks}
    assert wanted == {(path, task) for path, task in served if path in ENDPOINT_TASKS}
    assert set(ENDPOINT_TASKS) >= {path for path, _ in served if path.startswith("/v1/")}

