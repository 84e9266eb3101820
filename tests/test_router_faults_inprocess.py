"""Faults the client barely notices, in-process (the router app, procman under fakes, a fake upstream):
a fatal error mid-stream resumed, a stall and a process that stops answering its probes killed as hung,
poison requests named and never sent twice,
a process that dies with a device's fatal line, a model that cannot start, a sick device, suspect
errors, an innocent request waiting out a relaunch. Each runs in well under a second.

The end-to-end proofs over real model-server processes (kill -9, SIGSTOP hangs, the model server's
own pump watch, the shipped probe defaults) stay in tests/test_router_faults.py; the basic kill,
fatal, stall and poison paths are in tests/test_router_inprocess.py."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from procman import State
from router.edge.httpclient import UpstreamError
from tests.router_fakes import Call, Exchange, FakeReply, FakeRouter, chat, echo, fake_router
from tests.test_router_inprocess import fatal_reply, model, sse

pytestmark = pytest.mark.timeout(30)

SSE = b"text/event-stream"
FATAL_EVENT = (b'data: {"error": {"message": "fake engine: clFinish failed with CL_OUT_OF_RESOURCES", '
               b'"type": "server_error", "param": null, "code": "engine_fatal"}}\n\n')
#: What the fake engine's ``[[abort]]`` prints before it exits 134 (a GPU driver giving up).
ABORT_LINE = "[GPU] clFinish, error code: -5 CL_OUT_OF_RESOURCES; GPU plugin can't finish correctly"


def events(reply: Exchange) -> list[Any]:
    return [json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
            for line in reply.body.decode().split("\n\n") if line.startswith("data: ")]


def content(reply: Exchange) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events(reply)
                   if isinstance(e, dict) and e.get("choices"))


async def until(r: FakeRouter, predicate: Callable[[], bool], step_s: float = 0.25) -> None:
    """Wait for ``predicate``, moving procman's (fake) clock along meanwhile (backoff delays, timers)."""
    async with asyncio.timeout(10):
        while not predicate():
            await r.harness.clock.advance(step_s)


async def metrics(r: FakeRouter) -> str:
    async with r.client() as client:
        return (await client.get("/metrics")).text


def crashes(code: int, *lines: str) -> Callable[[Call], Any]:
    """A backend whose process prints ``lines`` and exits ``code`` under the request."""

    async def handler(call: Call) -> FakeReply:
        assert call.proc is not None
        call.proc.say(*lines)
        call.proc.exit(code)
        raise UpstreamError("backend closed the connection")

    return handler


async def test_a_fatal_error_mid_stream_is_resumed_on_the_fresh_process(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r:
        async def fatal_mid(call: Call) -> FakeReply:
            if len(r.upstream.calls) == 1:
                return FakeReply(chunks=[*sse("one", " two", role=True), FATAL_EVENT], content_type=SSE)
            return FakeReply(chunks=[*sse(" three", role=True, id_="second"), b"data: [DONE]\n\n"], content_type=SSE)

        r.upstream.handler = fatal_mid
        reply = await r.post("/v1/chat/completions", chat("echo", stream=True))
        parsed = events(reply)
        assert reply.status == 200 and parsed.count("[DONE]") == 1, reply.body
        assert not [e for e in parsed if isinstance(e, dict) and "error" in e] and content(reply) == "one two three"
        first = r.harness.spawner.procs[0]
        assert not first.alive and first.signals[0] == signal.SIGKILL  # never asked politely
        assert r.harness.recorder.restarts == [("echo", "fatal")]
        second = json.loads(r.upstream.calls[1].body)  # continued from the text already sent
        assert second["messages"][-1] == {"role": "assistant", "content": "one two"}


async def test_a_stalled_stream_is_a_hang_restart_that_says_why(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model(stall_timeout_s=0.05)}) as r:
        async def stalls_once(call: Call) -> FakeReply:
            if len(r.upstream.calls) == 1:
                return FakeReply(chunks=[*sse("one", role=True), asyncio.Event()], content_type=SSE)
            return FakeReply(chunks=[*sse(" two", id_="second"), b"data: [DONE]\n\n"], content_type=SSE)

        r.upstream.handler = stalls_once
        reply = await r.post("/v1/chat/completions", chat("echo", stream=True))
        assert reply.status == 200 and content(reply) == "one two" and events(reply).count("[DONE]") == 1
        assert 'ovrouter_model_restarts_total{model="echo",reason="hang"} 1.0' in await metrics(r)
        last_error = r.backend("echo").last_error or ""
        assert "was killed: a stream got no token for stall_timeout_s=0.05s" in last_error, last_error


