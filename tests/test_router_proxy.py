"""The router over real fake-engine model server processes, end to end: the SDK through a real
socket, streams, idle stop, a hung process, a failed start's own reason, cancel on disconnect,
/upstream and /api, log follow. Each test starts its own router (in this event loop) and the model
processes it launches; the conftest check fails a test that leaves one behind.

Every proxy behaviour (fatal and crash retries, 502/503/504, 429, 413, disconnect, eviction) is
tested in-process over fakes, in milliseconds: tests/test_router_inprocess.py, and the HTTP
surface (errors, keys, cold-start sharing, preload, /metrics) in tests/test_router_api_inprocess.py."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import openai
import pytest

from procman import State
from tests.router_helpers import RunningRouter, fake_model, running_router, write_config

pytestmark = pytest.mark.timeout(120)


def chat(model: str, text: str = "hello there world", **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def sdk(router: RunningRouter, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=60)


async def wait_for(predicate: object, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def alive(pid: int) -> bool:
    """Running and not a zombie; a process reaped between the two looks (its /proc entry gone) is not alive."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


async def test_openai_sdk_chat_stream_alias_and_models_list(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"echo": fake_model(aliases=["gpt-4o-mini"]), "other": fake_model()})
    async with running_router(path) as router:
        listed = (await router.client.get("/v1/models")).json()
        assert [m["id"] for m in listed["data"]] == ["echo", "other"]
        assert {m["status"]["value"] for m in listed["data"]} == {"unloaded"}
        client = sdk(router)
        reply = await client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "a b c"}]
        )
        assert reply.choices[0].message.content == "a b c"
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        stream = await client.chat.completions.create(
            model="echo",
            messages=[{"role": "user", "content": "one two three four"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "one two three four" and len(chunks) >= 4
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
        statuses = {m["id"]: m["status"]["value"] for m in (await router.client.get("/v1/models")).json()["data"]}
        assert statuses == {"echo": "loaded", "other": "unloaded"}
        await client.close()


async def test_idle_stop_never_cuts_a_stream(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"echo": fake_model(idle_timeout_s=0.5, fake={"load_s": 0, "token_delay_s": 0.1})})
    async with running_router(path) as router:
        words = " ".join(f"w{i}" for i in range(25))  # ~2.5 s of streaming, 5x the idle timeout
        async with router.client.stream("POST", "/v1/chat/completions", json=chat("echo", words, stream=True)) as resp:
            pid = router.backend("echo").pid  # the head is here: this process serves the stream
            body = "".join([part async for part in resp.aiter_text()])
        assert resp.status_code == 200 and "w24" in body and body.rstrip().endswith("data: [DONE]")
        assert pid is not None
        # (the idle stop may come 0.5 s after the stream: a loaded machine may be there before the next line)
        await wait_for(lambda: router.backend("echo").state is State.STOPPED, 60, "idle stop")
        await wait_for(lambda: not alive(pid), 60, "the idle process to exit")
        assert router.backend("echo").starts == 1, "the stream was served by one process (not cut and resumed)"
        again = await router.client.post("/v1/chat/completions", json=chat("echo", "back"))
        assert again.status_code == 200 and router.backend("echo").pid not in (None, pid)


async def test_hung_process_is_killed_and_replaced_and_its_request_answered(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        {
            "echo": fake_model(
                retry_on_fatal=False, health_interval_s=0.3, health_timeout_s=1, health_failures=2, stop_timeout_s=1
            )
        },
    )
    async with running_router(path) as router:
        await router.client.post("/v1/chat/completions", json=chat("echo"))
        pid = router.backend("echo").pid
        hung = await router.client.post("/v1/chat/completions", json=chat("echo", "[[hang]]"))
        assert hung.status_code == 502 and hung.json()["error"]["code"] == "request_crashed_model"  # alone: its doing
        await wait_for(lambda: router.backend("echo").state is State.READY, 60, "hung process replaced")
        assert router.backend("echo").pid != pid
        await wait_for(lambda: not alive(pid), 60, "the hung process to be reaped")
        ok = await router.client.post("/v1/chat/completions", json=chat("echo", "alive"))
        assert ok.status_code == 200
        metrics = (await router.client.get("/metrics")).text
        assert 'ovrouter_model_restarts_total{model="echo",reason="hang"} 1.0' in metrics


async def test_failed_start_answers_with_the_reason_then_backs_off(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"broken": fake_model(fake={"fail_load": "weights are corrupt"}, backoff_base_s=5)})
    async with running_router(path) as router:
        first = await router.client.post("/v1/chat/completions", json=chat("broken"))
        assert first.status_code == 503
        assert "weights are corrupt" in first.json()["error"]["message"], "the model server's own reason"
        assert "Traceback" not in first.text
        second = await router.client.post("/v1/chat/completions", json=chat("broken"))
        assert second.status_code == 503 and int(second.headers["retry-after"]) >= 1
        assert router.backend("broken").state in (State.BACKOFF, State.STOPPED)


async def test_client_disconnect_mid_stream_cancels_the_generation(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"echo": fake_model(fake={"load_s": 0, "token_delay_s": 0.2})})
    async with running_router(path) as router:
        words = " ".join(f"w{i}" for i in range(50))
        async with router.client.stream("POST", "/v1/chat/completions", json=chat("echo", words, stream=True)) as r:
            async for _ in r.aiter_lines():
                break  # read the first event, then hang up
        backend = router.backend("echo")
        await wait_for(lambda: any("cancelled" in line for line in backend.logs.tail(50)), 60, "cancel in the log")
        await wait_for(lambda: backend.in_flight == 0, 60, "the request to end")


