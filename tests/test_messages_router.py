"""The Anthropic Messages API through a real router over fake-engine model servers, with the ``anthropic`` SDK:
``x-api-key`` auth, Anthropic's error shape for the router's own errors, ``count_tokens``, ``ping`` events while
a cold model loads, a stream resumed on the fresh process after its backend died, and the ``error`` event that
ends a stream which cannot be resumed. Each test runs its own router in this event loop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.router_helpers import RunningRouter, fake_model, running_router, write_config

pytestmark = pytest.mark.timeout(120)

WORDS = " ".join(f"w{i}" for i in range(24))
STALLING = WORDS.replace("w11 ", "w11 [[stall]] ")  # half the words, then silence until the process dies
KEY = "sekret"


def sdk(router: RunningRouter, key: str = KEY) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=router.url, api_key=key, max_retries=0, timeout=60)


def ask(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "echo", "max_tokens": 200, "messages": [{"role": "user", "content": text}], **extra}


def sse(raw: str) -> list[tuple[str, Any]]:
    """(event name, parsed data) of each event; comment lines skipped."""
    found = []
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        name = next((line[7:] for line in lines if line.startswith("event: ")), "")
        data = next((json.loads(line[6:]) for line in lines if line.startswith("data: ")), None)
        if name or data is not None:
            found.append((name, data))
    return found


def text_of(events: list[tuple[str, Any]]) -> str:
    return "".join(data["delta"].get("text", "") for name, data in events if name == "content_block_delta")


async def wait_for(predicate: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def config(tmp_path: Path, router: dict[str, Any] | None = None, **overrides: Any) -> Path:
    model = fake_model(**{"fake": {"load_s": 0.05, "token_delay_s": 0.03}, "aliases": ["claude-haiku-4-5"],
                          **overrides})
    return write_config(tmp_path, {"echo": model}, router=router)


async def test_sdk_with_x_api_key_count_tokens_and_anthropic_errors(tmp_path: Path) -> None:
    async with running_router(config(tmp_path, router={"api_keys": [KEY]})) as router:
        client = sdk(router)
        message = await client.messages.create(**ask("hello from the sdk", model="claude-haiku-4-5"))
        assert message.content[0].text == "hello from the sdk" and message.stop_reason == "end_turn"  # type: ignore
        async with client.messages.stream(**ask("one two three")) as stream:
            await stream.get_final_message()
        records = [r for r in router.service.console.activity.recent if r.path.startswith("/v1/messages")]
        assert (records[0].prompt_tokens, records[0].completion_tokens) == (4, 4)  # usage read for the metrics
        assert records[1].ttft_s is not None and records[1].completion_tokens == 3  # and the stream's tokens
        counted = await client.messages.count_tokens(model="echo", messages=ask("hello from the sdk")["messages"])
        assert counted.input_tokens == message.usage.input_tokens
        beta = await client.beta.messages.create(**ask("beta route"))  # POST /v1/messages?beta=true
        assert beta.content[0].text == "beta route"  # type: ignore[union-attr]
        with pytest.raises(anthropic.AuthenticationError) as wrong:
            await sdk(router, "wrong").messages.create(**ask("hi"))
        assert wrong.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                               "message": wrong.value.body["error"]["message"]}}
        with pytest.raises(anthropic.NotFoundError) as unknown:
            await client.messages.create(**ask("hi", model="claude-opus-9"))
        assert unknown.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
        assert "claude-opus-9" in unknown.value.message
        bearer = await router.client.post("/v1/messages", json=ask("by bearer"),
                                          headers={"Authorization": f"Bearer {KEY}"})
        assert bearer.status_code == 200 and bearer.json()["content"][0]["text"] == "by bearer"
        with pytest.raises(anthropic.InternalServerError) as failed:  # an error before the first event: a response
            await client.messages.create(**ask("[[error]]", stream=True))
        assert failed.value.status_code == 500 and failed.value.body["error"]["type"] == "api_error"  # type: ignore
        key = {"x-api-key": KEY}  # accepted router-wide, as a Bearer key is
        resp = await router.client.post("/upstream/echo/v1/messages", json=ask("raw"), headers=key)
        assert resp.status_code == 200 and resp.json()["content"][0]["text"] == "raw"
        assert (await router.client.get("/api/models", headers=key)).status_code == 200
        assert (await router.client.get("/v1/models", headers=key)).status_code == 200
        assert (await router.client.get("/v1/models", headers={"x-api-key": "wrong"})).status_code == 401


async def test_a_model_that_cannot_start_is_an_overloaded_error(tmp_path: Path) -> None:
    async with running_router(config(tmp_path, fake={"load_s": 0.05, "fail_load": "no such weights"})) as router:
        resp = await router.client.post("/v1/messages", json=ask("hi"))
        assert resp.status_code == 503
        assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "overloaded_error"


async def test_a_cold_stream_pings_while_the_model_loads(tmp_path: Path) -> None:
    model = {"fake": {"load_s": 1.2, "token_delay_s": 0.005}, "loading_progress": "comments"}
    async with running_router(config(tmp_path, **model)) as router:
        async with router.client.stream("POST", "/v1/messages", json=ask("cold start", stream=True)) as resp:
            raw = (await resp.aread()).decode()
        events = sse(raw)
        names = [name for name, _ in events]
        assert names.index("ping") < names.index("message_start"), names  # pings came while it loaded
        assert names.count("message_stop") == 1 and names[-1] == "message_stop"
        assert text_of(events) == "cold start"
        await router.client.post("/api/models/echo/unload")
        await wait_for(lambda: router.backend("echo").state.value == "stopped")
        async with sdk(router).messages.stream(**ask("cold again")) as stream:  # the SDK reads the pings
            final = await stream.get_final_message()
        assert final.content[0].text == "cold again" and final.stop_reason == "end_turn"  # type: ignore


async def _kill_after(router: RunningRouter, body: dict[str, Any], deltas: int) -> list[tuple[str, Any]]:
    """Stream ``body``, killing the process once ``deltas`` text deltas reached the client."""
    first, raw, seen = router.backend("echo"), "", 0
    async with router.client.stream("POST", "/v1/messages", json=body) as resp:
        assert resp.status_code == 200
        async for chunk in resp.aiter_text():
            raw += chunk
            seen = raw.count("event: content_block_delta")
            if seen >= deltas and first.pid is not None and "killed" not in raw:
                os.kill(first.pid, signal.SIGKILL)
                raw += ": killed\n\n"
    return sse(raw)


async def test_a_stream_whose_backend_is_killed_is_resumed(tmp_path: Path) -> None:
    async with running_router(config(tmp_path)) as router:
        events = await _kill_after(router, ask(STALLING, stream=True), 5)
        names = [name for name, _ in events]
        assert names.count("message_start") == 1 and names.count("message_stop") == 1 and "error" not in names
        assert names.count("content_block_start") == 1 and names[-1] == "message_stop"
        assert text_of(events) == STALLING  # the same text an unbroken stream gives
        (usage,) = [data["usage"] for name, data in events if name == "message_delta"]
        assert usage["output_tokens"] == 25
        assert router.backend("echo").restarts == 1


async def test_a_fatal_error_mid_stream_is_resumed_for_the_sdk(tmp_path: Path) -> None:
    async with running_router(config(tmp_path)) as router:
        text = WORDS.replace("w3 ", "w3 [[fatal-mid]] ")
        async with sdk(router).messages.stream(**ask(text)) as stream:
            final = await stream.get_final_message()
        assert final.content[0].text == text and final.stop_reason == "end_turn"  # type: ignore[union-attr]
        await wait_for(lambda: router.backend("echo").restarts == 1)


async def test_a_stream_that_cannot_be_resumed_ends_with_an_error_event(tmp_path: Path) -> None:
    tools = [{"name": "lookup", "input_schema": {"type": "object", "properties": {}}}]  # tools: not resumable
    async with running_router(config(tmp_path)) as router:
        events = await _kill_after(router, ask(STALLING, stream=True, tools=tools), 3)
        names = [name for name, _ in events]
        assert names[-1] == "error" and names.count("error") == 1 and "message_stop" not in names
        error = events[-1][1]
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        assert "died" in error["error"]["message"]
        with pytest.raises(anthropic.APIStatusError):  # the SDK raises on the error event
            async with sdk(router).messages.stream(**ask(f"{WORDS} [[crash-mid]]")) as stream:
                await stream.get_final_message()


def test_metrics_count_the_cache_reads_in_a_messages_prompt() -> None:
    """Messages usage keeps cache reads out of input_tokens; the router's prompt-token figure adds them back."""
    from router.api.activity import RequestRecord, _Watcher

    async def send(message: Any) -> None: ...

    def seen(body: bytes) -> tuple[int | None, int | None]:
        record = RequestRecord(id=1, model="m", path="/v1/messages", client=None, started_at=0.0, t0=0.0)
        _Watcher(record, None, send)._usage(body)
        return record.prompt_tokens, record.completion_tokens

    assert seen(b'{"usage":{"input_tokens":1,"output_tokens":4,"cache_read_input_tokens":31}}') == (32, 4)
    assert seen(b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
                b'"usage":{"input_tokens":2,"output_tokens":3,"cache_read_input_tokens":0}}\n\n') == (2, 3)
    responses = b'{"usage":{"input_tokens":9,"input_tokens_details":{"cached_tokens":8},"output_tokens":2}}'
    assert seen(responses) == (9, 2)  # OpenAI's input_tokens already hold the cached ones


