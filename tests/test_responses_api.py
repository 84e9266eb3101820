"""``/v1/responses`` on the model server in process (the fake engine), through the official ``openai`` SDK.

The fake engine echoes the last user message word by word; a forced ``tool_choice`` answers one
call with arguments built from the schema; a tool result is echoed as ``tool result: <output>``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from modelserver.app import build_app
from modelserver.engines.fake import FakeTextGenerator
from modelserver.spec import build_model_spec

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files",
               "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"}}
CODEX_EXTRAS: dict[str, Any] = {
    "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "medium", "summary": "auto"},
    "prompt_cache_key": "abc", "client_metadata": {"x": 1}, "text": {"verbosity": "low"},
    "tools": [WEATHER, {"type": "web_search"}, {"type": "namespace", "name": "ns", "tools": []},
              {"type": "tool_search"}],
}


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    spec = build_model_spec("fake", {"engine": "fake", "task": "llm", "fake": {"token_delay_s": 0, "load_s": 0},
                                     "options": {"context_length": 50}})
    transport = httpx.ASGITransport(app=build_app(spec, FakeTextGenerator(spec)))
    async with httpx.AsyncClient(transport=transport, base_url="http://modelserver") as client:
        yield client


@pytest.fixture
async def sdk(http: httpx.AsyncClient) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url="http://modelserver/v1", api_key="x", http_client=http,
                                  max_retries=0) as client:
        yield client


async def test_create_answers_a_message_with_usage(sdk: openai.AsyncOpenAI) -> None:
    response = await sdk.responses.create(model="fake", input="hello big world", instructions="be brief")
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.output_text == "hello big world"
    assert [item.type for item in response.output] == ["message"]
    assert response.usage is not None and response.usage.output_tokens == 3
    assert response.usage.input_tokens == 5 and response.usage.total_tokens == 8  # instructions are counted
    assert response.usage.input_tokens_details.cached_tokens == 0


async def test_the_sdk_stream_helper_accepts_the_stream(sdk: openai.AsyncOpenAI) -> None:
    async with sdk.responses.stream(model="fake", input="one two three") as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert final.output_text == "one two three" and final.status == "completed"
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds.count("response.output_text.delta") == 3 and kinds[-1] == "response.completed"


async def test_stream_events_are_numbered_in_order(http: httpx.AsyncClient) -> None:
    events = await _events(http, {"model": "fake", "input": "a b", "stream": True})
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    delta = next(e for e in events if e["type"] == "response.output_text.delta")
    assert delta["output_index"] == 0 and delta["content_index"] == 0 and delta["item_id"].startswith("msg_")
    assert len({e["response"]["id"] for e in events if "response" in e}) == 1


async def test_a_function_tool_round_trip(sdk: openai.AsyncOpenAI) -> None:
    first = await sdk.responses.create(model="fake", input="weather in Paris?", tools=[WEATHER],  # type: ignore[list-item]
                                       tool_choice="required")
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "fake"}
    second = await sdk.responses.create(model="fake", tools=[WEATHER], input=[  # type: ignore[list-item]
        {"role": "user", "content": "weather in Paris?"}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ])
    assert second.output_text == "tool result: sunny"


async def test_a_custom_tool_call_comes_back_as_its_input_string(sdk: openai.AsyncOpenAI) -> None:
    response = await sdk.responses.create(model="fake", input="patch it", tools=[APPLY_PATCH],  # type: ignore[list-item]
                                          tool_choice={"type": "custom", "name": "apply_patch"})
    call = response.output[0]
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.input == "fake"
    follow = await sdk.responses.create(model="fake", tools=[APPLY_PATCH], input=[  # type: ignore[list-item]
        {"role": "user", "content": "patch it"}, call.model_dump(exclude_none=True),
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"},
    ])
    assert follow.output_text == "tool result: Done!"


async def test_a_streamed_custom_tool_call(sdk: openai.AsyncOpenAI) -> None:
    async with sdk.responses.stream(model="fake", input="patch it", tools=[APPLY_PATCH],  # type: ignore[list-item]
                                    tool_choice={"type": "custom", "name": "apply_patch"}) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert "response.custom_tool_call_input.done" in kinds and "response.output_text.delta" not in kinds
    assert final.output[0].type == "custom_tool_call" and final.output[0].input == "fake"


async def test_max_output_tokens_ends_incomplete(sdk: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
    response = await sdk.responses.create(model="fake", input="a b c d e", max_output_tokens=2)
    assert response.status == "incomplete" and response.output_text == "a b"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    events = await _events(http, {"input": "a b c d e", "max_output_tokens": 2, "stream": True})
    assert events[-1]["type"] == "response.incomplete"


async def test_what_codex_sends_is_accepted(http: httpx.AsyncClient) -> None:
    body = {"model": "fake", "store": False, "stream": True, **CODEX_EXTRAS, "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sys"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "zzz"},
        {"type": "message", "id": "m1", "role": "user", "content": [{"type": "input_text", "text": "hi there"}]},
    ]}
    events = await _events(http, body)
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "hi there"


async def test_json_schema_text_format(sdk: openai.AsyncOpenAI) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    response = await sdk.responses.create(model="fake", input="a number", text={
        "format": {"type": "json_schema", "name": "num", "schema": schema}})
    assert json.loads(response.output_text) == {"n": 1}


async def test_input_tokens_counts_what_the_request_is_charged(sdk: openai.AsyncOpenAI,
                                                               http: httpx.AsyncClient) -> None:
    body = {"model": "fake", "input": "four words right here", "instructions": "two more"}
    counted = (await http.post("/v1/responses/input_tokens", json=body)).json()
    assert counted == {"object": "response.input_tokens", "input_tokens": 6}
    assert (await http.post("/v1/responses", json=body)).json()["usage"]["input_tokens"] == 6


async def test_errors(http: httpx.AsyncClient) -> None:
    unknown = await http.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"})
    assert unknown.status_code == 400 and "resp_nope" in unknown.json()["error"]["message"]
    long = await http.post("/v1/responses", json={"input": "w " * 60})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    bad = await http.post("/v1/responses", json={"input": [{"role": "robot", "content": "x"}]})
    assert bad.status_code == 400 and "input[0].role" in bad.json()["error"]["message"]


async def test_an_engine_error_mid_stream_ends_with_response_failed(http: httpx.AsyncClient) -> None:
    events = await _events(http, {"input": "one two [[fatal-mid]] four", "stream": True})
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "engine_fatal"
    assert [e["type"] for e in events].count("response.failed") == 1


async def test_the_routers_response_id_is_used(http: httpx.AsyncClient) -> None:
    answer = await http.post("/v1/responses", json={"input": "x"}, headers={"x-ovrouter-response-id": "resp_abc123"})
    assert answer.json()["id"] == "resp_abc123" and answer.json()["output"][0]["id"] == "msg_abc123_0"


async def _events(http: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    answer = await http.post("/v1/responses", json=body)
    assert answer.status_code == 200, answer.text
    events = []
    for block in answer.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            event = json.loads(lines["data"])
            assert lines.get("event") == event["type"]
            events.append(event)
    return events
