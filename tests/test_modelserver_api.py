"""The HTTP surface in process (httpx.ASGITransport) with the fake engine: shapes, parameters, errors."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest
from tasks_helpers import assert_error, sse_events

from modelserver.api.common import FastJSONResponse
from modelserver.app import build_app
from modelserver.engines.fake import FakeEmbedder, FakeTextGenerator
from modelserver.errors import FATAL_HEADER
from modelserver.runtime import ModelRuntime
from modelserver.spec import ModelSpec, build_model_spec
from tests.openai_schema import check


def fake_spec(task: str = "llm", **extra: Any) -> ModelSpec:
    return build_model_spec(
        "fake", {"engine": "fake", "task": task, "fake": {"token_delay_s": 0, "load_s": 0}, **extra}
    )


def client_for(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://modelserver")


@pytest.fixture
async def llm() -> AsyncIterator[httpx.AsyncClient]:
    spec = fake_spec(max_request_mb=0.01)
    async with client_for(build_app(spec, FakeTextGenerator(spec))) as client:
        yield client


@pytest.fixture
async def embedder() -> AsyncIterator[httpx.AsyncClient]:
    spec = fake_spec("embeddings")
    async with client_for(build_app(spec, FakeEmbedder(spec))) as client:
        yield client


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def chat(content: str, **params: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": content}], **params}


async def test_chat_completion_echoes_the_last_user_message(llm: httpx.AsyncClient) -> None:
    body = chat("hello big world")
    body["messages"].insert(0, {"role": "system", "content": "be brief"})
    data = (await llm.post("/v1/chat/completions", json=body)).json()
    assert data["object"] == "chat.completion"
    assert data["id"].startswith("chatcmpl-")
    assert data["model"] == "fake"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "hello big world", "refusal": None}
    assert data["system_fingerprint"].startswith("fp_")
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_max_tokens_ends_with_length(llm: httpx.AsyncClient) -> None:
    data = (await llm.post("/v1/chat/completions", json=chat("one two three four", max_tokens=2))).json()
    assert data["choices"][0]["message"]["content"] == "one two"
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 2


async def test_max_completion_tokens_wins_over_max_tokens(llm: httpx.AsyncClient) -> None:
    body = chat("a b c d", max_tokens=1, max_completion_tokens=3)
    data = (await llm.post("/v1/chat/completions", json=body)).json()
    assert data["choices"][0]["message"]["content"] == "a b c"


async def test_text_content_parts_are_joined(llm: httpx.AsyncClient) -> None:
    parts = [{"type": "text", "text": "first part"}, {"type": "text", "text": "second"}]
    body = {"messages": [{"role": "user", "content": parts}]}
    data = (await llm.post("/v1/chat/completions", json=body)).json()
    assert data["choices"][0]["message"]["content"] == "first part second"


async def test_stream_chunks_then_usage_then_done(llm: httpx.AsyncClient) -> None:
    body = chat("alpha beta gamma", stream=True, stream_options={"include_usage": True})
    response = await llm.post("/v1/chat/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert all(e["usage"] is None for e in events[:-1])
    deltas = [e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]]
    assert "".join(deltas) == "alpha beta gamma"
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 3
    assert len({e["id"] for e in events}) == 1


async def test_stream_without_include_usage_has_no_usage_chunk(llm: httpx.AsyncClient) -> None:
    events = sse_events((await llm.post("/v1/chat/completions", json=chat("a b", stream=True))).text)
    assert all("usage" not in e for e in events)


async def test_stop_string_cuts_the_answer_and_is_not_included(llm: httpx.AsyncClient) -> None:
    data = (await llm.post("/v1/chat/completions", json=chat("one two three four", stop=["thr", "zzz"]))).json()
    assert data["choices"][0]["message"]["content"] == "one two "
    assert data["choices"][0]["finish_reason"] == "stop"
    events = sse_events(
        (await llm.post("/v1/chat/completions", json=chat("one two three", stop="two", stream=True))).text
    )
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "one "


async def test_completions_shape(llm: httpx.AsyncClient) -> None:
    data = (await llm.post("/v1/completions", json={"model": "fake", "prompt": "x y z", "max_tokens": 2})).json()
    assert data["object"] == "text_completion"
    assert data["choices"][0]["text"] == "x y"
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    events = sse_events((await llm.post("/v1/completions", json={"prompt": ["p q"], "stream": True})).text)
    assert "".join(e["choices"][0]["text"] for e in events) == "p q"


async def test_several_prompts_get_n_choices_each_numbered_prompt_by_prompt(llm: httpx.AsyncClient) -> None:
    # LangChain's OpenAI LLM sends its batch as one list of prompts; OpenAI numbers the choices prompt * n + i
    body = {"model": "fake", "prompt": ["a b", "c d e", "f"], "n": 2, "max_tokens": 8}
    data = (await llm.post("/v1/completions", json=body)).json()
    check(data, "CreateCompletionResponse")
    assert [(c["index"], c["text"]) for c in data["choices"]] == [
        (0, "a b"), (1, "a b"), (2, "c d e"), (3, "c d e"), (4, "f"), (5, "f")]
    assert data["usage"] == {"prompt_tokens": 2 + 3 + 1, "completion_tokens": 2 * (2 + 3 + 1), "total_tokens": 18}
    events = sse_events((await llm.post("/v1/completions", json={**body, "stream": True,
                                                                  "stream_options": {"include_usage": True}})).text)
    texts: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "a b", 1: "a b", 2: "c d e", 3: "c d e", 4: "f", 5: "f"}
    assert events[-1]["usage"] == data["usage"]


async def test_a_negative_seed_asks_for_a_random_one(llm: httpx.AsyncClient) -> None:
    # OpenAI's spec allows any int64; llama.cpp's clients send -1 for "random"
    for path, body in (("/v1/chat/completions", chat("a b", seed=-1)),
                       ("/v1/completions", {"prompt": "a b", "seed": -(2**63)})):
        response = await llm.post(path, json=body)
        assert response.status_code == 200, response.text


async def test_unknown_fields_are_ignored(llm: httpx.AsyncClient) -> None:
    body = chat("still works", some_future_option={"x": 1}, parallel_tool_calls=False, user="u1")
    response = await llm.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "still works"


async def test_models_and_health(llm: httpx.AsyncClient) -> None:
    models = (await llm.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["fake"]
    health = await llm.get("/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ready"


@pytest.mark.parametrize(
    ("content", "body", "needles"),
    [
        ("malformed", b'{"messages": [', ["not valid JSON"]),
        ("nested too deeply", b"[" * 5000 + b"]" * 5000, ["nested too deeply"]),
        ("empty", b"", ["empty"]),
        ("array", b"[1, 2]", ["JSON object"]),
        ("missing messages", {"model": "fake"}, ["messages", "required"]),
        ("empty messages", {"messages": []}, ["messages"]),
        ("messages not a list", {"messages": "hi"}, ["messages"]),
        ("bad role", {"messages": [{"role": "robot", "content": "x"}]}, ["messages[0].role"]),
        ("content a number", {"messages": [{"role": "user", "content": 5}]}, ["messages[0].content"]),
        (
            "part text a number",
            chat("x") | {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            ["messages[0].content[0].text"],
        ),
        ("temperature a string", chat("x", temperature="hot"), ["temperature"]),
        ("temperature too high", chat("x", temperature=3), ["temperature", "less than or equal to 2"]),
        ("max_tokens zero", chat("x", max_tokens=0), ["max_tokens"]),
        ("max_tokens float", chat("x", max_tokens=2.5), ["max_tokens"]),
        ("stream a string", chat("x", stream="yes"), ["stream"]),
        ("stop empty", chat("x", stop=""), ["stop"]),
        ("stop a number", chat("x", stop=7), ["stop"]),
        ("top_p zero", chat("x", top_p=0), ["top_p"]),
        ("n above max_n", chat("x", n=9), ["n must be at most 8", "max_n"]),
        ("top_logprobs", chat("x", logprobs=True, top_logprobs=2), ["top_logprobs"]),
        ("tool_choice without tools", chat("x", tool_choice="required"), ["tool_choice", "tools"]),
        ("unknown named tool", chat("x", tools=[TOOL], tool_choice=named("g")), ["'g'", "get_weather"]),
        ("two constraints", chat("x", response_format={"type": "json_object"}, guided_regex="a+"), ["one of"]),
        ("json_schema without schema", chat("x", response_format={"type": "json_schema"}), ["json_schema"]),
        ("legacy functions", chat("x", functions=[{"name": "f"}]), ["functions", "tools"]),
        ("tool without type", chat("x", tools=[{"function": {"name": "f"}}]), ["tools[0].type"]),
        ("history arguments not JSON", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
         ["messages[0].tool_calls[0].function.arguments"]),
        (
            "image part",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            ["image_url"],
        ),
    ],
)
async def test_bad_chat_requests_are_400_naming_the_problem(
    llm: httpx.AsyncClient, content: str, body: Any, needles: list[str]
) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await llm.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(response, 400, *needles)
    follow_up = await llm.post("/v1/chat/completions", json=chat("ok"))
    assert follow_up.status_code == 200


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "prompt"),
        ({"prompt": []}, "non-empty list"),
        ({"prompt": [1, 2, 3]}, "token-id prompts are not supported"),
        ({"prompt": [[1, 2], [3]]}, "token-id prompts are not supported"),
        ({"prompt": ["a"] * 33}, "33 prompts x n=1"),
        ({"prompt": ["a"] * 5, "n": 8}, "5 prompts x n=8"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": 12}, "prompt"),
    ],
)
async def test_bad_completion_requests_are_400(llm: httpx.AsyncClient, body: dict[str, Any], needle: str) -> None:
    assert_error(await llm.post("/v1/completions", json=body), 400, needle)


async def test_unknown_route_and_method_are_json_errors(llm: httpx.AsyncClient) -> None:
    assert_error(await llm.post("/v1/nope", json={}), 404, "/v1/chat/completions")
    assert_error(await llm.get("/v1/chat/completions"), 405)
    assert_error(await llm.post("/v1/embeddings", json={"input": "x"}), 404)


async def test_body_over_the_limit_is_413_naming_the_limit(llm: httpx.AsyncClient) -> None:
    big = json.dumps(chat("x" * 20_000)).encode()
    error = assert_error(await llm.post("/v1/chat/completions", content=big), 413, "0.01 MiB", "max_request_mb")
    assert error["code"] == "request_too_large"

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the limit holds while reading
        for start in range(0, len(big), 1000):
            yield big[start : start + 1000]

    response = await llm.post("/v1/chat/completions", content=chunked())
    assert "content-length" not in response.request.headers
    assert_error(response, 413, "0.01 MiB")
    assert (await llm.post("/v1/chat/completions", json=chat("small"))).status_code == 200


async def test_fatal_marker_is_500_with_the_fatal_header_and_health_fails_for_good(llm: httpx.AsyncClient) -> None:
    response = await llm.post("/v1/chat/completions", json=chat("boom [[fatal]]"))
    error = assert_error(response, 500, "CL_OUT_OF_RESOURCES")
    assert response.headers[FATAL_HEADER] == "1"
    assert error["code"] == "engine_fatal"
    health = await llm.get("/health")
    assert health.status_code == 503
    assert health.json()["status"] == "failed"
    assert_error(await llm.post("/v1/chat/completions", json=chat("after")), 503, "failed")


async def test_fatal_marker_in_a_stream_answers_before_the_stream_starts(llm: httpx.AsyncClient) -> None:
    response = await llm.post("/v1/chat/completions", json=chat("[[fatal]]", stream=True))
    assert_error(response, 500, "CL_OUT_OF_RESOURCES")
    assert response.headers[FATAL_HEADER] == "1"


async def test_error_marker_is_an_ordinary_500_and_the_server_keeps_serving(llm: httpx.AsyncClient) -> None:
    response = await llm.post("/v1/chat/completions", json=chat("oops [[error]]"))
    assert_error(response, 500, "injected error")
    assert FATAL_HEADER not in response.headers
    assert (await llm.get("/health")).status_code == 200
    assert (await llm.post("/v1/chat/completions", json=chat("fine"))).status_code == 200


async def test_custom_fatal_patterns_are_honoured() -> None:
    spec = fake_spec(fatal_patterns=["injected error"])
    async with client_for(build_app(spec, FakeTextGenerator(spec))) as client:
        response = await client.post("/v1/chat/completions", json=chat("[[error]]"))
        assert response.headers.get(FATAL_HEADER) == "1"
        assert (await client.get("/health")).status_code == 503


async def test_a_fatal_error_halts_the_runtime_and_asks_to_exit_once_the_answer_is_out() -> None:
    spec = fake_spec()
    exits: list[str] = []
    runtime = ModelRuntime(spec, on_fatal=lambda: exits.append(runtime.status))
    async with client_for(build_app(spec, FakeTextGenerator(spec), runtime=runtime)) as client:
        assert (await client.post("/v1/chat/completions", json=chat("fine"))).status_code == 200
        assert exits == []
        response = await client.post("/v1/chat/completions", json=chat("[[fatal]]"))
        assert response.status_code == 500 and response.headers[FATAL_HEADER] == "1"
        assert exits == ["failed"]  # called after the response, before the next request


@pytest.mark.parametrize(
    "message",
    ["clFinish, error code: -5", "[GPU] device hung, reset, was removed", "ze failed with code 1879048193",
     "GPU plugin may be unable to finish correctly", "cl_invalid_command_queue"],
)
async def test_default_fatal_patterns_match_case_insensitively(message: str) -> None:
    spec = fake_spec()
    async with client_for(build_app(spec, FailingMidStream(spec, message))) as client:
        events = sse_events((await client.post("/v1/chat/completions", json=chat("x", stream=True))).text)
        assert events[-1]["error"]["code"] == "engine_fatal"


async def test_suspect_errors_are_ordinary_until_the_second_within_the_window() -> None:
    spec = fake_spec()
    now = [0.0]
    runtime = ModelRuntime(spec, clock=lambda: now[0])
    async with client_for(build_app(spec, FakeTextGenerator(spec), runtime=runtime)) as client:
        first = await client.post("/v1/chat/completions", json=chat("[[suspect]]"))
        assert first.status_code == 500 and FATAL_HEADER not in first.headers
        assert first.json()["error"]["code"] == "engine_suspect"
        now[0] = 61.0  # the window passed: still an ordinary error
        assert FATAL_HEADER not in (await client.post("/v1/chat/completions", json=chat("[[suspect]]"))).headers
        now[0] = 100.0
        second = await client.post("/v1/chat/completions", json=chat("[[suspect]]"))
        assert second.headers[FATAL_HEADER] == "1" and second.json()["error"]["code"] == "engine_suspect"
        assert (await client.get("/health")).status_code == 503


async def test_continue_final_message_continues_the_assistant_answer(llm: httpx.AsyncClient) -> None:
    whole = (await llm.post("/v1/chat/completions", json=chat("one two three four five", stream=True))).text
    full = "".join(e["choices"][0]["delta"].get("content", "") for e in sse_events(whole) if e.get("choices"))
    body = chat("one two three four five", stream=True, continue_final_message=True)
    body["messages"].append({"role": "assistant", "content": "one two"})
    events = sse_events((await llm.post("/v1/chat/completions", json=body)).text)
    rest = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e.get("choices"))
    assert "one two" + rest == full == "one two three four five"


async def test_continue_final_message_needs_an_assistant_message_last(llm: httpx.AsyncClient) -> None:
    response = await llm.post("/v1/chat/completions", json=chat("hi", continue_final_message=True))
    assert assert_error(response, 400, "continue_final_message")["param"] == "continue_final_message"


async def test_while_loading_health_and_requests_are_503() -> None:
    spec = fake_spec()
    runtime = ModelRuntime(spec)
    async with client_for(build_app(spec, runtime=runtime)) as client:
        health = await client.get("/health")
        assert (health.status_code, health.json()["status"]) == (503, "loading")
        response = await client.post("/v1/chat/completions", json=chat("x"))
        assert assert_error(response, 503, "loading")["code"] == "model_loading"
        assert response.headers["retry-after"] == "1"
        runtime.set_ready(FakeTextGenerator(spec))
        assert (await client.get("/health")).status_code == 200
        assert (await client.post("/v1/chat/completions", json=chat("x"))).status_code == 200


def test_fast_json_response_writes_the_numbers_json_would_and_never_nan() -> None:
    vector = [float(np.float32(x)) for x in np.linspace(-1, 1, 384)]
    content = {"data": [{"embedding": vector, "index": 0}], "usage": {"prompt_tokens": 3}, "model": "é"}
    assert json.loads(FastJSONResponse(content).body) == content
    odd = {"a": np.arange(3, dtype=np.float32), "b": float("nan"), "c": np.float32(0.5)}
    assert json.loads(FastJSONResponse(odd).body) == {"a": [0.0, 1.0, 2.0], "b": None, "c": 0.5}


async def test_embeddings_float_and_base64_agree_and_are_deterministic(embedder: httpx.AsyncClient) -> None:
    texts = ["the cat sat", "the cat sat down", "quantum flux capacitor"]
    floats = (await embedder.post("/v1/embeddings", json={"input": texts})).json()
    assert floats["object"] == "list"
    assert floats["usage"]["prompt_tokens"] == 3 + 4 + 3
    vectors = np.array([item["embedding"] for item in floats["data"]])
    assert vectors.shape == (3, 64)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]
    packed = (await embedder.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"})).json()
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in packed["data"]])
    assert np.allclose(decoded, vectors, atol=1e-6)
    again = (await embedder.post("/v1/embeddings", json={"input": "the cat sat"})).json()
    assert np.allclose(again["data"][0]["embedding"], vectors[0])


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": ""}, "input: must not be empty"),
        ({"input": ["a", ""]}, "input: must not be empty"),
        ({"input": [1, 2]}, "check_embedding_ctx_length=False"),
        ({"input": [[15339, 1917]]}, "token-id arrays are not supported: send the text"),
        ({"input": "x", "dimensions": 8}, "dimensions"),
    ],
)
async def test_bad_embedding_requests_are_400(embedder: httpx.AsyncClient, body: dict[str, Any], needle: str) -> None:
    assert_error(await embedder.post("/v1/embeddings", json=body), 400, needle)


async def test_embedding_fault_markers(embedder: httpx.AsyncClient) -> None:
    assert FATAL_HEADER not in (await embedder.post("/v1/embeddings", json={"input": "[[error]]"})).headers
    response = await embedder.post("/v1/embeddings", json={"input": ["ok", "x [[fatal]]"]})
    assert_error(response, 500, "CL_OUT_OF_RESOURCES")
    assert response.headers[FATAL_HEADER] == "1"


class FailingMidStream(FakeTextGenerator):
    """Two words, then the engine fails with ``message`` (as a GPU driver would, mid-generation)."""

    def __init__(self, spec: ModelSpec, message: str) -> None:
        super().__init__(spec)
        self.message = message

    def generate(self, request: Any) -> Any:
        stream = super().generate(request)
        message = self.message

        async def deltas() -> AsyncIterator[str]:
            yield "two"
            yield " words"
            raise RuntimeError(message)

        stream._gen = deltas()  # type: ignore[attr-defined]
        return stream


@pytest.mark.parametrize(("message", "fatal"), [("CL_OUT_OF_RESOURCES in kernel", True), ("a transient hiccup", False)])
async def test_an_engine_error_mid_stream_ends_the_stream_with_an_error_event(message: str, fatal: bool) -> None:
    spec = fake_spec()
    async with client_for(build_app(spec, FailingMidStream(spec, message))) as client:
        response = await client.post("/v1/chat/completions", json=chat("x", stream=True))
        assert response.status_code == 200  # the stream had started: the error travels in it
        events = sse_events(response.text)
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e.get("choices")) == "two words"
        assert message in events[-1]["error"]["message"]
        assert events[-1]["error"]["code"] == ("engine_fatal" if fatal else "engine_error")
        assert (await client.get("/health")).status_code == (503 if fatal else 200)


async def test_error_marker_in_a_stream_is_a_500_before_the_stream(llm: httpx.AsyncClient) -> None:
    response = await llm.post("/v1/chat/completions", json=chat("[[error]]", stream=True))
    assert_error(response, 500, "injected error")
    assert not response.headers["content-type"].startswith("text/event-stream")