async def test_a_poison_crash_mid_stream_is_named_not_resumed(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model(backoff_base_s=0)}) as r:
        async def crash_mid(call: Call) -> FakeReply:
            assert call.proc is not None
            call.proc.say("Segmentation fault", f"socket {call.address.path}")  # a log tail with a path in it
            call.proc.exit(139)
            return FakeReply(chunks=[*sse("one", role=True), UpstreamError("backend closed the connection")],
                             content_type=SSE)

        r.upstream.handler = crash_mid
        reply = await r.post("/v1/chat/completions", chat("echo", "bye [[crash-mid]]", stream=True))
        parsed = events(reply)
        assert reply.status == 200 and parsed[-1] == "[DONE]", reply.body
        error = parsed[-2]["error"]
        assert error["code"] == "request_crashed_model" and content(reply) == "one"
        assert "\n" not in error["message"] and ".sock" not in error["message"]
        assert len(r.upstream.calls) == 1  # a poison request is never sent again
        r.upstream.handler = echo
        await until(r, lambda: r.backend("echo").state is State.READY)
        assert (await r.post("/v1/chat/completions", chat("echo", "innocent"))).status == 200
        assert r.backend("echo").restarts == 1 and r.backend("echo").failures == 0


async def test_a_poison_crash_is_one_safe_line_one_restart_and_the_next_request_succeeds(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model(backoff_base_s=0)}) as r:
        r.upstream.handler = crashes(139, "Traceback (most recent call last):", "pid=4000 /run/echo.sock gone")
        poison = await r.post("/v1/chat/completions", chat("echo", "bye [[crash]]"))
        error = poison.json()["error"]
        assert poison.status == 502 and error["code"] == "request_crashed_model"
        assert "\n" not in error["message"] and "sock" not in error["message"] and "pid" not in error["message"]
        r.upstream.handler = echo
        assert (await r.post("/v1/chat/completions", chat("echo", "innocent"))).status == 200
        assert r.backend("echo").restarts == 1 and len(r.upstream.calls) == 2  # one process down, not two
        assert "last log lines" in (r.backend("echo").last_error or "")  # the tail stays in /api/models


async def test_a_retried_request_that_fails_a_second_process_is_named_and_forgiven(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r:
        async def always_fatal(call: Call) -> FakeReply:
            return fatal_reply()

        r.upstream.handler = always_fatal
        reply = await r.post("/v1/chat/completions", chat("echo", "[[fatal]]"))
        assert reply.status == 502 and reply.json()["error"]["code"] == "request_crashed_model"
        assert "retry" in reply.json()["error"]["message"] and len(r.upstream.calls) == 2
        backend = r.backend("echo")
        await until(r, lambda: backend.restarts == 2 and backend.state is State.READY)
        assert backend.failures == 0  # both deaths were the request's: forgiven, no backoff


async def test_a_process_that_exits_with_a_fatal_line_counts_as_a_fatal_restart(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model(backoff_base_s=0)}) as r:
        r.upstream.handler = crashes(134, ABORT_LINE)
        aborted = await r.post("/v1/chat/completions", chat("echo", "[[abort]]"))
        assert aborted.status == 502 and aborted.json()["error"]["code"] == "request_crashed_model"
        await until(r, lambda: r.backend("echo").state is State.READY)
        # a device failure is retried once; the second exit names the request
        assert 'ovrouter_model_restarts_total{model="echo",reason="fatal"} 2.0' in await metrics(r)
        assert "GPU plugin can't finish correctly" in (r.backend("echo").last_error or "")


