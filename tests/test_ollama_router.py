"""Ollama's API through a real router (in the test's loop) to fake-engine model servers, with the official
``ollama`` client and LangChain's ``ChatOllama``: the router-only endpoints, keep_alive, pull, errors, the
cold start, the listener of ``router.ollama_port``, and the exact calls Home Assistant's integration makes.

``show`` and ``tags`` of the real SmolLM2 and tiny tool model are read from their files: nothing loads them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
from conftest import ROOT

from procman import State
from tests.router_helpers import fake_model, running_router, write_config

QWEN = ROOT / "models" / "qwen2-tools-tiny-ov"


def models(demo_gguf: Path, **fake: Any) -> dict[str, Any]:
    return {
        "fake": fake_model(aliases=["assistant"], **fake),
        "emb": {"task": "embeddings", "engine": "fake", "fake": {"load_s": 0.05}},
        "smollm2": {"task": "llm", "path": str(demo_gguf)},  # never loaded here: show/tags read its file
        "qwen-tools": {"task": "llm", "path": str(QWEN), "options": {"context_length": 2048}},
        "rerank": {"task": "rerank", "engine": "fake"},
    }


def client_for(url: str, **kwargs: Any) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=url + "/ollama", timeout=60, **kwargs)


async def wait_for(condition: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_list_show_version_ps_and_liveness(tmp_path: Path, demo_gguf: Path) -> None:
    async with running_router(write_config(tmp_path, models(demo_gguf))) as router:
        client = client_for(router.url)
        names = {m.model for m in (await client.list()).models}
        assert names == {"fake:latest", "assistant:latest", "emb:latest", "smollm2:latest", "qwen-tools:latest"}
        smol = next(m for m in (await client.list()).models if m.model == "smollm2:latest")
        assert smol.details is not None and (smol.details.family, smol.details.quantization_level,
                                             smol.details.parameter_size, smol.details.format) == (
            "llama", "Q4_1", "135M", "gguf")
        assert smol.size and smol.size > demo_gguf.stat().st_size and smol.digest and len(smol.digest) == 64
        shown = await client.show("smollm2")
        assert shown.capabilities == ["completion"] and shown.modelinfo is not None
        assert shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["llama.context_length"] == 8192
        tools = await client.show("qwen-tools:latest")
        assert tools.capabilities == ["completion", "tools"] and "tools" in (tools.template or "")
        assert tools.modelinfo is not None and tools.modelinfo["qwen2.context_length"] == 2048  # lowered by options
        assert (await client.show("emb")).capabilities == ["embedding"]
        assert tuple(int(p) for p in (await router.client.get("/ollama/api/version")).json()["version"].split(".")) \
            >= (0, 6, 4)
        assert (await client.ps()).models == []
        for method in ("GET", "HEAD"):
            live = await router.client.request(method, "/ollama")
            assert live.status_code == 200 and (method == "HEAD" or live.text == "Ollama is running")
        with pytest.raises(ollama.ResponseError) as missing:
            await client.show("rerank")  # not a model Ollama's API serves
        assert missing.value.status_code == 404 and 'model "rerank" not found, try pulling it first' in \
            missing.value.error


async def test_chat_stream_and_the_final_counts_through_the_router(tmp_path: Path, demo_gguf: Path) -> None:
    async with running_router(write_config(tmp_path, models(demo_gguf))) as router:
        async with router.client.stream("POST", "/ollama/api/chat", json={
                "model": "assistant", "messages": [{"role": "user", "content": "alpha beta gamma"}]}) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("application/x-ndjson")
            parts = [json.loads(line) async for line in response.aiter_lines() if line]
        assert "".join(p["message"]["content"] for p in parts).split() == ["alpha", "beta", "gamma"]
        final = parts[-1]
        assert final["done"] and final["done_reason"] == "stop" and final["model"] == "assistant"
        assert final["load_duration"] > 0, "the cold start is the load"
        client = client_for(router.url)
        answer = await client.chat(model="fake", messages=[{"role": "user", "content": "one two"}])
        assert answer.message.content == "one two" and answer.load_duration is not None
        generated = await client.generate(model="fake", prompt="three four")
        assert generated.response == "three four" and generated.done
        assert (await client.embed(model="emb", input=["x", "y"])).embeddings[1]
        ps = (await client.ps()).models
        assert {m.model for m in ps} == {"fake:latest", "emb:latest"}
        assert all(m.expires_at is not None and m.expires_at > datetime.now(UTC) for m in ps)


async def test_tool_call_through_langchain_bind_tools(tmp_path: Path, demo_gguf: Path) -> None:
    from langchain_ollama import ChatOllama, OllamaEmbeddings

    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city
        """
        return "sunny"

    async with running_router(write_config(tmp_path, models(demo_gguf))) as router:
        llm = ChatOllama(model="fake", base_url=router.url + "/ollama").bind_tools([get_weather])
        message: Any = await llm.ainvoke("What is the weather in Paris? [[tool]]")
        assert [call["name"] for call in message.tool_calls] == ["get_weather"]
        assert isinstance(message.tool_calls[0]["args"], dict) and "city" in message.tool_calls[0]["args"]
        vectors = await OllamaEmbeddings(model="emb", base_url=router.url + "/ollama").aembed_documents(["a", "b"])
        assert len(vectors) == 2 and len(vectors[0]) > 8


