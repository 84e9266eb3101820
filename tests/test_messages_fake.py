"""The Anthropic Messages API (``/v1/messages``, ``/count_tokens``) on the fake engine, through the ``anthropic`` SDK.

The model server runs in process (httpx.ASGITransport): the SDK's own parsing, its stream
accumulation (``messages.stream().get_final_message()``) and its error classes are what is
tested, in milliseconds. The fake echoes the last user message word by word and answers a
forced ``tool_choice`` with a call built from the tool's schema.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import pytest

from modelserver.api.anthropic_in import BILLING_HEADER, MessagesRequest, chat_messages
from modelserver.app import build_app
from modelserver.engines.fake import FakeTextGenerator
from modelserver.engines.fake_media import FakeVisionGenerator
from modelserver.spec import build_model_spec

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 2}},
    "required": ["city", "days"],
}
TOOLS: list[Any] = [{"name": "get_weather", "description": "forecast", "input_schema": WEATHER,
                     "cache_control": {"type": "ephemeral"}}]
ASK: list[Any] = [{"role": "user", "content": "hello there general kenobi"}]


def app_for(task: str = "llm", **extra: Any) -> Any:
    spec = build_model_spec("fake", {"engine": "fake", "task": task, "fake": {"token_delay_s": 0, "load_s": 0},
                                     **extra})
    return build_app(spec, (FakeVisionGenerator if task == "vlm" else FakeTextGenerator)(spec))


@pytest.fixture
async def client() -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app_for()), base_url="http://ms") as http:
        yield anthropic.AsyncAnthropic(base_url="http://ms", api_key="x", http_client=http, max_retries=0)


async def test_create_echoes_with_end_turn_and_usage(client: anthropic.AsyncAnthropic) -> None:
    message = await client.messages.create(model="fake", max_tokens=64, messages=ASK, system="be brief")
    assert message.type == "message" and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "hello there general kenobi"  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens == 6 and message.usage.output_tokens == 4  # words: the fake's tokens


async def test_input_tokens_leave_out_the_cache_reads_as_anthropic_counts(client: anthropic.AsyncAnthropic,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Anthropic's prompt is input_tokens + cache_read_input_tokens (the SDKs and LangChain's usage_metadata add
    them up): a cache hit moves tokens from one to the other, never counts them twice."""
    from modelserver.api import messages

    monkeypatch.setattr(messages, "cached_tokens", lambda stream: 4)  # the fake keeps no prefix cache
    counted = await client.messages.count_tokens(model="fake", messages=ASK, system="be brief")
    message = await client.messages.create(model="fake", max_tokens=64, messages=ASK, system="be brief")
    async with client.messages.stream(model="fake", max_tokens=64, messages=ASK, system="be brief") as stream:
        final = await stream.get_final_message()
    for usage in (message.usage, final.usage):
        assert usage.cache_read_input_tokens == 4 and usage.input_tokens + 4 == counted.input_tokens == 6


async def test_max_tokens_and_stop_sequences(client: anthropic.AsyncAnthropic) -> None:
    cut = await client.messages.create(model="fake", max_tokens=2, messages=ASK)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    stopped = await client.messages.create(model="fake", max_tokens=64, messages=ASK, stop_sequences=["general"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "general"
    assert stopped.content[0].text == "hello there "  # type: ignore[union-attr]


async def test_stream_accumulates_to_the_same_message(client: anthropic.AsyncAnthropic) -> None:
    async with client.messages.stream(model="fake", max_tokens=64, messages=ASK) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "ping" not in kinds  # SDK drops ping
    assert final.content[0].text == "hello there general kenobi"  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 4 and final.usage.input_tokens == 4


@pytest.mark.parametrize("stream", [False, True])
async def test_forced_tool_ends_tool_use_with_a_dict_input_and_no_empty_text(client: anthropic.AsyncAnthropic,
                                                                            stream: bool) -> None:
    args: dict[str, Any] = {"model": "fake", "max_tokens": 200, "messages": ASK, "tools": TOOLS,
                            "tool_choice": {"type": "any"}}
    if stream:
        async with client.messages.stream(**args) as s:
            message = await s.get_final_message()
    else:
        message = await client.messages.create(**args)
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["tool_use"]
    call = message.content[0]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    assert call.input == {"city": "Paris", "days": 2}


async def test_tool_result_turn_and_history_blocks(client: anthropic.AsyncAnthropic) -> None:
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "sig"},
            {"type": "redacted_thinking", "data": "xyz"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome", "days": 3}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny 20C"}],
             "cache_control": {"type": "ephemeral"}}]},
    ]
    message = await client.messages.create(model="fake", max_tokens=64, messages=history, tools=TOOLS)
    assert message.stop_reason == "end_turn"
    assert message.content[0].text == "tool result: sunny 20C"  # type: ignore[union-attr]