async def test_a_model_that_cannot_start_gets_one_safe_line_and_retry_after(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model(backoff_base_s=30)}) as r:
        def fails(proc: Any) -> None:
            proc.say("loading /models/x.gguf from /run/echo.sock pid=4000", "RuntimeError: weights are corrupt")
            proc.exit(1)

        r.harness.spawner.on_spawn = fails
        for attempt in range(2):
            reply = await r.post("/v1/chat/completions", chat("echo"))
            message = reply.json()["error"]["message"]
            assert reply.status == 503 and "\n" not in message and "pid=" not in message, message
            assert ".sock" not in message and "/api/models/echo/logs" in message, message
            assert attempt == 1 or "weights are corrupt" in message
        assert int(reply.headers["retry-after"]) >= 1 and r.upstream.calls == []
        assert "last log lines" in (r.backend("echo").last_error or "")  # the tail stays in /api/models


async def test_fatal_errors_in_three_models_on_one_device_mark_it_unhealthy_until_reset(tmp_path: Path) -> None:
    on_gpu = {name: model(device="GPU.7", retry_on_fatal=False) for name in ("a", "b", "c", "d")}
    async with fake_router(tmp_path, {**on_gpu, "cpu": model()}) as r:
        async def fatal_on_marker(call: Call) -> FakeReply:
            return fatal_reply() if "[[fatal]]" in call.text else await echo(call)

        r.upstream.handler = fatal_on_marker
        for name in ("a", "b", "c"):
            assert (await r.post("/v1/chat/completions", chat(name, "[[fatal]]"))).status == 503
        await until(r, lambda: r.service.devices.health.unhealthy("GPU.7") is not None)
        refused = await r.post("/v1/chat/completions", chat("d", "hi"))
        message = refused.json()["error"]["message"]
        assert refused.status == 503 and "GPU.7" in message and "driver reload or reboot" in message
        async with r.client() as client:
            load = await client.post("/models/load", json={"model": "d"})  # llama.cpp's API: a 503, not success
            assert load.status_code == 503 and "GPU.7" in load.json()["error"]["message"], load.text
            listed = (await client.get("/models")).json()["data"]
            assert next(m for m in listed if m["id"] == "d")["status"]["value"] == "failed"
            assert (await r.post("/v1/chat/completions", chat("cpu", "hi"))).status == 200  # other devices: fine
            status = (await client.get("/api/status")).json()
            gpu = next(row for row in status["devices"] if row["device"] == "GPU.7")
            assert gpu["healthy"] is False and sorted(gpu["models"]) == ["a", "b", "c"]
            reset = await client.post("/api/devices/GPU.7/reset")
            assert reset.status_code == 200 and reset.json()["was_unhealthy"] is True
        assert (await r.post("/v1/chat/completions", chat("d", "hi"))).status == 200


async def test_fatal_errors_of_models_on_the_cpu_never_mark_it(tmp_path: Path) -> None:
    """The CPU has no driver context to wedge: its mark refused every CPU model's start (the fake engine's
    [[fatal]] markers to three fake models took a whole router down in bench/chaosmix.py)."""
    async with fake_router(tmp_path, {name: model(retry_on_fatal=False) for name in ("a", "b", "c", "d")}) as r:
        async def fatal_on_marker(call: Call) -> FakeReply:
            return fatal_reply() if "[[fatal]]" in call.text else await echo(call)

        r.upstream.handler = fatal_on_marker
        for name in ("a", "b", "c"):
            assert (await r.post("/v1/chat/completions", chat(name, "[[fatal]]"))).status == 503
        await until(r, lambda: all(r.service.registry.models[n].backend.restarts for n in ("a", "b", "c")))
        assert (await r.post("/v1/chat/completions", chat("d", "hi"))).status == 200
        assert r.service.devices.health.unhealthy("CPU") is None


