"""The Anthropic Messages API through the router to real OpenVINO pipelines, with the ``anthropic`` SDK and
``langchain-anthropic``: SmolLM2 (the demo GGUF) for text, streams, ``count_tokens`` and Claude Code's 64000
``max_tokens``; the tiny random-weight Qwen2 with a tool template (``make test-models``) for a forced tool call
and its ``tool_result`` turn, and ``ChatAnthropic.bind_tools``; LLaVA-tiny for an image block. Constrained
decoding makes the calls valid whatever the weights; the tests assert invariants, never one CPU's text."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import anthropic
import jsonschema
import pytest
from pydantic import Field

from tests.router_helpers import running_router, write_config
from tests.tasks_helpers import image_data_url

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]

MODELS = Path(__file__).resolve().parent.parent / "models"
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}


def _model(path: Path, **extra: Any) -> dict[str, Any]:
    return {"engine": "openvino", "path": str(path), "device": "CPU", "default_max_tokens": 96,
            "startup_timeout_s": 300, **extra}


def _config(tmp_path: Path, name: str, model: dict[str, Any]) -> Path:
    return write_config(tmp_path, {name: model}, router={"cache_dir": str(tmp_path / "ov-cache")})


def _sdk(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)


async def test_smollm2_text_stream_count_tokens_and_a_capped_max_tokens(tmp_path: Path, demo_gguf: Path) -> None:
    async with running_router(_config(tmp_path, "smollm2", _model(demo_gguf, aliases=["claude-sonnet-4-5"]))) as r:
        client = _sdk(r.url)
        ask: dict[str, Any] = {"model": "claude-sonnet-4-5", "system": "You are terse and precise. " * 16,
                               "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        message = await client.messages.create(max_tokens=24, temperature=0, **ask)
        assert message.stop_reason in ("end_turn", "max_tokens") and message.content[0].type == "text"
        assert 0 < message.usage.output_tokens <= 24 and message.content[0].text.strip()
        counted = await client.messages.count_tokens(**ask)
        assert counted.input_tokens == message.usage.input_tokens
        async with client.messages.stream(max_tokens=24, temperature=0, **ask) as stream:
            streamed = await stream.get_final_message()
        assert streamed.content[0].text == message.content[0].text  # type: ignore[union-attr]  # greedy both times
        # the prompt is input_tokens + cache_read_input_tokens (Anthropic's split: the SDKs add them up)
        assert streamed.usage.input_tokens + (streamed.usage.cache_read_input_tokens or 0) == counted.input_tokens
        assert streamed.usage.output_tokens == message.usage.output_tokens
        # the same prompt again: its whole KV blocks came from the prefix cache (the first request found none)
        assert message.usage.cache_read_input_tokens == 0
        assert 0 < (streamed.usage.cache_read_input_tokens or 0) < counted.input_tokens
        # Claude Code's max_tokens on an 8k context: capped, never a 400 (a stop sequence keeps the answer short)
        huge = await client.messages.create(max_tokens=64000, temperature=0, stop_sequences=[" ", "\n"], **ask)
        assert huge.stop_reason in ("end_turn", "stop_sequence")


async def test_tiny_qwen_forced_tool_use_its_result_and_langchain(tmp_path: Path) -> None:
    qwen = MODELS / "qwen2-tools-tiny-ov"
    if not (qwen / "openvino_model.xml").exists():
        pytest.fail(f"{qwen} is missing: run `make test-models`")
    async with running_router(_config(tmp_path, "qwen", _model(qwen))) as router:
        client = _sdk(router.url)
        messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = await client.messages.create(model="qwen", max_tokens=96, messages=messages, tools=[TOOL],
                                             tool_choice={"type": "any"})
        assert first.stop_reason == "tool_use" and first.content[0].type == "tool_use"  # no empty text block first
        call = first.content[0]
        assert call.name == "get_weather" and isinstance(call.input, dict)
        jsonschema.validate(call.input, WEATHER)
        messages += [{"role": "assistant", "content": [block.model_dump() for block in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": "18 C, sunny"}]}]
        second = await client.messages.create(model="qwen", max_tokens=8, messages=messages, tools=[TOOL],
                                              tool_choice={"type": "none"})
        assert second.stop_reason in ("end_turn", "max_tokens")
        counted = await client.messages.count_tokens(model="qwen", messages=messages, tools=[TOOL],
                                                     tool_choice={"type": "none"})
        asked = await client.messages.count_tokens(model="qwen", messages=messages[:1])
        prompt = second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0)
        assert counted.input_tokens == prompt > asked.input_tokens  # the call and its result
        async with client.messages.stream(model="qwen", max_tokens=96, messages=messages[:1], tools=[TOOL],
                                          tool_choice={"type": "tool", "name": "get_weather"}) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
        jsonschema.validate(final.content[0].input, WEATHER)  # type: ignore[union-attr]

        langchain_anthropic = pytest.importorskip("langchain_anthropic")
        from langchain_core.tools import tool

        @tool
        def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
            """Current weather in a city."""
            return city

        chat = langchain_anthropic.ChatAnthropic(base_url=router.url, api_key="unused", model="qwen",
                                                 max_tokens=96, max_retries=0, timeout=300)
        reply = await chat.bind_tools([get_weather], tool_choice="get_weather").ainvoke("Weather in Lisbon?")
        assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
        assert isinstance(reply.tool_calls[0]["args"].get("city"), str)


async def test_llava_takes_an_image_block(tmp_path: Path) -> None:
    llava = MODELS / "llava-tiny-ov"
    if not (llava / "openvino_language_model.xml").exists():
        pytest.fail(f"{llava} is missing: run `make test-models`")
    async with running_router(_config(tmp_path, "llava", _model(llava, task="vlm", default_max_tokens=8))) as router:
        client = _sdk(router.url)
        data = image_data_url(64, 48).split(",", 1)[1]
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
        ask = {"type": "text", "text": "What is in the image?"}
        text_only = await client.messages.create(model="llava", max_tokens=8, temperature=0,
                                                 messages=[{"role": "user", "content": [ask]}])
        seen = await client.messages.create(model="llava", max_tokens=8, temperature=0,
                                            messages=[{"role": "user", "content": [image, ask]}])
        assert seen.stop_reason in ("end_turn", "max_tokens") and seen.content[0].type == "text"
        def prompt(usage: Any) -> int:
            return int(usage.input_tokens + (usage.cache_read_input_tokens or 0))
        assert prompt(seen.usage) >= prompt(text_only.usage) + 16  # the image's patch embeddings