async def test_count_tokens_equals_the_charged_input_tokens(client: anthropic.AsyncAnthropic) -> None:
    args: dict[str, Any] = {"model": "fake", "messages": ASK, "system": [{"type": "text", "text": "one two"}]}
    counted = await client.messages.count_tokens(**args)
    message = await client.messages.create(max_tokens=16, **args)
    assert counted.input_tokens == message.usage.input_tokens == 6


async def test_what_claude_code_sends_is_served(client: anthropic.AsyncAnthropic) -> None:
    """Unknown fields, thinking, a system message inside ``messages``, a 64000 max_tokens on a small context."""
    http = client._client
    body = {
        "model": "claude-sonnet-4-5", "max_tokens": 64000, "stream": False,
        "system": [{"type": "text", "text": f"{BILLING_HEADER}: cc_version=2.1; cch=abc"},
                   {"type": "text", "text": "You are Claude Code", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "say hi", "cache_control": {}}]},
                     {"role": "system", "content": "reminder"}],
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"}, "metadata": {"user_id": "u"},
        "context_management": {"edits": []}, "temperature": 1, "tools": [{**TOOLS[0]}],
    }
    resp = await http.post("/v1/messages?beta=true", json=body, headers={"anthropic-version": "2023-06-01"})
    assert resp.status_code == 200, resp.text
    message = resp.json()
    assert message["model"] == "claude-sonnet-4-5" and message["stop_reason"] == "end_turn"
    assert message["content"] == [{"type": "text", "text": "say hi reminder"}]  # the fake joins words by spaces


def test_billing_header_dropped_and_mid_chat_system_folded() -> None:
    body = MessagesRequest.model_validate({
        "max_tokens": 1,
        "system": [{"type": "text", "text": f"{BILLING_HEADER}: cch=1"}, {"type": "text", "text": "sys"}],
        "messages": [{"role": "system", "content": "early"}, {"role": "user", "content": "hi"},
                     {"role": "system", "content": "late"}],
    })
    assert chat_messages(body, vision=False) == [{"role": "system", "content": "sys\n\nearly"},
                                                 {"role": "user", "content": "hi\n\nlate"}]


async def test_errors_take_anthropic_shape(client: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as missing:
        await client.post("/v1/messages", body={"model": "fake", "messages": ASK}, cast_to=httpx.Response)
    assert missing.value.body["type"] == "error"  # type: ignore[index]
    assert missing.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "max_tokens" in missing.value.message
    with pytest.raises(anthropic.BadRequestError, match="image blocks need a model with task vlm"):
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
        await client.messages.create(model="fake", max_tokens=8,
                                     messages=[{"role": "user", "content": [image]}])
    with pytest.raises(anthropic.InternalServerError) as failed:
        await client.messages.create(model="fake", max_tokens=8, messages=[{"role": "user", "content": "[[error]]"}])
    assert failed.value.body["error"]["type"] == "api_error"  # type: ignore[index]


async def test_prefill_continues_the_final_assistant_message(client: anthropic.AsyncAnthropic) -> None:
    history: list[Any] = [*ASK, {"role": "assistant", "content": "hello there"}]
    message = await client.messages.create(model="fake", max_tokens=64, messages=history)
    assert message.content[0].text == " general kenobi"  # type: ignore[union-attr]


async def test_stream_error_mid_way_is_an_error_event() -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app_for()), base_url="http://ms") as http:
        body = {"model": "fake", "max_tokens": 64, "stream": True,
                "messages": [{"role": "user", "content": "one two [[fatal-mid]] three four"}]}
        resp = await http.post("/v1/messages", json=body)
    events = [line.removeprefix("event: ") for line in resp.text.splitlines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "error" and "message_stop" not in events
    error = json.loads(resp.text.rstrip().splitlines()[-1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
