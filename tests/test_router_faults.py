"""Faults the client barely notices, end to end over real fake-engine model servers: a stream resumed
after a kill -9; hangs (SIGSTOP) found by the health probes under an unload and a rolling restart; a hang
found by the request's own heartbeats with the shipped defaults, a SIGSTOPped process's lone request
retried, a non-streamed stall found by the heartbeats' progress, and the model server's own pump watch.
Each test runs its own router in this event loop. Everything else about faults (fatal errors, stalls,
poison requests, deaths with a device's fatal line, failed starts, sick devices, suspect errors, waiting
out a relaunch) is tested in-process in milliseconds: tests/test_router_faults_inprocess.py,
tests/test_router_inprocess.py, tests/test_router_suspects.py and tests/test_router_heartbeat.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.router_helpers import RunningRouter, fake_model, running_router, write_config
from tests.test_router_proxy import alive

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
        assert restart.status_code == 200 and old.pid != pid  # rolled: the old process retires, draining
        assert router.backend("echo") is old  # one backend per name: its process changed underneath
        done, _ = await asyncio.wait({reader, plain}, timeout=30)
        assert len(done) == 2, "the requests of the hung retiring process waited out its drain"
        assert_whole_answer("\n\n".join(lines) + "\n\n", text=STALLING)  # resumed on the new process
        answer = await plain  # a hang shared by two: each is a suspect, retried alone on the new process
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == long, answer.text
        await wait_for(lambda: not alive(pid))  # SIGKILLed as hung (a SIGSTOPped process ignores SIGTERM)
        assert old.seats() == [] and old.state.value == "ready"


def shipped_health() -> dict[str, Any]:
    from modelserver.spec import ModelSpec

    return {key: ModelSpec.model_fields[key].default  # the defaults, as shipped
            for key in ("health_interval_s", "health_timeout_s", "health_failures", "stall_timeout_s")}


async def test_a_hang_is_found_in_seconds_by_the_requests_heartbeats_with_the_defaults(tmp_path: Path) -> None:
    async with running_router(config(tmp_path, **shipped_health())) as router:
        assert (await router.client.post("/v1/chat/completions", json=chat("warm"))).status_code == 200
        started = time.monotonic()
        poison = await router.client.post("/v1/chat/completions", json=chat("[[hang]]"), timeout=120)
        found_s = time.monotonic() - started
        assert poison.status_code == 502 and poison.json()["error"]["code"] == "request_crashed_model"
        assert "no heartbeat" in (router.backend("echo").last_error or "")  # the watchdog, not the probes
        print(f"a hang found and answered in {found_s:.1f}s with the defaults {shipped_health()}")
        assert found_s < 25  # the old defaults took ~45 s; generous for a loaded machine (bench: ~10-11 s)


async def test_a_lone_request_in_a_process_stopped_by_sigstop_is_retried_not_named(tmp_path: Path) -> None:
    health = {"health_interval_s": 0.5, "health_timeout_s": 1, "health_failures": 2}  # silent 2.5 s: hung
    async with running_router(config(tmp_path, **health)) as router:
        assert (await router.client.post("/v1/chat/completions", json=chat("warm"))).status_code == 200
        backend, long = router.backend("echo"), " ".join([WORDS] * 4)  # seconds of tokens
        pid = backend.pid
        pending = asyncio.create_task(router.client.post("/v1/chat/completions", json=chat(long), timeout=120))
        await wait_for(lambda: backend.in_flight == 1)
        os.kill(pid, signal.SIGSTOP)  # no SIGCONT: the watchdog kills it, and the stop was not the request's doing
        answer = await pending
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == long, answer.text
        assert backend.pid != pid and "no heartbeat" in (backend.last_error or "")


def model_pids(config: Path) -> list[int]:
    """The model server processes started with ``config`` (children of the router in this process), oldest first."""
    found: list[tuple[float, int, str]] = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            found.append((child.create_time(), child.pid, " ".join(child.cmdline())))
    return [pid for _, pid, line in sorted(found) if "modelserver" in line and str(config) in line]


async def test_a_process_stopped_by_sigstop_while_it_starts_is_relaunched_at_once_and_not_counted(
    tmp_path: Path,
) -> None:
    """A SIGSTOP during the load hung the cold start until startup_timeout_s (120 s here, 180 s by default), then
    counted as a failed start. Found stopped at the next readiness poll, it is killed and started again at once,
    and the waiting request is answered by the relaunch."""
    health = {"health_timeout_s": 1, "startup_timeout_s": 120}
    model = fake_model(fake={"load_s": 2.0, "token_delay_s": 0.005}, **health)  # seconds to stop it in
    path = write_config(tmp_path, {"echo": model})
    async with running_router(path) as router:
        backend = router.backend("echo")
        pending = asyncio.create_task(router.client.post("/v1/chat/completions", json=chat("hello"), timeout=120))
        await wait_for(lambda: bool(model_pids(path)))
        stopped = model_pids(path)[0]
        os.kill(stopped, signal.SIGSTOP)  # mid-load: no readiness line, no health answer, state T
        answer = await asyncio.wait_for(pending, 60)  # far below startup_timeout_s
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "hello", answer.text
        assert backend.pid != stopped and not psutil.pid_exists(stopped)  # killed and reaped
        assert backend.failures == 0 and backend.restarts == 1 and backend.starts == 1


async def test_a_non_streamed_generation_that_stalls_is_found_by_its_heartbeats(tmp_path: Path) -> None:
    async with running_router(config(tmp_path, stall_timeout_s=1, stuck_after_s=0)) as router:
        stalled = await router.client.post("/v1/chat/completions", json=chat(STALLING), timeout=60)
        # /health answers all along and the pump watch is off: only the request's own progress tells
        assert stalled.status_code == 502 and stalled.json()["error"]["code"] == "request_crashed_model"
        assert "no progress" in (router.backend("echo").last_error or "")
        await wait_for(lambda: router.backend("echo").state.value == "ready")
        assert (await router.client.post("/v1/chat/completions", json=chat("next"))).status_code == 200


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