async def test_keep_alive_zero_stops_the_model_and_minus_one_keeps_it(tmp_path: Path, demo_gguf: Path) -> None:
    async with running_router(write_config(tmp_path, models(demo_gguf))) as router:
        client = client_for(router.url)
        await client.chat(model="fake", messages=[{"role": "user", "content": "hi"}], keep_alive=0)
        await wait_for(lambda: router.backend("fake").state is State.STOPPED)
        await client.chat(model="fake", messages=[{"role": "user", "content": "hi"}], keep_alive="-1.0s")
        (kept,) = (await client.ps()).models
        assert kept.expires_at is not None and kept.expires_at.year > 2200 and router.backend("fake").kept_loaded
        await client.chat(model="fake", messages=[{"role": "user", "content": "hi"}], keep_alive="1h")
        (timed,) = (await client.ps()).models
        assert timed.expires_at is not None
        left = timed.expires_at - datetime.now(UTC)
        assert timedelta(minutes=50) < left <= timedelta(hours=1, seconds=5)
        await client.generate(model="fake", keep_alive=0)  # Ollama's unload: no prompt, keep_alive 0
        await wait_for(lambda: router.backend("fake").state is State.STOPPED)
        loaded = await client.generate(model="fake")  # Ollama's load: no prompt
        assert loaded.done_reason == "load" and router.backend("fake").state is State.READY
        with pytest.raises(ollama.ResponseError) as bad:
            await client.chat(model="fake", messages=[{"role": "user", "content": "hi"}], keep_alive="soon")
        assert bad.value.status_code == 400 and "invalid duration" in bad.value.error


async def test_pull_loads_a_configured_model_and_refuses_an_unknown_one(tmp_path: Path, demo_gguf: Path) -> None:
    async with running_router(write_config(tmp_path, models(demo_gguf))) as router:
        client = client_for(router.url)
        statuses = [part.status async for part in await client.pull("fake", stream=True)]
        assert statuses[-1] == "success" and router.backend("fake").state is State.READY
        assert (await client.pull("emb:latest")).status == "success"
        assert router.backend("emb").state is State.READY
        for stream in (False, True):
            with pytest.raises(ollama.ResponseError):
                if stream:
                    _ = [part async for part in await client.pull("llama3.2", stream=True)]
                else:
                    await client.pull("llama3.2")


ERRORS = [
    ("POST", "/ollama/api/chat", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404,
     'model "nope" not found, try pulling it first'),
    ("POST", "/ollama/api/embed", {"model": "fake", "input": "x"}, 400, "does not support embeddings"),
    ("POST", "/ollama/api/create", {"model": "x", "from": "fake"}, 400, "config file"),
    ("DELETE", "/ollama/api/delete", {"model": "fake"}, 400, "config file"),
    ("POST", "/ollama/api/chat", {"messages": []}, 400, "model is required"),
    ("POST", "/ollama/api/show", {"model": "llama3.2"}, 404, "not found"),
    ("GET", "/ollama/api/nothing", None, 404, "404"),
]


async def test_errors_are_ollama_shaped(tmp_path: Path, demo_gguf: Path) -> None:
    async with running_router(write_config(tmp_path, models(demo_gguf))) as router:
        for method, path, body, status, words in ERRORS:
            response = await router.client.request(method, path, json=body)
            assert response.status_code == status and words in response.json()["error"], (path, response.text)


async def test_api_keys_guard_the_ollama_api(tmp_path: Path, demo_gguf: Path) -> None:
    path = write_config(tmp_path, models(demo_gguf), router={"api_keys": ["secret"]})
    async with running_router(path) as router:
        with pytest.raises(ollama.ResponseError) as refused:
            await client_for(router.url).list()
        assert refused.value.status_code == 401
        keyed = client_for(router.url, headers={"Authorization": "Bearer secret"})
        assert len((await keyed.list()).models) == 5
        assert (await keyed.chat(model="fake", messages=[{"role": "user", "content": "ok"}])).message.content == "ok"
        assert (await router.client.get("/ollama")).status_code == 200  # liveness stays open
        preflight = await router.client.options("/ollama/api/chat", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})  # a page on this machine
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"


async def test_a_cold_streamed_chat_sends_nothing_until_its_first_token(tmp_path: Path, demo_gguf: Path) -> None:
    cold = models(demo_gguf, fake={"load_s": 2.0, "token_delay_s": 0.01}, request_timeout_s=0.5,
                  stream_idle_timeout_s=0.5, loading_progress="comments")
    async with running_router(write_config(tmp_path, cold)) as router:
        async with router.client.stream("POST", "/ollama/api/chat", json={
                "model": "fake", "messages": [{"role": "user", "content": "slow start"}]}) as response:
            assert router.backend("fake").state is State.READY, "the head went out before the model was ready"
            parts = [json.loads(line) async for line in response.aiter_lines() if line]
        assert "".join(p["message"]["content"] for p in parts).split() == ["slow", "start"] and parts[-1]["done"]
        assert parts[-1]["load_duration"] >= 1_000_000_000