async def test_a_second_suspect_error_replaces_the_process_and_the_fresh_ones_answer_passes(tmp_path: Path) -> None:
    suspect = {"error": {"message": "clEnqueueWriteBuffer: CL_MEM_OBJECT_ALLOCATION_FAILURE", "type": "server_error",
                         "param": None, "code": "engine_suspect"}}
    async with fake_router(tmp_path, {"echo": model()}) as r:
        async def suspects(call: Call) -> FakeReply:
            # the model server counts them: the second within a minute fails its process (fatal), then it is
            # the fresh process's first, an ordinary 500
            second = len(r.upstream.calls) == 2
            return FakeReply.json(500, suspect, headers=[(b"x-backend-fatal", b"1")] if second else [])

        r.upstream.handler = suspects
        first = await r.post("/v1/chat/completions", chat("echo", "[[suspect]]"))
        assert first.status == 500 and first.json()["error"]["code"] == "engine_suspect"
        pid = r.backend("echo").pid
        assert r.backend("echo").restarts == 0  # one suspect error is an ordinary 500
        second = await r.post("/v1/chat/completions", chat("echo", "again [[suspect]]"))
        assert second.status == 500 and second.json()["error"]["code"] == "engine_suspect"
        assert len(r.upstream.calls) == 3 and r.backend("echo").restarts == 1 and r.backend("echo").pid != pid


async def test_an_innocent_request_during_a_relaunch_waits_for_it_instead_of_a_503(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model(backoff_base_s=1.5)}) as r:
        backend = r.backend("echo")
        for _ in range(2):  # two crashes in a row: the second relaunch waits out a 1.5 s backoff
            assert (await r.post("/v1/chat/completions", chat("echo", "warm"))).status == 200
            proc = r.harness.spawner.last
            proc.exit(-signal.SIGKILL)
            await until(r, lambda proc=proc: backend.state is State.BACKOFF or backend.pid not in (None, proc.pid),
                        step_s=0.0)
        assert backend.state is State.BACKOFF and backend.retry_after_s is not None
        innocent = asyncio.ensure_future(r.post("/v1/chat/completions", chat("echo", "innocent")))
        await until(r, innocent.done)  # the backoff runs out on procman's clock
        assert (await innocent).status == 200, innocent.result().body


async def test_a_process_that_stops_answering_its_probes_is_killed_as_hung_and_its_lone_request_named(
    tmp_path: Path,
) -> None:
    probes = {"health_interval_s": 0.3, "health_timeout_s": 1, "health_failures": 2}
    async with fake_router(tmp_path, {"echo": model(retry_on_fatal=False, **probes)}) as r:
        assert (await r.post("/v1/chat/completions", chat("echo"))).status == 200
        proc = r.harness.spawner.last

        async def hangs(call: Call) -> FakeReply:  # no answer, and no health answer either, until it is killed
            assert call.proc is not None
            call.proc.healthy = False
            await call.proc.wait()
            raise UpstreamError("backend closed the connection")

        r.upstream.handler = hangs
        hung = asyncio.ensure_future(r.post("/v1/chat/completions", chat("echo", "[[hang]]")))
        await until(r, hung.done, step_s=0.1)  # two failed probes, 0.3 s apart on procman's clock
        reply = hung.result()
        assert reply.status == 502 and reply.json()["error"]["code"] == "request_crashed_model"  # alone: its doing
        assert not proc.alive and proc.signals[0] == signal.SIGKILL
        assert r.harness.recorder.restarts == [("echo", "hang")]
        assert "/health failed 2 probes in a row" in (r.backend("echo").last_error or "")
        r.upstream.handler = echo
        assert (await r.post("/v1/chat/completions", chat("echo", "alive"))).status == 200
        assert r.backend("echo").pid != proc.pid
        assert 'ovrouter_model_restarts_total{model="echo",reason="hang"} 1.0' in await metrics(r)
