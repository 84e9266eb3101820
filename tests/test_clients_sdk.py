"""The clients people point at the router, run through a real router over fake-engine model
servers: the official Python SDK (tools, streamed tool calls, structured output, models,
embeddings), LangChain (``bind_tools``, ``with_structured_output``, ``OpenAIEmbeddings``),
Node's ``openai`` package when ``make node-deps`` installed it, and every body checked
against the official OpenAI OpenAPI spec.

The fake engine answers tools and output constraints deterministically (see
``modelserver/engines/fake.py``): a forced ``tool_choice`` answers one call with arguments
built from the function's schema, a tool result is echoed as ``tool result: <content>``,
and ``response_format`` answers an example of the schema.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.openai_schema import check
from tests.router_helpers import RunningRouter, fake_model, running_router, write_config

pytestmark = pytest.mark.timeout(180)

NODE_DIR = Path(__file__).parent / "node"

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}


class Weather(BaseModel):
    """What the structured-output tests ask for."""

    city: str
    temperature_c: float = Field(ge=-90, le=60)
    sky: Literal["clear", "cloudy", "rain"]


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[RunningRouter]:
    models = {
        "echo": fake_model(aliases=["gpt-4o-mini"]),
        "emb": fake_model(task="embeddings", fake={"load_s": 0.05, "dims": 32}),
    }
    async with running_router(write_config(tmp_path, models)) as running:
        yield running


@pytest.fixture
async def client(router: RunningRouter) -> AsyncIterator[openai.AsyncOpenAI]:
    sdk = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    yield sdk
    await sdk.close()


# -- the official Python SDK ---------------------------------------------------------------------


async def test_two_turn_tool_exchange(client: openai.AsyncOpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=messages, tools=[WEATHER_TOOL], tool_choice="required")
    check(json.loads(raw.text), "CreateChatCompletionResponse")
    first = raw.parse()
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")

    messages.append(choice.message.model_dump(exclude_none=True))  # the assistant turn, content null
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"})
    raw = await client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=messages,
                                                                 tools=[WEATHER_TOOL])
    check(json.loads(raw.text), "CreateChatCompletionResponse")
    second = raw.parse().choices[0]
    assert second.finish_reason == "stop" and not second.message.tool_calls
    assert "18 C and sunny" in (second.message.content or "")


async def test_streamed_tool_calls_are_assembled_by_the_sdk(client: openai.AsyncOpenAI) -> None:
    async with client.chat.completions.stream(
        model="echo", messages=[{"role": "user", "content": "weather in Oslo"}], tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream_options={"include_usage": True},
    ) as stream:
        final = await stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id
    assert set(json.loads(call.function.arguments)) == {"city", "unit"}
    assert final.usage is not None and final.usage.completion_tokens > 0


async def test_stream_chunks_match_the_spec(client: openai.AsyncOpenAI) -> None:
    response = await client.chat.completions.with_raw_response.create(
        model="echo", messages=[{"role": "user", "content": "[[tool]] call it"}], tools=[WEATHER_TOOL],
        stream=True, stream_options={"include_usage": True})
    chunks = []
    async for line in response.http_response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[6:]))
    assert chunks, "no chunks"
    for chunk in chunks:
        check(chunk, "CreateChatCompletionStreamResponse")
    assert any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] > 0


async def test_structured_output_with_parse(client: openai.AsyncOpenAI) -> None:
    parsed = await client.chat.completions.parse(
        model="echo", messages=[{"role": "user", "content": "weather in Rome as JSON"}], response_format=Weather)
    message = parsed.choices[0].message
    assert message.refusal is None and isinstance(message.parsed, Weather)
    json_object = await client.chat.completions.with_raw_response.create(
        model="echo", messages=[{"role": "user", "content": "say hi"}], response_format={"type": "json_object"})
    check(json.loads(json_object.text), "CreateChatCompletionResponse")
    assert isinstance(json.loads(json_object.parse().choices[0].message.content or ""), dict)


async def test_models_and_embeddings_match_the_spec(router: RunningRouter, client: openai.AsyncOpenAI) -> None:
    listed = await client.models.with_raw_response.list()
    check(json.loads(listed.text), "ListModelsResponse")
    retrieved = await client.models.with_raw_response.retrieve("gpt-4o-mini")
    check(json.loads(retrieved.text), "Model")
    assert retrieved.parse().id == "gpt-4o-mini"
    vectors = (await client.embeddings.create(model="emb", input=["a cat", "a dog"])).data  # base64 by default
    assert [len(v.embedding) for v in vectors] == [32, 32]
    floats = await client.embeddings.with_raw_response.create(model="emb", input="a cat", encoding_format="float")
    check(json.loads(floats.text), "CreateEmbeddingResponse")  # the spec's schema describes float arrays only
    assert floats.parse().data[0].embedding == pytest.approx(vectors[0].embedding, rel=1e-6)


async def test_error_bodies_match_the_spec(router: RunningRouter, client: openai.AsyncOpenAI) -> None:
    answers = [
        await router.client.post("/v1/chat/completions", json={"model": "nope", "messages": []}),
        await router.client.post("/v1/chat/completions", content=b"{", headers={"content-type": "text/json"}),
        await router.client.get("/v1/no/such/thing"),
        await router.client.get("/v1/models/nope"),
        await router.client.post("/v1/chat/completions", json={"model": "echo", "messages": "hi"}),
        await router.client.post("/models/load", json={}),
    ]
    assert [a.status_code for a in answers] == [404, 400, 404, 404, 400, 400]
    for answer in answers:
        check(answer.json(), "ErrorResponse")
    with pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert caught.value.code == "model_not_found" and caught.value.param == "model"


# -- LangChain ------------------------------------------------------------------------------------


def _chat(router: RunningRouter, **kwargs: Any) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=router.url + "/v1", api_key="unused", model="echo", max_retries=0,
                                       **kwargs)


async def test_langchain_bind_tools(router: RunningRouter) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"18 C in {city}"

    llm = _chat(router).bind_tools([get_weather], tool_choice="get_weather")
    question = HumanMessage("weather in Lisbon?")
    reply = await llm.ainvoke([question])
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    assert set(reply.tool_calls[0]["args"]) == {"city"}
    result = ToolMessage(get_weather.invoke(reply.tool_calls[0]["args"]), tool_call_id=reply.tool_calls[0]["id"])
    answer = await _chat(router).bind_tools([get_weather]).ainvoke([question, reply, result])
    assert not answer.tool_calls and "18 C in" in answer.content

    chunks = [chunk async for chunk in llm.astream([question])]
    assembled = chunks[0]
    for chunk in chunks[1:]:
        assembled = assembled + chunk
    assert assembled.tool_calls and assembled.tool_calls[0]["name"] == "get_weather"


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
async def test_langchain_with_structured_output(router: RunningRouter, method: str) -> None:
    llm = _chat(router).with_structured_output(Weather, method=method)
    prompt = "Report the weather in Berlin as JSON with keys city, temperature_c and sky."
    if method == "json_mode":  # json_mode has no schema to fill: the fake's json_object answer is {"text": ...}
        raw = await _chat(router).with_structured_output(None, method="json_mode").ainvoke(prompt)
        assert isinstance(raw, dict) and raw["text"] == prompt
        return
    result = await llm.ainvoke(prompt)
    assert isinstance(result, Weather) and result.sky in ("clear", "cloudy", "rain")


async def test_langchain_embeddings(router: RunningRouter) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    # LangChain's default tokenizes with tiktoken first (token-id arrays, and a download on first use);
    # check_embedding_ctx_length=False sends the text itself, which every embeddings model here takes.
    embeddings = langchain_openai.OpenAIEmbeddings(base_url=router.url + "/v1", api_key="unused", model="emb",
                                                   check_embedding_ctx_length=False, max_retries=0)
    vectors = await embeddings.aembed_documents(["a cat sits on the mat", "stock markets fell"])
    query = await embeddings.aembed_query("a cat sits on the mat")
    assert [len(v) for v in vectors] == [32, 32] and query == pytest.approx(vectors[0], rel=1e-6)


async def test_langchain_openai_llm_batch(router: RunningRouter) -> None:
    # LangChain's completion-model wrapper sends a batch as one /v1/completions request with a list of prompts
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.OpenAI(base_url=router.url + "/v1", api_key="unused", model="echo", max_tokens=16,
                                  max_retries=0)
    prompts = ["one two", "three four five", "six"]
    assert await llm.abatch(prompts) == prompts
    result = await llm.agenerate(prompts)
    assert [g[0].text for g in result.generations] == prompts
    assert result.llm_output is not None and result.llm_output["token_usage"]["prompt_tokens"] == 2 + 3 + 1


# -- Node's openai package ---------------------------------------------------------------------------


async def test_node_openai_sdk(router: RunningRouter) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    if not (NODE_DIR / "node_modules" / "openai").is_dir():
        pytest.skip("the openai npm package is not installed: run `make node-deps` (needs npm)")
    process = await asyncio.create_subprocess_exec(
        node, str(NODE_DIR / "client.mjs"), router.url + "/v1", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, cwd=NODE_DIR, env={**os.environ, "NODE_NO_WARNINGS": "1"})
    try:
        output, _ = await asyncio.wait_for(process.communicate(), 120)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    text = output.decode(errors="replace")
    assert process.returncode == 0, text
    results = json.loads(text.strip().splitlines()[-1])
    assert results == {"retrieve": "gpt-4o-mini", "chat": "a b c", "tool": "get_weather",
                       "streamed_tool": "get_weather", "not_found": 404, "models": ["echo", "emb"]}, results
