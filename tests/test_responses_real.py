"""The Responses API on real OpenVINO pipelines through the router: SmolLM2 for text (the SDK's create and
stream helper, input_tokens, a cached prefix), and the OpenAI Agents SDK's ``Runner.run`` with one
``@function_tool`` on the tiny Qwen2 tool model (random weights: a forced first call shows the wiring, not
the model's judgement)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import openai
import pytest
from conftest import ROOT

from tests.router_helpers import RunningRouter, running_router, write_config

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]

QWEN = ROOT / "models" / "qwen2-tools-tiny-ov"
FRANCE = "What is the capital of France?"


@pytest.fixture
async def smollm2(tmp_path: Path, demo_gguf: Path) -> AsyncIterator[RunningRouter]:
    models = {"smollm2": {"task": "llm", "path": str(demo_gguf), "default_max_tokens": 48, "startup_timeout_s": 300}}
    path = write_config(tmp_path, models, router={"cache_dir": str(tmp_path / "ov-cache")})
    async with running_router(path) as running:
        yield running


@pytest.fixture
async def qwen(tmp_path: Path) -> AsyncIterator[RunningRouter]:
    if not (QWEN / "openvino_model.xml").exists():
        pytest.fail(f"{QWEN} is missing: run `make test-models`")
    models = {"qwen": {"task": "llm", "path": str(QWEN), "default_max_tokens": 48, "startup_timeout_s": 300}}
    path = write_config(tmp_path, models, router={"cache_dir": str(tmp_path / "ov-cache")})
    async with running_router(path) as running:
        yield running


async def test_smollm2_answers_through_create_and_the_stream_helper(smollm2: RunningRouter) -> None:
    router = smollm2
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=300) as sdk:
        answer = await sdk.responses.create(model="smollm2", input=FRANCE, temperature=0, max_output_tokens=24)
        assert "Paris" in answer.output_text and answer.usage is not None
        counted = (await router.client.post("/v1/responses/input_tokens", json={"model": "smollm2", "input": FRANCE},
                                            timeout=300)).json()
        assert counted["input_tokens"] == answer.usage.input_tokens > 5
        async with sdk.responses.stream(model="smollm2", input=FRANCE, temperature=0, max_output_tokens=24) as stream:
            streamed = await stream.get_final_response()
        assert streamed.output_text == answer.output_text and streamed.usage is not None
        assert streamed.usage.output_tokens == answer.usage.output_tokens
        assert streamed.usage.input_tokens_details.cached_tokens > 0  # the same prompt again: its prefix is cached
        follow = await sdk.responses.create(model="smollm2", input="And of Italy?", previous_response_id=answer.id,
                                            temperature=0, max_output_tokens=8)
        assert follow.usage is not None and follow.usage.input_tokens > answer.usage.input_tokens
        assert follow.usage.input_tokens_details.cached_tokens > 0


async def test_agents_sdk_runs_a_function_tool(qwen: RunningRouter) -> None:
    router = qwen
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=300) as client:
        # stop_on_first_tool: the tool's answer is the final output (the random-weight model's own text
        # after it would run to max_tokens, which the SDK takes as a failed turn)
        agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                      model=OpenAIResponsesModel(model="qwen", openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", max_tokens=64),
                      tool_use_behavior="stop_on_first_tool")
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=2)
    assert calls and calls[0] in ("Paris", "Rome")
    assert result.final_output == f"sunny in {calls[0]}"
