"""Tool calling and structured output on the real OpenVINO pipeline, through the official SDK.

``qwen2-tools-tiny-ov`` (``make test-models``) is a 2-layer Qwen2 with random weights whose
tokenizer carries a Qwen2.5-style chat template with tools: its text means nothing, so
whatever it answers under a forced ``tool_choice`` or a ``json_schema`` shows the
constraint alone makes the output valid. Sampling (temperature 1, several seeds) makes it
wander as far as random weights go. SmolLM2 (real weights, a template without tools)
covers ``json_object`` and the tools-in-a-system-message fallback.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from conftest import ROOT
from modelserver_helpers import ModelServerProcess, modelserver

from modelserver.spec import build_model_spec

pytestmark = pytest.mark.real_model

QWEN = ROOT / "models" / "qwen2-tools-tiny-ov"
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 12},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER,
                                      "strict": True}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
SEEDS = (1, 2, 3)


def serve(name: str, path: Path, tmp: pytest.TempPathFactory, **extra: Any) -> Any:
    settings = {"path": str(path), "cache_dir": str(tmp.mktemp("ov-cache")), "default_max_tokens": 96, **extra}
    return modelserver(spec=build_model_spec(name, settings), ready_timeout_s=180)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelServerProcess]:
    if not (QWEN / "openvino_model.xml").exists():
        pytest.fail(f"{QWEN} is missing: run `make test-models`")
    with serve("qwen", QWEN, tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelServerProcess]:
    folder = ROOT / "models" / "llava-tiny-ov"
    if not (folder / "openvino_language_model.xml").exists():
        pytest.fail(f"{folder} is missing: run `make test-models`")
    with serve("llava", folder, tmp_path_factory, task="vlm") as server:
        yield server


@pytest.fixture(scope="module")
def smollm2(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelServerProcess]:
    with serve("smollm2", demo_gguf, tmp_path_factory) as server:
        yield server


def sdk(server: ModelServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def assert_valid_call(call: Any, schemas: dict[str, Any]) -> None:
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in schemas
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("seed", SEEDS)
def test_required_tool_choice_gives_a_valid_call_from_random_weights(qwen: ModelServerProcess, seed: int) -> None:
    with sdk(qwen) as client:
        answer = client.chat.completions.create(
            model="qwen", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            temperature=1.0, seed=seed,
        )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert_valid_call(choice.message.tool_calls[0], schemas)


def test_named_tool_choice_streams_a_call_the_sdk_assembles(qwen: ModelServerProcess) -> None:
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    with sdk(qwen) as client, client.chat.completions.stream(
        model="qwen", messages=ASK, tools=TOOLS, tool_choice=named, temperature=1.0, seed=7,
        stream_options={"include_usage": True},
    ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]
    assert_valid_call(calls[0], {"get_weather": WEATHER})
    assert final.usage is not None and final.usage.completion_tokens > 5


def test_parallel_required_calls_are_each_valid(qwen: ModelServerProcess) -> None:
    with sdk(qwen) as client:
        answer = client.chat.completions.create(
            model="qwen", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=True, temperature=1.0,
            seed=11, max_tokens=400,
        )
    choice = answer.choices[0]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    # random weights may chain calls until max_tokens (finish "length", the last one cut and left as text);
    # every complete call is valid either way
    assert choice.finish_reason in ("tool_calls", "length") and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert_valid_call(call, schemas)


def test_two_turn_history_with_tool_calls_and_results_renders_through_the_template(qwen: ModelServerProcess) -> None:
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    with sdk(qwen) as client:
        with_result = client.chat.completions.create(model="qwen", messages=history, tools=TOOLS, max_tokens=4)
        without = client.chat.completions.create(model="qwen", messages=ASK, tools=TOOLS, max_tokens=4)
        no_tools = client.chat.completions.create(model="qwen", messages=ASK, max_tokens=4)
    assert with_result.usage is not None and without.usage is not None and no_tools.usage is not None
    # the call and its result are in the prompt, and so are the tools' descriptions
    assert with_result.usage.prompt_tokens > without.usage.prompt_tokens + 20
    assert without.usage.prompt_tokens > no_tools.usage.prompt_tokens + 50


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_response_format_is_valid_json_from_random_weights(qwen: ModelServerProcess, seed: int) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    with sdk(qwen) as client:
        answer = client.chat.completions.create(
            model="qwen", messages=ASK, response_format=fmt, temperature=1.0, seed=seed
        )
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), WEATHER)


def test_guided_choice_and_regex_from_random_weights(qwen: ModelServerProcess) -> None:
    with qwen.client(timeout_s=120) as client:
        body = {"messages": ASK, "temperature": 1.0, "seed": 5}
        choice = client.post("/v1/chat/completions", json={**body, "guided_choice": ["sunny", "rainy"]}).json()
        regex = client.post("/v1/chat/completions", json={**body, "guided_regex": "[0-9]{3}-[a-z]{2}"}).json()
    assert choice["choices"][0]["message"]["content"] in ("sunny", "rainy")
    text = regex["choices"][0]["message"]["content"]
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()


def test_n_gives_n_choices_with_their_own_tokens(qwen: ModelServerProcess) -> None:
    with sdk(qwen) as client:
        answer = client.chat.completions.create(
            model="qwen", messages=ASK, n=3, temperature=1.0, seed=3, max_tokens=6, extra_body={"ignore_eos": True}
        )
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert answer.usage is not None and answer.usage.completion_tokens == 18
    assert len({c.message.content for c in answer.choices}) > 1  # distinct seeds, distinct samples


def test_json_object_on_smollm2_parses(smollm2: ModelServerProcess) -> None:
    messages = [{"role": "user", "content": "Describe a cat as a JSON object with a name and an age."}]
    with sdk(smollm2) as client:
        answer = client.chat.completions.create(
            model="smollm2", messages=messages, response_format={"type": "json_object"}, temperature=0, max_tokens=96
        )
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content or ""), dict)


def test_smollm2_without_template_tools_gets_them_in_a_system_message(smollm2: ModelServerProcess) -> None:
    with sdk(smollm2) as client:
        answer = client.chat.completions.create(
            model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            temperature=0,
        )
        plain = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=2)
    calls = answer.choices[0].message.tool_calls or []
    assert answer.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert_valid_call(calls[0], {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS})
    assert answer.usage is not None and plain.usage is not None
    assert answer.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools were described to the model


@pytest.mark.parametrize("stream", [False, True])
def test_required_with_default_parallel_is_one_call_on_smollm2(smollm2: ModelServerProcess, stream: bool) -> None:
    """``required`` (LangChain's ``tool_choice="any"``) without ``parallel_tool_calls``: one call, then the end
    (it used to repeat the call until ``max_tokens``)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    with sdk(smollm2) as client:
        if stream:
            with client.chat.completions.stream(
                model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=256,
            ) as events:
                answer = events.get_final_completion()
        else:
            answer = client.chat.completions.create(
                model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=256,
            )
    choice = answer.choices[0]
    calls = choice.message.tool_calls or []
    assert choice.finish_reason == "tool_calls" and len(calls) == 1
    assert_valid_call(calls[0], schemas)
    assert "<tool" not in (choice.message.content or "")


def test_logprobs_are_one_per_generated_token(qwen: ModelServerProcess) -> None:
    with sdk(qwen) as client:
        answer = client.chat.completions.create(
            model="qwen", messages=ASK, logprobs=True, temperature=1.0, seed=4, max_tokens=8,
            extra_body={"ignore_eos": True},
        )
    choice = answer.choices[0]
    entries = choice.logprobs.content if choice.logprobs else None
    assert answer.usage is not None and entries is not None
    assert len(entries) == answer.usage.completion_tokens == 8
    assert all(e.logprob <= 0.0 for e in entries)
    assert any(e.logprob < 0.0 for e in entries)  # sampled from a real distribution, not a constant


def test_vlm_forced_tool_call_and_json_schema_from_random_weights(llava: ModelServerProcess) -> None:
    """The tiny LLaVA (random weights, a template without tools): tools described in the system message, the
    call constrained on the VLMPipeline too; a history with a call and its result renders."""
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
    ]
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    with sdk(llava) as client:
        called = client.chat.completions.create(
            model="llava", messages=history, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            temperature=1.0, seed=2,
        )
        shaped = client.chat.completions.create(model="llava", messages=ASK, response_format=fmt, temperature=1.0,
                                                seed=2)
    calls = called.choices[0].message.tool_calls or []
    assert called.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert_valid_call(calls[0], {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS})
    assert shaped.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(shaped.choices[0].message.content or ""), WEATHER)


@pytest.mark.parametrize("seed", SEEDS)
def test_auto_with_strict_tools_answers_text_or_valid_calls(qwen: ModelServerProcess, seed: int) -> None:
    """Free text until the model opens a <tool_call>; from there the call must match its schema."""
    with sdk(qwen) as client:
        answer = client.chat.completions.create(
            model="qwen", messages=ASK, tools=TOOLS, tool_choice="auto", temperature=1.0, seed=seed, max_tokens=48
        )
    choice = answer.choices[0]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in choice.message.tool_calls or []:
        assert_valid_call(call, schemas)
    assert choice.message.tool_calls or choice.message.content