async def test_upstream_passthrough_and_management_api(tmp_path: Path) -> None:
    async with running_router(write_config(tmp_path, {"echo": fake_model()})) as router:
        health = await router.client.get("/upstream/echo/health")
        assert health.status_code == 200 and health.json()["status"] == "ready"
        head = await router.client.head("/upstream/echo/health")
        assert head.status_code == 200 and head.content == b""
        # a HEAD answer ends at its head: the exchange must not wait for a body that never comes
        # (until the backend's keep-alive timeout, 5 s, closes the connection)
        await wait_for(lambda: router.backend("echo").in_flight == 0, 3, "the HEAD exchange to end")
        assert (await router.client.get("/upstream/echo/v1/models")).json()["data"][0]["id"] == "echo"
        assert (await router.client.get("/upstream/nope/health")).status_code == 404
        rows = (await router.client.get("/api/models")).json()["models"]
        assert rows[0]["name"] == "echo" and rows[0]["state"] == "ready" and rows[0]["pid"]
        pid = rows[0]["pid"]
        restarted = (await router.client.post("/api/models/echo/restart")).json()
        assert restarted["pid"] != pid and restarted["state"] == "ready"
        unloaded = (await router.client.post("/api/models/echo/unload")).json()
        assert unloaded["state"] == "stopped" and unloaded["pid"] is None
        loaded = (await router.client.post("/api/models/echo/load")).json()
        assert loaded["state"] == "ready"
        logs = await router.client.get("/api/models/echo/logs", params={"lines": 5})
        assert logs.status_code == 200 and 0 < len(logs.text.splitlines()) <= 5
        status = (await router.client.get("/api/status")).json()
        assert status["models"] == {"echo": "ready"} and status["last_reload"]["ok"]
        assert (await router.client.post("/api/models/nope/load")).status_code == 404


async def test_log_follow_streams_new_lines(tmp_path: Path) -> None:
    async with running_router(write_config(tmp_path, {"echo": fake_model()})) as router:
        await router.client.post("/v1/chat/completions", json=chat("echo"))
        async with router.client.stream("GET", "/api/models/echo/logs", params={"follow": "1"}) as follow:
            lines = follow.aiter_lines()
            await router.client.post("/v1/chat/completions", json=chat("echo", "marker-line please"))
            seen = []
            async with asyncio.timeout(60):
                async for line in lines:
                    seen.append(line)
                    if "/v1/chat/completions" in line and len(seen) > 1:
                        break
        assert any("/v1/chat/completions" in line for line in seen)
