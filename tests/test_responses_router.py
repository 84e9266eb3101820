"""The Responses API through a real router over fake-engine model servers, with the official ``openai`` SDK:
create, the strict stream helper, stored conversations (``previous_response_id``, GET, DELETE), tool
round trips, cold-start feedback, a stream resumed after kill -9, and one that cannot be resumed."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.openai_schema import check
from tests.router_helpers import RunningRouter, fake_model, running_router, write_config

pytestmark = pytest.mark.timeout(120)

WORDS = " ".join(f"w{i}" for i in range(24))
STALLING = WORDS.replace("w11 ", "w11 [[stall]] ")  # silent halfway until the process dies; resumed, it ends
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files",
               "format": {"type": "grammar", "syntax": "lark", "definition": "start: patch"}}


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[RunningRouter]:
    models = {"echo": fake_model(fake={"load_s": 0.05, "token_delay_s": 0.02}, aliases=["gpt-5-codex"])}
    async with running_router(write_config(tmp_path, models, router={"responses_store_max": 50})) as running:
        yield running


@pytest.fixture
async def sdk(router: RunningRouter) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as client:
        yield client


async def test_create_stream_and_a_stored_conversation(sdk: openai.AsyncOpenAI, router: RunningRouter) -> None:
    raw = await sdk.responses.with_raw_response.create(model="gpt-5-codex", input="one two three")
    check(json.loads(raw.text), "Response")
    first = raw.parse()
    assert first.output_text == "one two three" and first.usage is not None
    async with sdk.responses.stream(model="echo", input="four five", previous_response_id=first.id) as stream:
        second = await stream.get_final_response()
    assert second.output_text == "four five" and second.previous_response_id == first.id
    assert second.usage is not None  # the earlier turn (its input and output) is now part of the input
    assert second.usage.input_tokens == first.usage.input_tokens + first.usage.output_tokens + 2
    records = [r for r in router.service.console.activity.recent if r.path == "/v1/responses"]
    assert (records[0].prompt_tokens, records[0].completion_tokens) == (3, 3)  # usage read for the metrics
    assert records[1].ttft_s is not None and records[1].completion_tokens == 2  # and the stream's tokens
    stored = await sdk.responses.retrieve(second.id)
    assert stored.output_text == "four five" and stored.previous_response_id == first.id
    items = (await router.client.get(f"/v1/responses/{second.id}/input_items?order=asc")).json()["data"]
    assert [item.get("role") for item in items] == ["user", "assistant", "user"]
    await sdk.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError, match=first.id):
        await sdk.responses.create(model="echo", input="again", previous_response_id=first.id)
    with pytest.raises(openai.BadRequestError, match="resp_unknown"):
        await sdk.responses.create(model="echo", input="x", previous_response_id="resp_unknown")
    unstored = await sdk.responses.create(model="echo", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve(unstored.id)
    counted = (await router.client.post("/v1/responses/input_tokens", json={
        "model": "echo", "input": "four five", "previous_response_id": second.id})).json()
    assert counted["input_tokens"] == second.usage.input_tokens + second.usage.output_tokens + 2


async def test_langchain_chat_openai_on_the_responses_api(router: RunningRouter) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model="echo", base_url=router.url + "/v1", api_key="x", use_responses_api=True,  # type: ignore[arg-type]
                      max_retries=0)
    answer = await chat.ainvoke("hello from langchain")
    assert answer.text == "hello from langchain" and answer.usage_metadata is not None
    called = await chat.bind_tools([WEATHER], tool_choice="get_weather").ainvoke("weather in Oslo?")
    assert called.tool_calls and called.tool_calls[0]["name"] == "get_weather"
    assert called.tool_calls[0]["args"] == {"city": "fake"}


async def test_tool_round_trips_over_previous_response_id(sdk: openai.AsyncOpenAI) -> None:
    first = await sdk.responses.create(model="echo", input="weather in Paris?", tools=[WEATHER],  # type: ignore[list-item]
                                       tool_choice="required")
    call = first.output[0]
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "fake"}
    answer = await sdk.responses.create(model="echo", previous_response_id=first.id, tools=[WEATHER],  # type: ignore[list-item]
                                        input=[{"type": "function_call_output", "call_id": call.call_id,
                                                "output": "sunny"}])
    assert answer.output_text == "tool result: sunny"
    async with sdk.responses.stream(model="echo", input="patch the file", tools=[APPLY_PATCH],  # type: ignore[list-item]
                                    tool_choice={"type": "custom", "name": "apply_patch"}) as stream:
        patch = await stream.get_final_response()
    custom = patch.output[0]
    assert custom.type == "custom_tool_call" and custom.input == "fake"
    done = await sdk.responses.create(model="echo", previous_response_id=patch.id, tools=[APPLY_PATCH],  # type: ignore[list-item]
                                      input=[{"type": "custom_tool_call_output", "call_id": custom.call_id,
                                              "output": "Done!"}])
    assert done.output_text == "tool result: Done!"


async def test_a_cold_model_opens_the_stream_at_once(tmp_path: Path) -> None:
    models = {"slow": fake_model(fake={"load_s": 1.5, "token_delay_s": 0.01}, loading_progress="comments")}
    async with running_router(write_config(tmp_path, models)) as router:
        async with router.client.stream("POST", "/v1/responses", json={
                "model": "slow", "input": "a b c", "stream": True}) as response:
            raw = (await response.aread()).decode()
    blocks = [block for block in raw.split("\n\n") if block.strip()]
    assert blocks[0].startswith("event: response.created") and blocks[1].startswith("event: response.in_progress")
    assert any(block.startswith(": loading slow") for block in blocks[2:])  # sent while the model loaded
    events = _events(raw)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds.count("response.created") == 1 and kinds[-1] == "response.completed"
    assert len({e["response"]["id"] for e in events if "response" in e}) == 1
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "a b c"


async def test_a_stream_whose_backend_is_killed_is_resumed(router: RunningRouter) -> None:
    first = router.backend("echo")
    await router.client.post("/v1/responses", json={"model": "echo", "input": "warm"})
    raw = ""
    async with router.client.stream("POST", "/v1/responses", json={
            "model": "echo", "input": STALLING, "stream": True}) as response:
        async for chunk in response.aiter_text():
            raw += chunk
            if raw.count("response.output_text.delta\n") == 5 and first.pid is not None:
                os.kill(first.pid, signal.SIGKILL)
    events = _events(raw)
    kinds = [e["type"] for e in events]
    assert kinds.count("response.created") == 1 and kinds.count("response.output_item.added") == 1
    assert kinds[-1] == "response.completed" and [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == STALLING == events[-1]["response"]["output"][0]["content"][0]["text"]
    assert events[-1]["response"]["usage"]["output_tokens"] == 25 and router.backend("echo").restarts == 1


async def test_a_fatal_engine_error_mid_stream_is_resumed(router: RunningRouter) -> None:
    """The model server's response.failed (engine_fatal) is cut off; the fresh process continues the text."""
    text = WORDS.replace("w11 ", "w11 [[fatal-mid]] ")
    response = await router.client.post("/v1/responses", json={"model": "echo", "input": text, "stream": True})
    events = _events(response.text)
    kinds = [e["type"] for e in events]
    assert "response.failed" not in kinds and kinds[-1] == "response.completed" and kinds.count("response.created") == 1
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == text
    assert router.backend("echo").restarts == 1


