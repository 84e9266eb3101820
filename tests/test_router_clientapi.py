"""The clients' model API: ``status`` on ``/v1/models``, ``GET /v1/models/{id}``, and the llama.cpp
router's ``/models``, ``/models/load``, ``/models/unload`` and ``/models/sse``, in-process (the real app
over fakes: tests/router_fakes.py): a model's statuses over time (the event stream, a load's progress
estimated from procman's last load time, a failed load), the answers, errors and keys."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from procman import State
from tests.router_fakes import Exchange, FakeRouter, fake_router

pytestmark = pytest.mark.timeout(30)


class Events:
    """The ``data:`` events of one ``GET /models/sse`` stream through the app, read with a bound."""

    def __init__(self, router: FakeRouter) -> None:
        self.exchange, self.hang_up = Exchange(), asyncio.Event()
        self.task = asyncio.ensure_future(router.request("GET", "/models/sse", disconnect=self.hang_up,
                                                         into=self.exchange))
        self._read, self._buffer = 0, b""

    async def next(self, timeout_s: float = 10) -> dict[str, Any]:
        async with asyncio.timeout(timeout_s):
            while True:
                for chunk in self.exchange.chunks[self._read:]:
                    self._buffer += chunk
                    self._read += 1
                while b"\n\n" in self._buffer:
                    block, self._buffer = self._buffer.split(b"\n\n", 1)
                    for line in block.decode().splitlines():
                        if line.startswith("data: "):
                            event: dict[str, Any] = json.loads(line[6:])
                            return event
                assert not self.task.done(), "the event stream ended"
                await asyncio.sleep(0.005)

    async def until(self, model: str, status: str) -> list[str]:
        """Statuses ``model`` went through up to and including ``status`` (repeats, i.e. progress events, once)."""
        seen: list[str] = []
        while not seen or seen[-1] != status:
            event = await self.next()
            if event["model"] == model and (not seen or seen[-1] != event["data"]["status"]):
                seen.append(event["data"]["status"])
        return seen

    async def close(self) -> None:
        self.hang_up.set()
        await asyncio.wait_for(self.task, 10)


@contextlib.asynccontextmanager
async def model_events(router: FakeRouter) -> AsyncIterator[Events]:
    events = Events(router)
    try:
        yield events
    finally:
        await events.close()
    assert events.exchange.headers["content-type"].startswith("text/event-stream")


async def _status(client: httpx.AsyncClient, name: str, path: str = "/models") -> dict[str, Any]:
    listed = (await client.get(path)).json()["data"]
    status: dict[str, Any] = next(m for m in listed if m["id"] == name)["status"]
    return status


async def _loaded_after(router: FakeRouter, name: str, fake_s: float, spawned: int) -> None:
    """Its ``spawned``-th process answers the probes after ``fake_s`` of procman's clock (it loads a while)."""
    async with asyncio.timeout(10):
        while len(router.harness.spawner.procs) < spawned:
            await asyncio.sleep(0.005)
    proc = router.harness.spawner.procs[spawned - 1]
    assert router.backend(name).state is State.STARTING and not proc.healthy
    await router.harness.clock.advance(fake_s)
    proc.healthy = True
    async with asyncio.timeout(10):
        while router.backend(name).state is not State.READY:
            await router.harness.clock.advance(0.5)


