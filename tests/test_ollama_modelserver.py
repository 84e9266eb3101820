"""The model server's Ollama routes (``/ollama/api/chat|generate|embed|embeddings``) on the fake engine,
in process, through the official ``ollama`` client and raw NDJSON: framing, final fields, tools, errors."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import ollama
import pytest
from tasks_helpers import image_data_url

from modelserver.app import build_app
from modelserver.engines.fake import FakeEmbedder, FakeTextGenerator
from modelserver.engines.fake_media import FakeVisionGenerator
from modelserver.spec import build_model_spec

FINAL_COUNTS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
                "eval_duration")


def chat_app() -> Any:
    spec = build_model_spec("fake", {"engine": "fake", "fake": {"token_delay_s": 0, "load_s": 0}})
    return build_app(spec, FakeTextGenerator(spec))


def embed_app(**options: Any) -> Any:
    spec = build_model_spec("emb", {"engine": "fake", "task": "embeddings", "fake": {"load_s": 0}, "options": options})
    return build_app(spec, FakeEmbedder(spec))


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=chat_app()), base_url="http://ms") as client:
        yield client


@pytest.fixture
async def client() -> AsyncIterator[ollama.AsyncClient]:
    yield ollama.AsyncClient(host="http://ms/ollama", transport=httpx.ASGITransport(app=chat_app()))


def lines(body: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in body.splitlines() if line.strip()]


async def test_chat_streams_ndjson_ending_with_the_counts(http: httpx.AsyncClient) -> None:
    body = {"model": "fake:latest", "messages": [{"role": "user", "content": "one two three"}]}
    response = await http.post("/ollama/api/chat", json=body, headers={"x-ovrouter-load-ns": "1500"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/x-ndjson")
    parts = lines(response.content)
    assert all(part["model"] == "fake:latest" and part["created_at"].endswith("Z") for part in parts)
    assert [p["done"] for p in parts] == [False] * (len(parts) - 1) + [True]
    text = "".join(p["message"]["content"] for p in parts)
    assert text.split() == ["one", "two", "three"]
    final = parts[-1]
    assert final["done_reason"] == "stop" and final["load_duration"] == 1500
    assert all(isinstance(final[k], int) and final[k] >= 0 for k in FINAL_COUNTS)
    assert final["eval_count"] >= 3 and final["total_duration"] >= final["eval_duration"]


async def test_chat_without_stream_is_one_object_through_the_client(client: ollama.AsyncClient) -> None:
    answer = await client.chat(model="fake", messages=[{"role": "user", "content": "hello there"}], stream=False,
                               options={"num_predict": 1, "temperature": 0.0, "num_ctx": 8192.0})
    assert answer.done and answer.done_reason == "length"
    assert answer.message.role == "assistant" and answer.message.content == "hello"
    assert answer.eval_count == 1 and (answer.prompt_eval_count or 0) > 0


async def test_a_tool_call_comes_back_with_object_arguments(client: ollama.AsyncClient) -> None:
    def get_weather(city: str, days: int) -> str:
        """Forecast.

        Args:
            city: the city
            days: how many days
        """
        return "sunny"

    for stream in (False, True):
        if stream:
            parts = [p async for p in await client.chat(model="fake", messages=[
                {"role": "user", "content": "weather? [[tool]]"}], tools=[get_weather], stream=True)]
            calls = [c for p in parts for c in (p.message.tool_calls or [])]
            assert parts[-1].done
        else:
            answer = await client.chat(model="fake", messages=[{"role": "user", "content": "weather? [[tool]]"}],
                                       tools=[get_weather])
            calls = list(answer.message.tool_calls or [])
            assert not answer.message.content
        assert [c.function.name for c in calls] == ["get_weather"]
        assert isinstance(calls[0].function.arguments, dict) and set(calls[0].function.arguments) >= {"city", "days"}


async def test_options_tool_choice_forces_a_call_and_history_without_ids_renders(client: ollama.AsyncClient) -> None:
    tools: Any = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
                                                                                        "properties": {}}}}]
    answer = await client.chat(model="fake", messages=[{"role": "user", "content": "time?"}], tools=tools,
                               options={"tool_choice": "required"})
    assert [c.function.name for c in answer.message.tool_calls or []] == ["get_time"]
    call = {"function": {"name": "get_time", "arguments": {}}}
    history = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "content": "12:00"}]
    answer = await client.chat(model="fake", messages=history, tools=tools)
    assert "12:00" in (answer.message.content or "")


async def test_generate_templated_and_raw(client: ollama.AsyncClient) -> None:
    answer = await client.generate(model="fake", prompt="red green", system="be brief")
    assert answer.response.split() == ["red", "green"] and answer.done
    parts = [p async for p in await client.generate(model="fake", prompt="blue", raw=True, stream=True)]
    assert "".join(p.response for p in parts).strip() == "blue" and parts[-1].done_reason == "stop"


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/ollama/api/chat", {"model": "fake", "messages": [{"role": "user", "content": "x"}], "think": True}, 400,
         "does not support thinking"),
        ("/ollama/api/chat", {"model": "fake", "messages": []}, 400, "messages"),
        ("/ollama/api/chat", {"model": "fake", "messages": [{"role": "user", "content": "x"}],
                              "options": {"temperature": "hot"}}, 400, "options.temperature"),
        ("/ollama/api/chat", {"model": "fake", "messages": [{"role": "user", "content": "x"}], "format": "yaml"},
         400, "format"),
        ("/ollama/api/generate", {"model": "fake", "prompt": "x", "suffix": "y"}, 400, "does not support insert"),
        ("/ollama/api/chat", b"{not json", 400, "JSON"),
        ("/ollama/api/chat", {"model": "fake", "messages": [{"role": "user", "content": "[[error]]"}],
                              "stream": False}, 500, "injected error"),
    ],
)
async def test_errors_are_ollama_shaped(http: httpx.AsyncClient, path: str, body: Any, status: int,
                                        words: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await http.post(path, content=content)
    assert response.status_code == status
    error = response.json()["error"]
    assert isinstance(error, str) and words in error


async def test_an_error_mid_stream_is_an_error_line(http: httpx.AsyncClient) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "a b c d [[fatal-mid]]"}]}
    response = await http.post("/ollama/api/chat", json=body)
    parts = lines(response.content)
    assert response.status_code == 200 and "error" in parts[-1] and not any(p.get("done") for p in parts)


async def test_embed_and_the_older_embeddings() -> None:
    client = ollama.AsyncClient(host="http://ms/ollama", transport=httpx.ASGITransport(app=embed_app()))
    answer = await client.embed(model="emb", input=["one", "two"])
    assert len(answer.embeddings) == 2 and len(answer.embeddings[0]) > 8 and answer.prompt_eval_count
    single = await client.embeddings(model="emb", prompt="one")
    assert list(single.embedding) == list(answer.embeddings[0])
    with pytest.raises(ollama.ResponseError) as refused:
        await client.embed(model="emb", input="one", dimensions=4)
    assert refused.value.status_code == 400 and "dimensions" in refused.value.error
    matryoshka = ollama.AsyncClient(host="http://ms/ollama", transport=httpx.ASGITransport(app=embed_app(
        matryoshka=True)))
    short = (await matryoshka.embed(model="emb", input=["one", "two"], dimensions=4)).embeddings
    assert [len(v) for v in short] == [4, 4] and abs(sum(x * x for x in short[0]) - 1.0) < 1e-6


async def test_images_reach_a_vision_model_and_a_text_model_refuses_them(client: ollama.AsyncClient) -> None:
    spec = build_model_spec("vis", {"engine": "fake", "task": "vlm", "fake": {"token_delay_s": 0, "load_s": 0}})
    vision = ollama.AsyncClient(host="http://ms/ollama",
                                transport=httpx.ASGITransport(app=build_app(spec, FakeVisionGenerator(spec))))
    png = base64.b64decode(image_data_url(60, 40).split(",", 1)[1])
    answer = await vision.chat(model="vis", messages=[{"role": "user", "content": "what is it", "images": [png]}])
    assert "[image 60x40]" in (answer.message.content or "")
    generated = await vision.generate(model="vis", prompt="describe", images=[png])
    assert "[image 60x40]" in generated.response
    with pytest.raises(ollama.ResponseError) as refused:
        await client.chat(model="fake", messages=[{"role": "user", "content": "what is it", "images": [png]}])
    assert refused.value.status_code == 400