@pytest.mark.parametrize("tools", [[], [WEATHER]], ids=["poison-text", "tool-call"])
async def test_a_stream_that_cannot_be_resumed_ends_with_response_failed(sdk: openai.AsyncOpenAI,
                                                                         tools: list[Any]) -> None:
    """A poison text stream (it kills the resumed process too) and a tool call (never resumed)."""
    extra: dict[str, Any] = {"tools": tools, "tool_choice": "required"} if tools else {}
    async with sdk.responses.stream(model="echo", input="one two [[crash-mid]] three four", **extra) as stream:
        events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.failed"
    assert sum(kind in ("response.completed", "response.failed", "response.incomplete") for kind in kinds) == 1
    failed = events[-1]
    assert failed.type == "response.failed" and failed.response.error is not None
    assert "echo" in failed.response.error.message


def _events(raw: str) -> list[dict[str, Any]]:
    found = []
    for block in raw.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                found.append(json.loads(line[6:]))
    return found


async def test_input_items_are_listed_as_item_resources_in_cursor_pages(sdk: openai.AsyncOpenAI,
                                                                        router: RunningRouter) -> None:
    first = await sdk.responses.create(model="echo", tools=[WEATHER], tool_choice="required", input=[
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather in Oslo?"}]}])
    call = next(item for item in first.output if item.type == "function_call")
    second = await sdk.responses.create(model="echo", previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "4 C"},
        {"role": "user", "content": "thanks"}])
    raw = await router.client.get(f"/v1/responses/{second.id}/input_items")
    check(raw.json(), "ResponseItemList")  # ids, statuses, content parts, first_id / last_id
    newest_first = [item.type for item in (await sdk.responses.input_items.list(second.id)).data]
    assert newest_first == ["message", "function_call_output", "function_call", "message", "message"]  # desc
    oldest_first = [item async for item in sdk.responses.input_items.list(second.id, order="asc", limit=2)]
    assert [item.type for item in oldest_first] == newest_first[::-1]  # the SDK followed the cursor, 2 a page
    assert len({item.id for item in oldest_first}) == 5
    earlier = [item async for item in sdk.responses.input_items.list(first.id, order="asc")]
    assert [item.id for item in earlier] == [item.id for item in oldest_first[:2]]  # an item keeps its id
    assert oldest_first[2].id == call.id and oldest_first[-1].content[0].text == "thanks"
    bad = await router.client.get(f"/v1/responses/{second.id}/input_items?limit=500")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    with pytest.raises(openai.BadRequestError, match="cannot cancel a synchronous response"):
        await sdk.responses.cancel(second.id)  # OpenAI's answer for a response not run in the background
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.cancel("resp_unknown")
