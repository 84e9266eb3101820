"""The real OpenVINO pipeline on SmolLM2-135M behind ``python -m modelserver``, through the official SDK.

One server for the module. Greedy decoding makes answers repeatable on one machine, but not
across machines: the CPU plugin's kernels (AVX2, AVX-512, AMX) and its default precision (bf16
where the CPU has it) change the logits, so these tests assert invariants and robust facts
("Paris"), force the length with ``ignore_eos`` where the length is what is tested, and compare
a request with another one's answer on the same server instead of a recorded text.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from modelserver_helpers import ModelServerProcess, modelserver

from modelserver.cli import EXIT_FATAL
from modelserver.spec import build_model_spec

pytestmark = pytest.mark.real_model

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
NO_EOS = {"ignore_eos": True}  # where the length is what is tested: an EOS on some CPU must not end it sooner


@pytest.fixture(scope="module")
def server(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelServerProcess]:
    cache = tmp_path_factory.mktemp("ov-cache")
    spec = build_model_spec("smollm2", {"path": str(demo_gguf), "cache_dir": str(cache), "default_max_tokens": 64})
    with modelserver(spec=spec, ready_timeout_s=180) as running:
        yield running


@pytest.fixture
def client(server: ModelServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def test_france_question_answers_paris(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0)
    assert "Paris" in (answer.choices[0].message.content or "")
    assert answer.usage is not None
    assert answer.usage.prompt_tokens > 10  # the chat template's system prompt is counted
    assert_finish_consistent(answer.choices[0].finish_reason, answer.usage.completion_tokens, limit=64)


def assert_finish_consistent(finish_reason: str | None, completion_tokens: int, limit: int) -> None:
    """``length`` exactly at the limit; ``stop`` (EOS) anywhere up to it."""
    assert finish_reason in ("stop", "length")
    assert 0 < completion_tokens <= limit
    if finish_reason == "length":
        assert completion_tokens == limit


def test_stream_yields_several_chunks_and_a_final_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="smollm2", messages=FRANCE, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) >= 4
    assert "".join(deltas) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    usage = chunks[-1].usage
    assert usage is not None and whole.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_max_tokens_5_ends_with_length_and_5_tokens(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="smollm2", messages=FRANCE, temperature=0, max_tokens=5, extra_body=NO_EOS
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 5
    completion = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=5, extra_body=NO_EOS
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    assert "Paris" in completion.choices[0].text


def test_stop_string_is_honoured_streamed_and_not(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0)
    full = whole.choices[0].message.content or ""
    assert "Paris" in full  # this machine's answer; the stop string is cut out of it, whatever it says around it
    answer = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, stop=["Paris"])
    text = answer.choices[0].message.content or ""
    assert text == full[: full.index("Paris")]
    assert "Par" not in text
    assert answer.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, stop="Paris", stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text


SYMBOLS = "\U0001f600 \U0001f389 \U0001f680 \u00e9\u00e8 \u4f60\u597d"
MULTIBYTE_PROMPTS: list[dict[str, Any]] = [  # answers with characters of 3-4 UTF-8 bytes on the CPUs tried
    {"messages": [{"role": "user", "content": "Write a smiley emoji."}]},
    {"messages": [{"role": "user", "content": f"Repeat after me: {SYMBOLS}"}]},
    {"prompt": "\U0001f600 \U0001f389 \U0001f680 " * 6},
]


def multibyte_answer(client: openai.OpenAI) -> tuple[dict[str, Any], str]:
    """The first prompt whose greedy answer on this machine has a character of 3+ UTF-8 bytes (the bytes of
    such a character span several byte-level tokens; the unit tests cover every split exactly)."""
    answers = []
    for prompt in MULTIBYTE_PROMPTS:
        params = {"model": "smollm2", "temperature": 0, "max_tokens": 30, "extra_body": NO_EOS, **prompt}
        if "messages" in params:
            text = client.chat.completions.create(**params).choices[0].message.content or ""
        else:
            text = client.completions.create(**params).choices[0].text
        if any(ord(ch) > 0x7FF for ch in text):
            return params, text
        answers.append(text)
    raise AssertionError(f"no prompt gave a multibyte answer on this machine: {answers}")


def test_multibyte_characters_stream_whole(client: openai.OpenAI) -> None:
    params, text = multibyte_answer(client)
    if "messages" in params:
        stream = client.chat.completions.create(**params, stream=True)
        deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    else:
        deltas = [c.choices[0].text for c in client.completions.create(**params, stream=True) if c.choices]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == text


async def test_four_concurrent_streams_are_batched_and_complete(server: ModelServerProcess) -> None:
    questions = {"France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Japan": "Tokyo"}
    events: list[tuple[str, str]] = []

    async def ask(sdk: openai.AsyncOpenAI, country: str) -> str:
        stream = await sdk.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": f"What is the capital of {country}?"}],
            temperature=0,
            max_tokens=100,
            extra_body={"ignore_eos": True},  # long enough that the four surely overlap, even on a busy CPU
            stream=True,
        )
        parts = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                events.append(("token", country))
                parts.append(chunk.choices[0].delta.content)
        events.append(("done", country))
        return "".join(parts)

    async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as sdk:
        answers = await asyncio.gather(*(ask(sdk, country) for country in questions))
    for (country, capital), answer in zip(questions.items(), answers, strict=True):
        assert capital in answer, (country, answer)
    first_done = next(i for i, (kind, _) in enumerate(events) if kind == "done")
    started = {country for kind, country in events[:first_done] if kind == "token"}
    assert started == set(questions), "every stream produced tokens before the first one finished"


def test_disconnect_cancels_the_generation_and_frees_the_slot(server: ModelServerProcess) -> None:
    before = server.health().json()
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    received = 0
    with server.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            received += line.startswith("data: ")
            if received == 5:
                break  # closing the connection mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = server.health().json()
        if health["cancelled"] == before["cancelled"] + 1 and health["running"] == 0:
            break
        time.sleep(0.05)
    assert health["cancelled"] == before["cancelled"] + 1
    assert health["running"] == 0
    assert health["completed"] == before["completed"]
    assert "cancelled after" in server.log_text()
    with server.client() as http:
        follow_up = http.post("/v1/chat/completions", json={"messages": FRANCE, "temperature": 0, "max_tokens": 12})
    assert "Paris" in follow_up.json()["choices"][0]["message"]["content"]


def test_bad_sampling_values_are_400_and_the_server_keeps_serving(server: ModelServerProcess) -> None:
    with server.client() as http:
        response = http.post("/v1/chat/completions", json={"messages": FRANCE, "temperature": -1})
        assert response.status_code == 400
        assert "temperature" in response.json()["error"]["message"]
        sampled = http.post(
            "/v1/chat/completions",
            json={
                "messages": FRANCE,
                "temperature": 0.7,
                "top_p": 0.9,
                "seed": 7,
                "presence_penalty": 0.5,
                "max_tokens": 8,
            },
        )
        assert sampled.status_code == 200
        assert sampled.json()["usage"]["completion_tokens"] <= 8
        assert http.get("/health").status_code == 200


def test_one_log_line_per_request_and_model_properties_at_start(server: ModelServerProcess) -> None:
    with server.client() as http:
        http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    log = server.wait_log("completion_tokens=3 finish=length")
    assert "loaded smollm2 (task llm)" in log
    assert "eos_token_id=" in log
    assert "POST /v1/completions 200" in log
    assert "completion_tokens=3 finish=length" in log
    with server.client() as http:  # a refused request logs as an error, not as a client that went away
        refused = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1_000_000})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    log = server.wait_log("POST /v1/completions 400")
    line = next(line for line in log.splitlines() if "POST /v1/completions 400" in line)
    assert "finish=error" in line and "cancelled" not in line


def test_a_repeated_long_prefix_is_served_from_the_prefix_cache(server: ModelServerProcess) -> None:
    """Prefix caching is on by default: the second request reports most of its prompt as cached."""
    history = [{"role": "system", "content": " ".join(f"Rule {i}: answer briefly." for i in range(60))}]
    with server.client() as http:
        before = http.get("/health").json()
        answers = [
            http.post("/v1/chat/completions", json={
                "messages": [*history, {"role": "user", "content": question}], "max_tokens": 2, "temperature": 0,
            }).json()["usage"]
            for question in ("What is rule 3?", "And what is rule 7?")
        ]
        after = http.get("/health").json()
    assert before["prefix_caching"] is True
    assert answers[0]["prompt_tokens"] > 300
    second = answers[1]["prompt_tokens_details"]["cached_tokens"]
    assert answers[1]["prompt_tokens"] - 64 < second < answers[1]["prompt_tokens"]  # all but the new question
    assert second % 32 == 0  # whole KV blocks
    assert after["prefix_cached_tokens"] - before["prefix_cached_tokens"] >= second
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]


def test_a_request_before_the_server_is_ready_gets_503_loading(demo_gguf: Path) -> None:
    spec = build_model_spec("late", {"path": str(demo_gguf)})
    with modelserver(spec=spec, wait=False) as late:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                response = late.health(timeout_s=2.0)
                break
            except httpx.TransportError:
                time.sleep(0.02)
        assert (response.status_code, response.json()["status"]) == (503, "loading")


# A real pipeline error on demand: with a batch of at most 16 tokens and no split-fuse, the
# ContinuousBatchingPipeline's scheduler refuses a longer prompt inside step().
TINY_BATCH = {"max_num_batched_tokens": 16, "max_num_seqs": 4, "dynamic_split_fuse": False}
LONG_PROMPT = {"prompt": "word " * 60, "max_tokens": 2}
SHORT_PROMPT = {"prompt": "Hi", "max_tokens": 2}
SCHEDULER_REFUSAL = "longer than max number of tokens in batch"


def tiny_batch_server(
    demo_gguf: Path, tmp: Path, **extra: object
) -> contextlib.AbstractContextManager[ModelServerProcess]:
    spec = build_model_spec("tiny", {"path": str(demo_gguf), "cache_dir": str(tmp), "scheduler": TINY_BATCH, **extra})
    return modelserver(spec=spec, ready_timeout_s=180)


def test_a_real_engine_error_is_a_500_and_the_server_keeps_serving(demo_gguf: Path, tmp_path: Path) -> None:
    with tiny_batch_server(demo_gguf, tmp_path) as server, server.client() as http:
        failed = http.post("/v1/completions", json=LONG_PROMPT)
        assert failed.status_code == 500 and SCHEDULER_REFUSAL in failed.json()["error"]["message"]
        assert "x-backend-fatal" not in failed.headers
        assert http.post("/v1/completions", json=SHORT_PROMPT).status_code == 200
        assert http.get("/health").status_code == 200


def test_a_real_engine_error_matching_fatal_patterns_fails_the_process(demo_gguf: Path, tmp_path: Path) -> None:
    with tiny_batch_server(demo_gguf, tmp_path, fatal_patterns=[SCHEDULER_REFUSAL]) as server, server.client() as http:
        failed = http.post("/v1/completions", json=LONG_PROMPT)
        assert failed.status_code == 500 and failed.headers["x-backend-fatal"] == "1"
        assert server.wait_exit(timeout_s=30) == EXIT_FATAL  # answered, then never touches the device again
