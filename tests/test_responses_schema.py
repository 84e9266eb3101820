"""Every Responses body and every streamed event, checked against the official OpenAI OpenAPI spec
(``Response``, ``ResponseStreamEvent``): text, a function call, a custom tool call, an incomplete answer,
a stored response read back, and the error body of an unknown ``previous_response_id``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.openai_schema import check
from tests.router_helpers import RunningRouter, fake_model, running_router, write_config

pytestmark = pytest.mark.timeout(120)

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files",
               "format": {"type": "grammar", "syntax": "lark", "definition": "start: patch"}}
CASES = {
    "text": {"input": "one two three"},
    "function-call": {"input": "weather in Oslo?", "tools": [WEATHER], "tool_choice": "required"},
    "custom-call": {"input": "patch it", "tools": [APPLY_PATCH],
                    "tool_choice": {"type": "custom", "name": "apply_patch"}},
    "incomplete": {"input": "one two three four five six", "max_output_tokens": 2},
    "json-schema": {"input": "a city", "text": {"format": {"type": "json_schema", "name": "city", "schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}},
}


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[RunningRouter]:
    models = {"echo": fake_model(fake={"load_s": 0.05, "token_delay_s": 0.005})}
    async with running_router(write_config(tmp_path, models)) as running:
        yield running


def _events(raw: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
async def test_bodies_and_stream_events_follow_the_spec(router: RunningRouter, case: str) -> None:
    body = {"model": "echo", **CASES[case]}
    plain = await router.client.post("/v1/responses", json=body)
    assert plain.status_code == 200, plain.text
    check(plain.json(), "Response")
    streamed = await router.client.post("/v1/responses", json={**body, "stream": True})
    assert streamed.status_code == 200, streamed.text
    events = _events(streamed.text)
    for event in events:
        check(event, "ResponseStreamEvent")
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    terminal = [e["type"] for e in events if e["type"] in ("response.completed", "response.incomplete",
                                                           "response.failed")]
    assert terminal == ["response.incomplete" if case == "incomplete" else "response.completed"]
    stored = await router.client.get(f"/v1/responses/{events[-1]['response']['id']}")
    check(stored.json(), "Response")


async def test_an_unknown_previous_response_id_is_a_spec_error_body(router: RunningRouter) -> None:
    reply = await router.client.post("/v1/responses", json={"model": "echo", "input": "hi",
                                                            "previous_response_id": "resp_missing"})
    assert reply.status_code == 400 and "resp_missing" in reply.json()["error"]["message"]
    check(reply.json(), "ErrorResponse")


async def test_a_cold_start_opening_follows_the_spec(tmp_path: Path) -> None:
    """The router's own ``response.created`` / ``in_progress`` (sent before the model is up) echo the request."""
    models = {"slow": fake_model(fake={"load_s": 1.0, "token_delay_s": 0.005}, loading_progress="comments")}
    async with running_router(write_config(tmp_path, models)) as router:
        body = {"model": "slow", "stream": True, **CASES["function-call"], "temperature": 0.5, "metadata": {"k": "v"}}
        streamed = await router.client.post("/v1/responses", json=body)
    events = _events(streamed.text)
    for event in events:
        check(event, "ResponseStreamEvent")
    opening = events[0]["response"]
    assert events[0]["type"] == "response.created" and "usage" not in opening
    assert (opening["temperature"], opening["metadata"], opening["tool_choice"]) == (0.5, {"k": "v"}, "required")
    assert opening["tools"] == [{**WEATHER, "strict": True}]
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["usage"]["output_tokens"] > 0
