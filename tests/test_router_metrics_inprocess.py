"""Request figures and cold-start feedback in-process (the router app, procman under fakes, a fake
upstream that answers like a fake-engine model server): the metrics of known traffic, comment lines
before a cold stream's data, one error event for a start that fails after the head. Moved from
tests/test_router_metrics.py with their assertions; that file keeps the end-to-end proofs over real
model-server processes (the OpenAI SDK over a socket, ``ovrouter status`` with measured RSS, the real
pipeline's KV-cache figures)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

import router.path.loading
from procman import State
from tests.router_fakes import Call, Exchange, FakeReply, FakeRouter, chat, fake_router
from tests.test_router_metrics import _samples, _value

pytestmark = pytest.mark.timeout(30)

WORDS = "one two three four five"
SSE = b"text/event-stream"


def model(**overrides: object) -> dict[str, object]:
    return {"engine": "fake", **overrides}


async def words(call: Call) -> FakeReply:
    """A fake-engine model server's answer: the last message word by word (a stream, with ``usage`` when
    asked), or whole; prompt tokens are the words of the messages."""
    body = json.loads(call.body)
    text = call.text
    prompt = len(" ".join(m["content"] for m in body["messages"]).split())
    usage = {"prompt_tokens": prompt, "completion_tokens": len(text.split()),
             "total_tokens": prompt + len(text.split())}
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": body["model"]}
    if not body.get("stream"):
        return FakeReply.json(200, {**head, "object": "chat.completion", "usage": usage, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]})

    def event(data: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps({**head, **data}, separators=(",", ":")).encode() + b"\n\n"  # as it sends

    deltas = [{"role": "assistant"}] + [{"content": (" " if i else "") + w} for i, w in enumerate(text.split())]
    chunks = [event({"choices": [{"index": 0, "delta": d, "finish_reason": None}]}) for d in deltas]
    chunks.append(event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append(event({"choices": [], "usage": usage}))
    return FakeReply(chunks=[*chunks, b"data: [DONE]\n\n"], content_type=SSE)


def content(reply: Exchange) -> str:
    out = ""
    for line in reply.body.decode().split("\n\n"):
        if line.startswith("data: {"):
            choices = json.loads(line[6:]).get("choices") or [{}]
            out += choices[0].get("delta", {}).get("content") or ""
    return out


async def test_metrics_count_known_traffic(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"m": model()}) as r, r.client() as client:
        r.upstream.handler = words
        for _ in range(3):
            reply = await r.post("/v1/chat/completions", chat("m", WORDS, stream=True,
                                                               stream_options={"include_usage": True}))
            assert reply.status == 200 and reply.body.endswith(b"data: [DONE]\n\n")
        for _ in range(2):
            reply = await r.post("/v1/chat/completions", chat("m", WORDS))
            assert reply.status == 200
        samples = _samples((await client.get("/metrics")).text)
        assert _value(samples, "ovrouter_time_to_first_token_seconds_count", model="m") == 3  # streams only
        assert _value(samples, "ovrouter_inter_token_latency_seconds_count", model="m") == 3
        assert _value(samples, "ovrouter_queue_wait_seconds_count", model="m") == 5  # every request
        assert _value(samples, "ovrouter_completion_tokens_total", model="m") == 5 * 5  # what usage said
        usage = reply.json()["usage"]
        assert _value(samples, "ovrouter_prompt_tokens_total", model="m") == 5 * usage["prompt_tokens"]
        assert ("ovrouter_model_last_load_seconds", (("model", "m"),)) in samples  # its value: test_router_model_view
        rows = (await client.get("/api/models")).json()["models"]
        row = next(row for row in rows if row["name"] == "m")
        assert row["requests_per_min"] == 5 and row["ttft_p50_s"] is not None
        assert sum(row["sparkline"]) == 5
        recent = (await client.get("/api/requests")).json()["requests"]
        assert [r["state"] for r in recent] == ["done"] * 5
        assert {r["completion_tokens"] for r in recent} == {5}


async def cold_stream(r: FakeRouter, name: str, reply: Exchange, **extra: object) -> asyncio.Future[Exchange]:
    """Send a stream to ``name`` while its start cannot end, and return once the client has two ticks."""
    r.harness.spawner.on_spawn = lambda proc: setattr(proc, "healthy", False)
    sent = asyncio.ensure_future(r.request("POST", "/v1/chat/completions",
                                           json.dumps(chat(name, WORDS, stream=True, **extra)).encode(), into=reply))
    async with asyncio.timeout(10):
        while reply.body.count(b": loading ") < 2 and not sent.done():
            await asyncio.sleep(0.005)
    assert r.backend(name).state is State.STARTING
    return sent


async def test_streams_waiting_on_a_start_get_comment_lines_first(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router.path.loading, "TICK_S", 0.01)
    async with fake_router(tmp_path, {"m": model(loading_progress="comments")}) as r:
        r.upstream.handler = words
        cold = Exchange()
        sent = await cold_stream(r, "m", cold)
        r.harness.spawner.last.healthy = True
        async with asyncio.timeout(10):
            while not sent.done():
                await r.harness.clock.advance(0.5)  # the next readiness probe finds it
        lines = [line for line in (await sent).body.decode().split("\n\n") if line]
        comments = [i for i, line in enumerate(lines) if line.startswith(": loading m ")]
        first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
        assert comments and max(comments) < first_data and cold.status == 200
        warm = await r.post("/v1/chat/completions", chat("m", WORDS, stream=True))
        assert b": loading" not in warm.body and content(cold) == content(warm) == WORDS


async def test_a_failed_start_after_the_head_is_one_error_event(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router.path.loading, "TICK_S", 0.01)
    async with fake_router(tmp_path, {"m": model(loading_progress="comments")}) as r:
        reply = Exchange()
        sent = await cold_stream(r, "m", reply)
        proc = r.harness.spawner.last
        proc.say("RuntimeError: no such weights")
        proc.exit(1)
        await asyncio.wait_for(sent, 10)
        lines = [line for line in reply.body.decode().split("\n\n") if line]
        assert reply.status == 200 and lines[0].startswith(": loading m ")
        errors = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
        assert len(errors) == 1 and "no such weights" in errors[0]["error"]["message"], lines
        assert lines[-1] == "data: [DONE]", lines  # as a stream failing mid-way ends
        assert r.upstream.calls == []