async def test_a_stream_whose_process_dies_ends_with_an_error_line(tmp_path: Path, demo_gguf: Path) -> None:
    async with running_router(write_config(tmp_path, models(demo_gguf))) as router:
        for marker in ("[[crash-mid]]", "[[fatal-mid]]"):
            body = {"model": "fake", "messages": [{"role": "user", "content": f"one two three four {marker}"}]}
            async with router.client.stream("POST", "/ollama/api/chat", json=body) as response:
                parts = [json.loads(line) async for line in response.aiter_lines() if line]
            assert response.status_code == 200 and "one" in parts[0]["message"]["content"]
            assert isinstance(parts[-1].get("error"), str) and not any(p.get("done") for p in parts), parts[-1]
            assert [p for p in parts if "error" in p] == [parts[-1]], "one error line, the last"
        with pytest.raises(ollama.ResponseError):
            _ = [p async for p in await client_for(router.url).chat(model="fake", stream=True, messages=[
                {"role": "user", "content": "five six seven eight [[crash-mid]]"}])]


async def test_ollama_port_serves_the_api_at_its_root(tmp_path: Path, demo_gguf: Path) -> None:
    main, second = socket.socket(), socket.socket()
    for sock in (main, second):
        sock.bind(("127.0.0.1", 0))
    port = second.getsockname()[1]
    path = write_config(tmp_path, models(demo_gguf), router={"ollama_port": port})
    async with running_router(path, sockets=[main, second]) as router:
        root = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=root, timeout=30) as http:
            assert (await http.get("/")).text == "Ollama is running"
            assert (await http.get("/v1/models")).json()["object"] == "list"  # Ollama serves /v1 too
            missing = (await http.get("/api/models")).json()["error"]  # the path as sent, not the inner /ollama
            assert missing.startswith("404 page not found: GET /api/models is not") and "router.port" in missing
        client = ollama.AsyncClient(host=root, timeout=60)
        assert "fake:latest" in {m.model for m in (await client.list()).models}
        answer = await client.chat(model="fake", messages=[{"role": "user", "content": "root path"}], stream=False)
        assert answer.message.content == "root path"
        assert (await router.client.get("/api/models")).status_code == 200, "the management /api stays on port"
        assert (await router.client.get("/ollama/v1/models")).json()["object"] == "list"


async def test_home_assistant_setup_and_a_conversation_turn(tmp_path: Path, demo_gguf: Path) -> None:
    """What Home Assistant 2026.2's Ollama integration (ollama 0.5.1) sends, byte for byte in shape."""
    async with running_router(write_config(tmp_path, models(demo_gguf))) as router:
        http = router.client
        for _ in range(4):  # config flow and entry setup: tags, each entry's `model`
            listed = (await http.get("/ollama/api/tags")).json()["models"]
            assert "assistant:latest" in [entry["model"] for entry in listed]
        pulled = await http.post("/ollama/api/pull", json={"model": "assistant:latest", "insecure": False,
                                                           "stream": False})
        assert pulled.json() == {"status": "success"}
        tools = [{"type": "function", "function": {"name": "HassTurnOn", "description": "Turns on a device",
                                                   "parameters": {"type": "object", "properties": {
                                                       "name": {"type": "string"}}, "required": ["name"]}}}]
        history: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a voice assistant for Home Assistant."},
            {"role": "user", "content": "turn on the kitchen light [[tool]]"}]
        turn = {"model": "assistant:latest", "stream": True, "keep_alive": "-1.0s", "options": {"num_ctx": 8192.0},
                "think": False}
        answer = await http.post("/ollama/api/chat", json={**turn, "messages": history, "tools": tools})
        parts = [json.loads(line) for line in answer.text.splitlines() if line]
        calls = [c for p in parts for c in p.get("message", {}).get("tool_calls") or []]
        assert [c["function"]["name"] for c in calls] == ["HassTurnOn"]
        assert isinstance(calls[0]["function"]["arguments"], dict)
        assert not "".join(p["message"]["content"] for p in parts)
        history += [{"role": "assistant", "content": "", "tool_calls": [{"function": calls[0]["function"]}]},
                    {"role": "tool", "content": json.dumps({"success": True})}]  # no ids, no tool_name
        answer = await http.post("/ollama/api/chat", json={**turn, "messages": history, "tools": tools})
        parts = [json.loads(line) for line in answer.text.splitlines() if line]
        assert "success" in "".join(p["message"]["content"] for p in parts) and parts[-1]["done"]
        schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
        task = await http.post("/ollama/api/chat", json={**turn, "stream": False, "tools": [], "format": schema,
                                                         "messages": [{"role": "user", "content": "name it"}]})
        assert "title" in json.loads(task.json()["message"]["content"])
        (loaded,) = (await http.get("/ollama/api/ps")).json()["models"]
        assert loaded["model"] == "fake:latest" and loaded["expires_at"].startswith("2318")
