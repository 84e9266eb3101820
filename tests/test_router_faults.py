"""Faults the client barely notices, over real fake-engine model servers: streams resumed after a
kill -9, a fatal error or a stall; poison requests named and never sent twice; innocent requests
retried. Each test runs its own router in this event loop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.router_helpers import RunningRouter, fake_model, running_router, write_config

pytestmark = pytest.mark.timeout(120)

WORDS = " ".join(f"w{i}" for i in range(24))
# Half the words, then silence until the process dies: a test that kills or stops the process mid-stream
# can never be outrun by the stream's end. Resumed on a fresh process (a continuation), it runs to the end.
STALLING = WORDS.replace("w11 ", "w11 [[stall]] ")


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "echo", "messages": [{"role": "user", "content": text}], **extra}


def events(raw: str) -> list[Any]:
    return [json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
            for line in raw.split("\n\n") if line.startswith("data: ")]


def content(parsed: list[Any]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in parsed
                   if isinstance(e, dict) and e.get("choices"))


async def stream_lines(router: RunningRouter, body: dict[str, Any]) -> AsyncIterator[str]:
    async with router.client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line:
                yield line


async def wait_for(predicate: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def config(tmp_path: Path, **overrides: Any) -> Path:
    model = fake_model(fake={"load_s": 0.05, "token_delay_s": 0.03}, **overrides)
    return write_config(tmp_path, {"echo": model})


def assert_whole_answer(raw: str, ids: int = 1, text: str = WORDS) -> list[Any]:
    parsed = events(raw)
    assert parsed.count("[DONE]") == 1 and parsed[-1] == "[DONE]"
    chunks = [e for e in parsed if isinstance(e, dict)]
    assert not [e for e in chunks if "error" in e], chunks
    assert content(parsed) == text  # the same text an unbroken stream gives
    assert len({e["id"] for e in chunks}) == ids and len({e["created"] for e in chunks}) == 1
    assert sum("role" in (e["choices"][0].get("delta") or {}) for e in chunks if e["choices"]) == 1
    return chunks


async def test_a_stream_whose_backend_is_killed_mid_generation_completes(tmp_path: Path) -> None:
    async with running_router(config(tmp_path)) as router:
        first = router.backend("echo")
        lines: list[str] = []
        body = chat(STALLING, stream=True, stream_options={"include_usage": True})
        async for line in stream_lines(router, body):
            lines.append(line)
            if len(lines) == 6:  # the role chunk and five words reached the client
                assert first.pid is not None
                os.kill(first.pid, signal.SIGKILL)
        chunks = assert_whole_answer("\n\n".join(lines) + "\n\n", text=STALLING)
        usage = [e["usage"] for e in chunks if e.get("usage")]
        assert usage == [{"prompt_tokens": 25, "completion_tokens": 25, "total_tokens": 50,
                          "prompt_tokens_details": {"cached_tokens": 0}}]
        assert router.backend("echo").restarts == 1


async def test_a_fatal_error_mid_stream_is_resumed_on_the_fresh_process(tmp_path: Path) -> None:
    async with running_router(config(tmp_path)) as router:
        text = WORDS.replace("w3 ", "w3 [[fatal-mid]] ")
        raw = "\n\n".join([line async for line in stream_lines(router, chat(text, stream=True))]) + "\n\n"
        parsed = events(raw)
        assert parsed.count("[DONE]") == 1 and not [e for e in parsed if isinstance(e, dict) and "error" in e]
        assert content(parsed) == text
        await wait_for(lambda: router.backend("echo").restarts == 1)


async def test_a_stalled_stream_is_killed_as_hung_and_resumed(tmp_path: Path) -> None:
    async with running_router(config(tmp_path, stall_timeout_s=3)) as router:
        text = WORDS.replace("w3 ", "w3 [[stall]] ")
        raw = "\n\n".join([line async for line in stream_lines(router, chat(text, stream=True))]) + "\n\n"
        parsed = events(raw)
        assert content(parsed) == text and parsed.count("[DONE]") == 1
        metrics = (await router.client.get("/metrics")).text
        assert 'ovrouter_model_restarts_total{model="echo",reason="hang"} 1.0' in metrics
        assert "was killed: a stream got no token for stall_timeout_s=3s" in (router.backend("echo").last_error or "")


async def test_a_poison_crash_mid_stream_is_named_not_resumed(tmp_path: Path) -> None:
    async with running_router(config(tmp_path)) as router:
        raw = "\n\n".join([line async for line in stream_lines(router, chat(f"{WORDS} [[crash-mid]]", stream=True))])
        parsed = events(raw + "\n\n")
        assert parsed[-1] == "[DONE]" and parsed[-2]["error"]["code"] == "request_crashed_model"
        assert "\n" not in parsed[-2]["error"]["message"] and ".sock" not in parsed[-2]["error"]["message"]
        await wait_for(lambda: router.backend("echo").state.value == "ready")
        assert (await router.client.post("/v1/chat/completions", json=chat("innocent"))).status_code == 200


async def test_a_poison_crash_is_answered_at_once_and_the_next_request_succeeds(tmp_path: Path) -> None:
    async with running_router(config(tmp_path)) as router:
        poison = await router.client.post("/v1/chat/completions", json=chat("bye [[crash]]"))
        assert poison.status_code == 502 and poison.json()["error"]["code"] == "request_crashed_model"
        # the answer may go out before the supervisor has handled the exit: count once it relaunched
        await wait_for(lambda: router.backend("echo").restarts >= 1 and router.backend("echo").state.value == "ready")
        assert router.backend("echo").restarts == 1  # not retried: one process down, not two
        innocent = await router.client.post("/v1/chat/completions", json=chat("innocent"))
        assert innocent.status_code == 200


async def test_a_non_streamed_request_whose_process_is_killed_is_retried(tmp_path: Path) -> None:
    async with running_router(config(tmp_path)) as router:
        await router.client.post("/v1/chat/completions", json=chat("warm"))
        pid = router.backend("echo").pid
        pending = asyncio.create_task(router.client.post("/v1/chat/completions", json=chat(WORDS)))
        await wait_for(lambda: router.backend("echo").in_flight == 1)
        await asyncio.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        response = await pending
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == WORDS
        await wait_for(lambda: router.backend("echo").pid != pid)  # a loaded machine may answer before the kill


async def test_a_retried_request_that_crashes_a_second_process_is_named(tmp_path: Path) -> None:
    async with running_router(config(tmp_path)) as router:
        fatal = await router.client.post("/v1/chat/completions", json=chat("[[fatal]]"))
        assert fatal.status_code == 502 and fatal.json()["error"]["code"] == "request_crashed_model"
        assert "retry" in fatal.json()["error"]["message"]
        await wait_for(lambda: router.backend("echo").restarts == 2 and router.backend("echo").state.value == "ready")
        assert router.backend("echo").failures == 0  # both deaths were the request's: forgiven, no backoff


async def test_client_errors_carry_no_log_tail_or_socket_path(tmp_path: Path) -> None:
    async with running_router(config(tmp_path)) as router:
        poison = await router.client.post("/v1/chat/completions", json=chat("[[crash]]"))
        message = poison.json()["error"]["message"]
        assert "\n" not in message and "sock" not in message and "pid" not in message


async def test_a_hung_model_with_a_stream_in_flight_never_blocks_an_unload_or_the_next_request(
    tmp_path: Path,
) -> None:
    fast_health = {"health_interval_s": 0.3, "health_timeout_s": 1, "health_failures": 2}  # a loaded server is slow
    async with running_router(config(tmp_path, **fast_health)) as router:
        lines: list[str] = []
        stopped = asyncio.Event()

        async def read_stream() -> None:
            async for line in stream_lines(router, chat(STALLING, stream=True)):
                lines.append(line)
                if len(lines) == 4:
                    pid = router.backend("echo").pid
                    assert pid is not None
                    os.kill(pid, signal.SIGSTOP)  # hung mid-stream: no token, no health answer
                    stopped.set()

        reader = asyncio.create_task(read_stream())
        await asyncio.wait_for(stopped.wait(), 20)
        unload = asyncio.create_task(router.client.post("/api/models/echo/unload"))
        await asyncio.sleep(0.1)
        nxt = asyncio.create_task(router.client.post("/v1/chat/completions", json=chat("next one")))
        done, _ = await asyncio.wait({reader, unload, nxt}, timeout=30)
        assert len(done) == 3, "something waited behind the drain of a hung process"
        assert (await unload).status_code == 200 and (await nxt).status_code == 200
        assert_whole_answer("\n\n".join(lines) + "\n\n", text=STALLING)  # resumed on a fresh process


async def test_an_innocent_request_during_a_relaunch_waits_for_it_instead_of_a_503(tmp_path: Path) -> None:
    async with running_router(config(tmp_path, backoff_base_s=1.5)) as router:
        for _ in range(2):  # two crashes in a row: the second relaunch waits out a 1.5 s backoff
            assert (await router.client.post("/v1/chat/completions", json=chat("warm"))).status_code == 200
            pid = router.backend("echo").pid
            os.kill(pid, signal.SIGKILL)
            await wait_for(lambda pid=pid: router.backend("echo").pid != pid)
        await wait_for(lambda: router.backend("echo").state.value == "backoff")
        innocent = await router.client.post("/v1/chat/completions", json=chat("innocent"))
        assert innocent.status_code == 200, innocent.text


async def test_a_process_that_exits_with_a_fatal_line_counts_as_a_fatal_restart(tmp_path: Path) -> None:
    async with running_router(config(tmp_path)) as router:
        aborted = await router.client.post("/v1/chat/completions", json=chat("[[abort]]"))
        assert aborted.status_code == 502 and aborted.json()["error"]["code"] == "request_crashed_model"
        await wait_for(lambda: router.backend("echo").state.value == "ready")
        metrics = (await router.client.get("/metrics")).text
        # a device failure is retried once; the second exit names the request
        assert 'ovrouter_model_restarts_total{model="echo",reason="fatal"} 2.0' in metrics
        assert "GPU plugin can't finish correctly" in (router.backend("echo").last_error or "")


async def test_a_model_that_cannot_start_gets_one_safe_line_and_retry_after(tmp_path: Path) -> None:
    broken = fake_model(fake={"load_s": 0.01, "fail_load": "weights are corrupt"}, backoff_base_s=30)
    async with running_router(write_config(tmp_path, {"echo": broken})) as router:
        for attempt in range(2):
            reply = await router.client.post("/v1/chat/completions", json=chat("hi"))
            message = reply.json()["error"]["message"]
            assert reply.status_code == 503 and "\n" not in message and "pid=" not in message, message
            assert ".sock" not in message and "/api/models/echo/logs" in message
            assert attempt == 1 or "weights are corrupt" in message
        assert int(reply.headers["retry-after"]) >= 1
        assert "last log lines" in (router.backend("echo").last_error or "")  # the tail stays in /api/models


async def test_fatal_errors_in_three_models_on_one_device_mark_it_unhealthy_until_reset(tmp_path: Path) -> None:
    on_gpu = {name: fake_model(device="GPU.7", retry_on_fatal=False) for name in ("a", "b", "c", "d")}
    async with running_router(write_config(tmp_path, {**on_gpu, "cpu": fake_model()})) as router:
        for name in ("a", "b", "c"):
            fatal = await router.client.post("/v1/chat/completions", json={**chat("[[fatal]]"), "model": name})
            assert fatal.status_code == 503
        await wait_for(lambda: router.service.devices.health.unhealthy("GPU.7") is not None)
        refused = await router.client.post("/v1/chat/completions", json={**chat("hi"), "model": "d"})
        message = refused.json()["error"]["message"]
        assert refused.status_code == 503 and "GPU.7" in message and "driver reload or reboot" in message
        load = await router.client.post("/models/load", json={"model": "d"})  # llama.cpp's API: a 503, not success
        assert load.status_code == 503 and "GPU.7" in load.json()["error"]["message"], load.text
        listed = (await router.client.get("/models")).json()["data"]
        assert next(m for m in listed if m["id"] == "d")["status"]["value"] == "failed"
        on_cpu = await router.client.post("/v1/chat/completions", json={**chat("hi"), "model": "cpu"})
        assert on_cpu.status_code == 200  # other devices are not affected
        status = (await router.client.get("/api/status")).json()
        gpu = next(row for row in status["devices"] if row["device"] == "GPU.7")
        assert gpu["healthy"] is False and sorted(gpu["models"]) == ["a", "b", "c"]
        reset = await router.client.post("/api/devices/GPU.7/reset")
        assert reset.status_code == 200 and reset.json()["was_unhealthy"] is True
        assert (await router.client.post("/v1/chat/completions", json={**chat("hi"), "model": "d"})).status_code == 200


async def test_a_second_suspect_error_within_a_minute_replaces_the_process(tmp_path: Path) -> None:
    async with running_router(config(tmp_path)) as router:
        first = await router.client.post("/v1/chat/completions", json=chat("[[suspect]]"))
        assert first.status_code == 500 and first.json()["error"]["code"] == "engine_suspect"
        pid = router.backend("echo").pid
        assert router.backend("echo").restarts == 0  # one suspect error is an ordinary 500
        second = await router.client.post("/v1/chat/completions", json=chat("again [[suspect]]"))
        # the second one fails the process (it exits); the retry on the fresh process is that one's first suspect
        assert second.status_code == 500 and second.json()["error"]["code"] == "engine_suspect"
        assert router.backend("echo").restarts == 1 and router.backend("echo").pid != pid


async def test_a_hung_process_replaced_by_a_rolling_restart_is_killed_not_drained(tmp_path: Path) -> None:
    health = {"health_interval_s": 1, "health_timeout_s": 0.5, "health_failures": 2}  # the roll lands first
    async with running_router(config(tmp_path, drain_timeout_s=300, **health)) as router:
        assert (await router.client.post("/v1/chat/completions", json=chat("warm"))).status_code == 200
        old = router.backend("echo")
        pid = old.pid
        assert pid is not None
        lines: list[str] = []
        stopped = asyncio.Event()

        async def read_stream() -> None:
            async for line in stream_lines(router, chat(STALLING, stream=True)):
                lines.append(line)
                if len(lines) == 4 and not stopped.is_set():
                    await wait_for(lambda: old.in_flight == 2)  # the plain request is in flight too
                    os.kill(pid, signal.SIGSTOP)  # hung: no token, no health answer
                    stopped.set()

        reader = asyncio.create_task(read_stream())
        long = " ".join([WORDS] * 4)  # seconds of tokens: still in flight when the process is stopped
        plain = asyncio.create_task(router.client.post("/v1/chat/completions", json=chat(long)))
        await asyncio.wait_for(stopped.wait(), 60)
        restart = await router.client.post("/api/models/echo/restart")
        assert restart.status_code == 200 and router.backend("echo") is not old  # rolled: the old one retires
        assert old.closed  # its hang is detected while it drains
        done, _ = await asyncio.wait({reader, plain}, timeout=30)
        assert len(done) == 2, "the requests of the hung retiring process waited out its drain"
        assert_whole_answer("\n\n".join(lines) + "\n\n", text=STALLING)  # resumed on the new process
        answer = await plain  # a hang shared by two: each is a suspect, retried alone on the new process
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == long, answer.text
        await wait_for(lambda: old.state.value == "stopped")
        assert old.last_error is not None and "killed" in old.last_error  # SIGKILLed as hung, not drained


async def test_clean_requests_beside_a_poison_one_are_never_named_the_cause(tmp_path: Path) -> None:
    async with running_router(config(tmp_path)) as router:
        assert (await router.client.post("/v1/chat/completions", json=chat("warm"))).status_code == 200
        backend = router.backend("echo")
        long = " ".join([WORDS] * 4)  # seconds of tokens: still in flight however late the poll comes
        clean = [asyncio.create_task(router.client.post("/v1/chat/completions", json=chat(long)))
                 for _ in range(3)]
        await wait_for(lambda: backend.in_flight == 3)
        # crashes every process it reaches, so its retry takes the clean ones' retries down with it
        poison = await router.client.post("/v1/chat/completions", json=chat(f"{WORDS} [[crash]]"))
        answers = await asyncio.gather(*clean)
        assert poison.status_code == 502 and poison.json()["error"]["code"] == "request_crashed_model", poison.text
        for answer in answers:  # retried one at a time in the suspect lane: the poison one takes none down
            assert answer.status_code == 200, answer.text
        assert backend.restarts <= 2  # the poison request was sent twice at most
        await wait_for(lambda: backend.state.value == "ready")
        assert backend.failures == 0  # a poison request's deaths push the model toward no backoff


async def test_a_hang_is_found_in_seconds_with_the_default_probes(tmp_path: Path) -> None:
    from modelserver.spec import ModelSpec

    probes = {key: ModelSpec.model_fields[key].default
              for key in ("health_interval_s", "health_timeout_s", "health_failures")}  # the defaults, as shipped
    async with running_router(config(tmp_path, **probes)) as router:
        assert (await router.client.post("/v1/chat/completions", json=chat("warm"))).status_code == 200
        started = time.monotonic()
        poison = await router.client.post("/v1/chat/completions", json=chat("[[hang]]"), timeout=120)
        found_s = time.monotonic() - started
        assert poison.status_code == 502 and poison.json()["error"]["code"] == "request_crashed_model"
        print(f"a hang found and answered in {found_s:.1f}s with the default probes {probes}")
        assert found_s < 40  # the old defaults took ~45 s; generous for a loaded machine (bench: ~10-14 s)


async def test_a_non_streamed_request_whose_generation_stops_advancing_is_found_by_the_pump_watch(
    tmp_path: Path,
) -> None:
    health = {"health_interval_s": 0.5, "health_timeout_s": 2, "health_failures": 2}
    async with running_router(config(tmp_path, stuck_after_s=1, **health)) as router:
        stalled = await router.client.post("/v1/chat/completions", json=chat(STALLING), timeout=60)
        # /health answers all along, but says "stuck" once no token came for stuck_after_s: the probes fail
        assert stalled.status_code == 502 and stalled.json()["error"]["code"] == "request_crashed_model"
        assert "health" in (router.backend("echo").last_error or "")
        await wait_for(lambda: router.backend("echo").state.value == "ready")
        assert (await router.client.post("/v1/chat/completions", json=chat("next"))).status_code == 200
