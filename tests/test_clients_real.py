"""The official SDK and LangChain through the router to real OpenVINO pipelines: SmolLM2 (the
demo GGUF) for ``json_object`` and tools described in a system message, and the tiny
random-weight Qwen2 with a tool-capable chat template (``make test-models``) for a two-turn
tool exchange, streamed calls, ``bind_tools`` and ``with_structured_output``. Constrained
decoding makes the calls and the JSON valid whatever the weights; the tests assert that,
and the bodies against the OpenAI spec, never one CPU's greedy text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.openai_schema import check
from tests.router_helpers import running_router, write_config

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]

QWEN = Path(__file__).resolve().parent.parent / "models" / "qwen2-tools-tiny-ov"
#: Bounded strings: a random-weight model fills an unbounded one until max_tokens.
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER_SCHEMA, "strict": True}}


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    temperature_c: int = Field(ge=-50, le=50)
    sky: Literal["clear", "cloudy", "rain"]


def _model(path: Path) -> dict[str, Any]:
    return {"task": "llm", "engine": "openvino", "path": str(path), "device": "CPU", "default_max_tokens": 96,
            "startup_timeout_s": 300}


def _sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(url: str, model: str) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=url + "/v1", api_key="unused", model=model, max_retries=0,
                                       timeout=300, temperature=0)


async def test_smollm2_json_object_and_tools_through_the_router(tmp_path: Path, demo_gguf: Path) -> None:
    path = write_config(tmp_path, {"smollm2": _model(demo_gguf)},
                        router={"cache_dir": str(tmp_path / "ov-cache")})
    async with running_router(path) as router:
        client = _sdk(router.url)
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model="smollm2", messages=[{"role": "user", "content": "Describe a cat as JSON: name and age."}],
                response_format={"type": "json_object"}, temperature=0)
            check(json.loads(raw.text), "CreateChatCompletionResponse")
            answer = raw.parse().choices[0]
            assert answer.finish_reason == "stop" and isinstance(json.loads(answer.message.content or ""), dict)

            called = await client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False, temperature=0)
            calls = called.choices[0].message.tool_calls or []
            assert called.choices[0].finish_reason == "tool_calls" and len(calls) == 1
            assert calls[0].function.name == "get_weather"
            jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER_SCHEMA)

            prompts = ["The capital of France is", "Once upon a time, a small robot"]
            alone = [(await client.completions.create(model="smollm2", prompt=p, max_tokens=4)).usage for p in prompts]
            raw_batch = await client.completions.with_raw_response.create(model="smollm2", prompt=prompts,
                                                                          max_tokens=4, n=2, temperature=0.7)
            check(json.loads(raw_batch.text), "CreateCompletionResponse")
            batch = raw_batch.parse()  # n choices per prompt, each prompt counted once
            assert [c.index for c in batch.choices] == [0, 1, 2, 3] and batch.usage is not None
            assert batch.usage.prompt_tokens == sum(u.prompt_tokens for u in alone if u is not None)
            assert batch.usage.completion_tokens <= 4 * 4
        finally:
            await client.close()
        as_json = await _chat(router.url, "smollm2").with_structured_output(None, method="json_mode").ainvoke(
            "Describe a dog as a JSON object with a name and an age.")
        assert isinstance(as_json, dict)


async def test_tiny_qwen_tool_exchange_and_langchain_through_the_router(tmp_path: Path) -> None:
    if not (QWEN / "openvino_model.xml").exists():
        pytest.fail(f"{QWEN} is missing: run `make test-models`")
    path = write_config(tmp_path, {"qwen": _model(QWEN)}, router={"cache_dir": str(tmp_path / "ov-cache")})
    async with running_router(path) as router:
        client = _sdk(router.url)
        try:
            messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
            raw = await client.chat.completions.with_raw_response.create(
                model="qwen", messages=messages, tools=[WEATHER_TOOL], tool_choice="required", seed=1)
            check(json.loads(raw.text), "CreateChatCompletionResponse")
            first = raw.parse().choices[0]
            assert first.finish_reason == "tool_calls" and first.message.tool_calls
            call = first.message.tool_calls[0]
            jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
            messages += [first.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
            raw = await client.chat.completions.with_raw_response.create(
                model="qwen", messages=messages, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=8)
            check(json.loads(raw.text), "CreateChatCompletionResponse")
            assert raw.parse().choices[0].finish_reason in ("stop", "length")

            async with client.chat.completions.stream(
                model="qwen", messages=messages[:1], tools=[WEATHER_TOOL], seed=2,
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            ) as stream:
                final = await stream.get_final_completion()
            streamed = final.choices[0].message.tool_calls or []
            assert len(streamed) == 1 and streamed[0].function.name == "get_weather"
            jsonschema.validate(json.loads(streamed[0].function.arguments), WEATHER_SCHEMA)
        finally:
            await client.close()

        from langchain_core.tools import tool

        @tool
        def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
            """Current weather in a city."""
            return city

        reply = await _chat(router.url, "qwen").bind_tools([get_weather], tool_choice="get_weather").ainvoke(
            "Weather in Lisbon?")
        assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
        assert isinstance(reply.tool_calls[0]["args"].get("city"), str)
        forecast = await _chat(router.url, "qwen").with_structured_output(Forecast, method="json_schema").ainvoke(
            "The forecast for Rome, please.")
        assert isinstance(forecast, Forecast)
