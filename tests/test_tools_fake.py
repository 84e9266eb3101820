"""Tools, structured output and ``n`` through the HTTP surface with the fake engine, via the official SDK.

The model server runs in process (httpx.ASGITransport), so the SDK's own parsing and its
assembly of streamed ``delta.tool_calls`` are what is tested, in milliseconds.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from tasks_helpers import assert_error, sse_events

from modelserver.api.toolplan import chat_plan
from modelserver.app import build_app
from modelserver.engines.fake import FakeTextGenerator
from modelserver.protocol import ChatCompletionRequest
from modelserver.spec import build_model_spec
from modelserver.structured import ToolGrammar

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
ASK = [{"role": "user", "content": "weather in Paris?"}]


def app_for(**extra: Any) -> Any:
    spec = build_model_spec("fake", {"engine": "fake", "fake": {"token_delay_s": 0, "load_s": 0}, **extra})
    return build_app(spec, FakeTextGenerator(spec))


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app_for()), base_url="http://ms") as client:
        yield client


@pytest.fixture
async def sdk(http: httpx.AsyncClient) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url="http://ms/v1", api_key="x", http_client=http, max_retries=0) as client:
        yield client


async def test_required_tool_choice_answers_a_schema_valid_call(sdk: openai.AsyncOpenAI) -> None:
    answer = await sdk.chat.completions.create(model="fake", messages=ASK, tools=TOOLS, tool_choice="required")
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


async def test_named_tool_choice_calls_that_function(sdk: openai.AsyncOpenAI) -> None:
    named: Any = {"type": "function", "function": {"name": "get_time"}}
    answer = await sdk.chat.completions.create(model="fake", messages=ASK, tools=TOOLS, tool_choice=named)
    calls = answer.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_time", {})]


@pytest.mark.parametrize(
    ("tool_choice", "extra", "mode"),
    [
        ("required", {}, "one"),  # the default parallel_tool_calls does not let a weak model loop
        ("required", {"parallel_tool_calls": False}, "one"),
        ("required", {"parallel_tool_calls": True}, "many"),  # asked for explicitly: one or more
        ({"type": "function", "function": {"name": "get_time"}}, {"parallel_tool_calls": True}, "one"),
        ({"type": "function", "function": {"name": "get_time"}}, {}, "one"),
    ],
)
def test_forced_tool_choice_is_one_call_unless_parallel_calls_are_asked_for(
    tool_choice: Any, extra: dict[str, Any], mode: str
) -> None:
    body = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS, "tool_choice": tool_choice, **extra})
    _, constraint, parse = chat_plan(body, "hermes")
    assert isinstance(constraint, ToolGrammar) and constraint.mode == mode and parse
    if isinstance(tool_choice, dict):
        assert [t.name for t in constraint.tags] == ["get_time"]


@pytest.mark.parametrize("max_tokens", [1, 2, 4])
async def test_a_call_cut_by_max_tokens_leaves_no_fragment_in_content(http: httpx.AsyncClient, max_tokens: int) -> None:
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": max_tokens}
    whole = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert whole["finish_reason"] == "length" and not whole["message"].get("tool_calls")
    assert not whole["message"]["content"]
    streamed = sse_events((await http.post("/v1/chat/completions", json={**body, "stream": True})).text)
    deltas = [c["delta"] for e in streamed for c in e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    assert not any(d.get("tool_calls") for d in deltas)
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"


async def test_auto_calls_only_on_the_tool_marker(sdk: openai.AsyncOpenAI) -> None:
    plain = await sdk.chat.completions.create(model="fake", messages=ASK, tools=TOOLS)
    assert plain.choices[0].message.content == "weather in Paris?"
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "stop"
    marked = await sdk.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "weather [[tool]]"}], tools=TOOLS
    )
    assert marked.choices[0].finish_reason == "tool_calls"
    assert (marked.choices[0].message.tool_calls or [])[0].function.name == "get_weather"


async def test_tool_choice_none_never_calls(sdk: openai.AsyncOpenAI) -> None:
    answer = await sdk.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "weather [[tool]]"}], tools=TOOLS, tool_choice="none"
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content == "weather [[tool]]"


async def test_streamed_tool_call_is_assembled_by_the_sdk(sdk: openai.AsyncOpenAI) -> None:
    async with sdk.chat.completions.stream(
        model="fake", messages=ASK, tools=TOOLS, tool_choice="required", stream_options={"include_usage": True}
    ) as stream:
        final = await stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
    assert final.usage is not None and final.usage.completion_tokens > 0


async def test_two_turn_exchange_call_then_tool_result_then_answer(sdk: openai.AsyncOpenAI) -> None:
    first = await sdk.chat.completions.create(model="fake", messages=ASK, tools=TOOLS, tool_choice="required")
    call = (first.choices[0].message.tool_calls or [])[0]
    history: list[Any] = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = await sdk.chat.completions.create(model="fake", messages=history, tools=TOOLS)
    assert second.choices[0].message.content == "tool result: sunny, 21 C"
    assert second.choices[0].finish_reason == "stop"


async def test_response_format_json_schema_answers_valid_json(sdk: openai.AsyncOpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    answer = await sdk.chat.completions.create(model="fake", messages=ASK, response_format=fmt)
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), WEATHER)
    obj = await sdk.chat.completions.create(model="fake", messages=ASK, response_format={"type": "json_object"})
    assert json.loads(obj.choices[0].message.content or "") == {"text": "weather in Paris?"}


async def test_guided_choice_and_guided_json(http: httpx.AsyncClient) -> None:
    body = {"messages": ASK, "guided_choice": ["yes", "no"]}
    data = (await http.post("/v1/chat/completions", json=body)).json()
    assert data["choices"][0]["message"]["content"] == "yes"
    body = {"messages": ASK, "guided_json": json.dumps(WEATHER)}
    data = (await http.post("/v1/chat/completions", json=body)).json()
    jsonschema.validate(json.loads(data["choices"][0]["message"]["content"]), WEATHER)


async def test_n_answers_n_numbered_choices_streamed_and_not(sdk: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
    answer = await sdk.chat.completions.create(model="fake", messages=ASK, n=3)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert {c.message.content for c in answer.choices} == {"weather in Paris?"}
    assert answer.usage is not None and answer.usage.completion_tokens == 9
    body = {"messages": ASK, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events((await http.post("/v1/chat/completions", json=body)).text)
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert "".join(c["delta"].get("content", "") for c in mine) == "weather in Paris?"
        assert mine[-1]["finish_reason"] == "stop"
    assert events[-1]["usage"]["completion_tokens"] == 6


async def test_tool_parser_none_refuses_tools() -> None:
    transport = httpx.ASGITransport(app=app_for(tool_parser="none"))
    async with httpx.AsyncClient(transport=transport, base_url="http://ms") as client:
        response = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS})
    error = assert_error(response, 400, "tool_parser: none")
    assert error["param"] == "tools"


@pytest.mark.parametrize("parser", ["llama3_json", "pythonic", "mistral"])
async def test_other_parsers_round_trip_the_fake_call(parser: str) -> None:
    transport = httpx.ASGITransport(app=app_for(tool_parser=parser))
    async with httpx.AsyncClient(transport=transport, base_url="http://ms") as client:
        body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required"}
        data = (await client.post("/v1/chat/completions", json=body)).json()
    calls = data["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER)


async def test_every_error_has_a_param_key(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert assert_error(response, 400, "not valid JSON")["param"] is None
    assert assert_error(await http.get("/v1/nowhere"), 404)["param"] is None


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"guided_regex": "(?=a)b"}, "guided_regex", "lookarounds"),
        ({"guided_regex": "(a|b"}, "guided_regex", "not a valid regular expression"),
        ({"guided_json": {"type": "strin"}}, "guided_json", '"strin" is not one of'),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"d": {"type": "string", "pattern": "([a-"}}}}}},
         "response_format", "schema.properties.d.pattern"),
        ({"guided_grammar": 'root ::= "a"'}, "guided_grammar", "guided_json, guided_regex or guided_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}],
          "tool_choice": "required"}, "tools", "does not resolve"),
    ],
)
async def test_constraints_xgrammar_would_refuse_are_400_before_the_pipeline(
    http: httpx.AsyncClient, extra: dict[str, Any], param: str, needle: str
) -> None:
    response = await http.post("/v1/chat/completions", json={"messages": ASK, **extra})
    assert assert_error(response, 400, needle)["param"] == param


async def test_logprobs_cover_every_token_streamed_and_not(sdk: openai.AsyncOpenAI) -> None:
    answer = await sdk.chat.completions.create(model="fake", messages=ASK, logprobs=True)
    content = answer.choices[0].logprobs.content if answer.choices[0].logprobs else None
    assert content is not None and "".join(t.token for t in content) == answer.choices[0].message.content
    assert all(t.logprob == 0.0 and t.top_logprobs == [] and t.bytes == list(t.token.encode()) for t in content)
    async with sdk.chat.completions.stream(model="fake", messages=ASK, logprobs=True) as stream:
        final = await stream.get_final_completion()
    streamed = final.choices[0].logprobs.content if final.choices[0].logprobs else None
    assert streamed is not None and [t.token for t in streamed] == [t.token for t in content]


async def test_bodies_and_chunks_validate_against_the_openai_spec(http: httpx.AsyncClient) -> None:
    from openai_schema import check

    calls = {"messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    check((await http.post("/v1/chat/completions", json=calls)).json(), "CreateChatCompletionResponse")
    check((await http.post("/v1/chat/completions", json={"messages": ASK, "logprobs": True, "n": 2})).json(),
          "CreateChatCompletionResponse")
    streamed = {**calls, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True}
    for chunk in sse_events((await http.post("/v1/chat/completions", json=streamed)).text):
        check(chunk, "CreateChatCompletionStreamResponse")
    completion = {"prompt": "a b", "stream": False}
    check((await http.post("/v1/completions", json=completion)).json(), "CreateCompletionResponse")
    bad = await http.post("/v1/chat/completions", json={"messages": ASK, "guided_regex": "(?=a)"})
    check(bad.json(), "ErrorResponse")


@pytest.mark.parametrize(
    ("tool_choice", "needle"),
    [("any", 'tool_choice: must be "none", "auto", "required"'), ({"type": "function"}, "tool_choice.function")],
)
async def test_bad_tool_choice_names_the_field_and_the_shapes(
    http: httpx.AsyncClient, tool_choice: Any, needle: str
) -> None:
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": tool_choice}
    response = await http.post("/v1/chat/completions", json=body)
    assert assert_error(response, 400, needle)["param"].startswith("tool_choice")