async def test_status_follows_a_model_through_unloaded_loading_loaded_unloaded(tmp_path: Path) -> None:
    models = {"slow": {"engine": "fake"}, "other": {"engine": "fake"}}
    async with fake_router(tmp_path, models) as router, router.client() as client, model_events(router) as events:
        router.harness.spawner.on_spawn = lambda proc: setattr(proc, "healthy", False)  # a start takes a while
        snapshot = [await events.next(), await events.next()]  # where every model stands on connect
        assert {(e["model"], e["event"], e["data"]["status"]) for e in snapshot} == {
            ("slow", "model_status", "unloaded"), ("other", "model_status", "unloaded")}
        assert (await _status(client, "slow"))["value"] == "unloaded"

        load = await client.post("/models/load", json={"model": "slow"})
        assert (load.status_code, load.json()) == (200, {"success": True})
        await _loaded_after(router, "slow", 1.5, spawned=1)
        assert await events.until("slow", "loaded") == ["loading", "loaded"]
        assert (await _status(client, "slow"))["value"] == "loaded"
        assert (await _status(client, "slow", "/v1/models"))["value"] == "loaded"
        assert (await _status(client, "other"))["value"] == "unloaded"

        unload = await client.post("/models/unload", json={"model": "slow"})
        assert (unload.status_code, unload.json()) == (200, {"success": True})
        assert await events.until("slow", "unloaded") == ["unloaded"]
        assert (await _status(client, "slow"))["value"] == "unloaded"
        assert router.backend("slow").state is State.STOPPED  # gone, not only on its way, before the next load

        # the second load has a measured first load to estimate its progress from
        await client.post("/models/load", json={"model": "slow"})
        loading = await events.next()
        assert loading["data"]["status"] == "loading"
        progress = loading["data"]["progress"]
        assert progress["expected_s"] > 0 and 0 <= progress["value"] < 1 and progress["elapsed_s"] >= 0
        await _loaded_after(router, "slow", 0.5, spawned=2)
        assert (await events.until("slow", "loaded"))[-1] == "loaded"


async def test_a_request_loads_the_model_and_the_stream_says_so(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": {"engine": "fake"}}) as router, model_events(router) as events:
        assert (await events.next())["data"]["status"] == "unloaded"
        reply = await router.post("/v1/chat/completions", {"model": "echo", "messages": [{"role": "user",
                                                                                          "content": "hi"}]})
        assert reply.status == 200
        assert await events.until("echo", "loaded") == ["loading", "loaded"]


async def test_a_failed_load_is_status_failed_and_unload_clears_it(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"broken": {"engine": "fake", "backoff_base_s": 60}}) as router, \
            router.client() as client, model_events(router) as events:
        def fails(proc: Any) -> None:
            proc.say("RuntimeError: weights are corrupt")
            proc.exit(1)

        router.harness.spawner.on_spawn = fails
        await events.next()
        load = await client.post("/models/load", json={"model": "broken"})
        assert load.status_code in (200, 503), load.text  # 503 when the failure came within the answer's wait
        assert (await events.until("broken", "failed"))[-1] == "failed"
        status = await _status(client, "broken")
        assert status["value"] == "failed" and status["failed"] is True and status["exit_code"] not in (None, 0)
        for _ in range(2):  # the first failure retries at once; the second backs off (backoff_base_s)
            again = await client.post("/models/load", json={"model": "broken"})
            if again.status_code != 200:
                break
            assert (await events.until("broken", "failed"))[-1] == "failed"
        assert again.status_code == 503 and again.headers.get("retry-after")  # in backoff: says when to retry
        assert again.json()["error"]["code"] == "model_unavailable"
        message = again.json()["error"]["message"]
        assert "\n" not in message and "backing off" in message and "/api/models/broken/logs" in message
        unload = await client.post("/models/unload", json={"model": "broken"})
        assert unload.json() == {"success": True}
        assert await events.until("broken", "unloaded") == ["unloaded"]


async def test_load_and_unload_answer_like_llama_cpp_when_there_is_nothing_to_do(tmp_path: Path) -> None:
    models = {"echo": {"engine": "fake", "aliases": ["gpt-4o-mini"]}}
    async with fake_router(tmp_path, models) as router, router.client() as client:
        not_loaded = await client.post("/models/unload", json={"model": "echo"})
        assert not_loaded.status_code == 400 and not_loaded.json()["error"]["param"] == "model"
        assert "not loaded" in not_loaded.json()["error"]["message"]
        assert (await client.post("/models/load", json={"model": "gpt-4o-mini"})).json() == {"success": True}
        await router.backend("echo").ensure_ready()
        twice = await client.post("/models/load", json={"model": "echo"})
        assert twice.status_code == 400 and "already loaded" in twice.json()["error"]["message"]