def test_a_resumed_stream_keeps_the_first_prompts_split_of_cache_reads() -> None:
    """The continuation runs on a fresh process (no cache): its usage says the first prompt, as it was split."""
    from router.path.resume import Progress
    from router.path.resume_anthropic import MessagesSplice

    first = {"input_tokens": 6, "output_tokens": 0, "cache_read_input_tokens": 32}
    seen = Progress(tokens=5, role_sent=True, usage=first)
    delta = {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
             "usage": {"input_tokens": 43, "output_tokens": 195, "cache_read_input_tokens": 0}}
    out = MessagesSplice(seen).feed(f"event: message_delta\ndata: {json.dumps(delta)}\n\n".encode())
    (data,) = [json.loads(line[6:]) for line in out.decode().splitlines() if line.startswith("data: ")]
    assert data["usage"] == {"input_tokens": 6, "output_tokens": 200, "cache_read_input_tokens": 32}


async def test_the_anthropic_sdk_lists_and_retrieves_models(tmp_path: Path) -> None:
    """With ``anthropic-version`` (the SDK's header), /v1/models adds Anthropic's ModelInfo and page fields."""
    async with running_router(config(tmp_path)) as router:
        client = sdk(router)
        page = await client.models.list()
        assert [(m.id, m.type, m.display_name) for m in page.data] == [("echo", "model", "echo")]
        assert page.has_more is False and page.first_id == page.last_id == "echo"
        alias = await client.models.retrieve("claude-haiku-4-5")
        assert alias.id == "claude-haiku-4-5" and alias.type == "model" and alias.created_at.year >= 2024
        plain = (await router.client.get("/v1/models")).json()  # an OpenAI client: unchanged
        assert "type" not in plain["data"][0] and "has_more" not in plain


async def test_the_anthropic_sdk_reads_a_models_context(tmp_path: Path, demo_gguf: Path) -> None:
    """ModelInfo's max_input_tokens / max_tokens: the context the model server enforces, read without loading."""
    models = {"smol": {"task": "llm", "path": str(demo_gguf)}, "echo": fake_model()}
    async with running_router(write_config(tmp_path, models)) as router:
        client = sdk(router)
        smol = await client.models.retrieve("smol")
        assert smol.max_input_tokens == smol.max_tokens == 8192  # the GGUF's context, capped at 8192
        echo = await client.models.retrieve("echo")
        assert echo.max_input_tokens is None and echo.max_tokens is None  # no model file to read it from
        smol_model = router.service.registry.resolve("smol")
        assert smol_model is not None and smol_model.backend.state.value == "stopped"  # listing loads nothing