async def test_model_api_errors_are_openai_shaped_and_name_the_fix(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": {"engine": "fake"}}) as router, router.client() as client:
        unknown = await client.post("/models/load", json={"model": "nope"})
        assert unknown.status_code == 404
        assert unknown.json()["error"] | {"message": ""} == {
            "message": "", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
        assert "echo" in unknown.json()["error"]["message"]
        missing = await client.post("/models/load", json={})
        assert (missing.status_code, missing.json()["error"]["param"]) == (400, "model")
        bad = await client.post("/models/unload", content=b"{nope", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] is None
        assert "not valid JSON" in bad.json()["error"]["message"]
        deep = await client.post("/models/load", content=b"[" * 100_000 + b"]" * 100_000,
                                 headers={"content-type": "application/json"})
        assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"]


async def test_retrieve_a_model_by_id_or_alias_with_the_official_sdk(tmp_path: Path) -> None:
    models = {"echo": {"engine": "fake", "aliases": ["gpt-4o-mini"]}, "vision": {"engine": "fake", "task": "vlm"}}
    async with fake_router(tmp_path, models) as router, router.client() as http:
        client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=http)
        try:
            model = await client.models.retrieve("echo")
            assert (model.id, model.object, model.owned_by) == ("echo", "model", "ovrouter")
            alias = await client.models.retrieve("gpt-4o-mini")
            assert alias.id == "gpt-4o-mini" and (alias.model_extra or {})["root"] == "echo"
            vision = (await http.get("/v1/models/vision")).json()
            assert vision["architecture"]["input_modalities"] == ["text", "image"]
            assert vision["status"] == {"value": "unloaded"}
            with pytest.raises(openai.NotFoundError) as caught:
                await client.models.retrieve("nope")
            assert caught.value.code == "model_not_found" and caught.value.param == "model"
            listed = [m.id async for m in client.models.list()]
            assert listed == ["echo", "vision"]
        finally:
            await client.close()


async def test_model_api_auth_follows_api_and_admin_keys(tmp_path: Path) -> None:
    keys = {"api_keys": ["user"], "admin_keys": ["admin"]}
    async with fake_router(tmp_path, {"echo": {"engine": "fake"}}, router=keys) as router:
        async with router.client() as bare:
            user, admin = {"authorization": "Bearer user"}, {"authorization": "Bearer admin"}
            assert (await bare.get("/v1/models/echo")).status_code == 401
            assert (await bare.get("/v1/models/echo", headers=user)).status_code == 200
            assert (await bare.get("/models", headers=user)).status_code == 401
            assert (await bare.post("/models/load", json={"model": "echo"}, headers=user)).status_code == 401
            assert (await bare.get("/models/sse", headers=user)).status_code == 401
            denied = await bare.get("/models", headers=user)
            assert denied.json()["error"]["param"] is None and "admin_keys" in denied.json()["error"]["message"]
            assert (await bare.get("/models", headers=admin)).status_code == 200


async def test_every_router_error_body_has_param(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": {"engine": "fake"}}) as router, router.client() as client:
        answers = [
            await client.post("/v1/chat/completions", content=b"{", headers={"content-type": "text/json"}),
            await client.get("/no/such/route"),
            await client.delete("/v1/models"),
            await client.post("/v1/chat/completions", json={"model": "nope", "messages": []}),
        ]
        assert [a.status_code for a in answers] == [400, 404, 405, 404]
        for answer in answers:
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
        assert answers[0].json()["error"]["param"] is None and answers[3].json()["error"]["param"] == "model"
