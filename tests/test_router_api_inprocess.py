"""The router's HTTP surface in-process (the real app, procman under fakes, a fake upstream:
tests/router_fakes.py): bad requests, API keys, cold-start sharing, fatal/crash/error answers,
preload, task routing, /metrics and the vLLM names, an operator's cancel, /api/events and the
streams' end at shutdown. Moved from tests/test_router_proxy.py and tests/test_router_metrics.py
with their assertions; those files keep the end-to-end proofs over real model-server processes
(the SDK over a socket, idle stop, a hang, cancel on disconnect, logs, measured memory)."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from procman import State
from router.edge.httpclient import UpstreamError
from router.vllm_metrics import VLLM_NAMES
from tests.procman_fakes import FakeProcess, settle
from tests.router_fakes import Call, Exchange, FakeReply, FakeRouter, chat, echo, fake_router
from tests.test_router_metrics import _samples, _value, _vllm_sample
from tests.test_router_proxy import wait_for

pytestmark = pytest.mark.timeout(30)

FATAL = (b"x-backend-fatal", b"1")
SSE = b"text/event-stream"


def model(**overrides: object) -> dict[str, object]:
    return {"engine": "fake", "loading_progress": "off", **overrides}


def sdk(r: FakeRouter, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=key, max_retries=0,
                              http_client=r.client())


async def like_the_fake_engine(call: Call) -> FakeReply:
    """What a fake-engine model server answers: ``[[fatal]]`` a fatal 500, ``[[crash]]`` its process
    dies under the request, ``[[error]]`` an ordinary 500; anything else is echoed."""
    if "[[fatal]]" in call.text:
        return FakeReply.json(500, {"error": {"message": "CL_OUT_OF_RESOURCES in step()", "type": "server_error",
                                              "param": None, "code": "engine_fatal"}}, headers=[FATAL])
    if "[[crash]]" in call.text:
        assert call.proc is not None
        call.proc.exit(-signal.SIGSEGV)
        raise UpstreamError("backend closed the connection")
    if "[[error]]" in call.text:
        return FakeReply.json(500, {"error": {"message": "engine failed", "type": "server_error", "param": None,
                                              "code": "engine_error"}})
    return await echo(call)


def content(reply: Any) -> str:
    return str(reply.json()["choices"][0]["message"]["content"])


async def test_bad_requests_get_openai_style_errors(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r, r.client() as client:
        unknown = await client.post("/v1/chat/completions", json=chat("nope"))
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found" and "echo" in unknown.json()["error"]["message"]
        broken = await client.post("/v1/chat/completions", content=b"{not json")
        assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
        missing = await client.post("/v1/embeddings", json={"input": "x"})
        assert missing.status_code == 400 and "`model` is required" in missing.json()["error"]["message"]
        no_route = await client.get("/v2/whatever")
        assert no_route.status_code == 404 and "error" in no_route.json()
        ollama_at_root = await client.post("/api/chat", json=chat("echo"))  # an Ollama URL without /ollama
        assert ollama_at_root.status_code == 404 and "http://HOST:PORT/ollama" in ollama_at_root.text
        twice = await client.post("/v1/v1/messages", json=chat("echo"))  # ANTHROPIC_BASE_URL=.../v1
        assert twice.status_code == 404 and "ends in /v1 once too often" in twice.json()["error"]["message"]
        bare = await client.post("/chat/completions", json=chat("echo"))  # OpenAI(base_url="http://HOST:PORT")
        assert bare.status_code == 404 and "did you mean /v1/chat/completions?" in bare.json()["error"]["message"]
        wrong_method = await client.get("/v1/chat/completions")
        assert wrong_method.status_code == 405 and "error" in wrong_method.json()
        assert r.backend("echo").state is State.STOPPED, "nothing above may start a model"


async def test_concurrent_cold_starts_share_one_process(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"slow": model()}) as r, r.client() as client:
        loaded, spawn = asyncio.Event(), r.harness.spawner.spawn

        async def slow_spawn(*args: Any) -> FakeProcess:  # the start takes until every request waits on it
            await loaded.wait()
            return await spawn(*args)

        r.harness.spawner.spawn = slow_spawn  # type: ignore[method-assign]
        replies = asyncio.gather(*(client.post("/v1/chat/completions", json=chat("slow")) for _ in range(6)))
        await settle(200)
        assert r.backend("slow").state is State.STARTING
        loaded.set()
        assert [reply.status_code for reply in await replies] == [200] * 6
        backend = r.backend("slow")
        assert backend.starts == 1 and backend.state is State.READY
        metrics = (await client.get("/metrics")).text
        assert 'ovrouter_model_starts_total{model="slow",reason="cold",result="ok"} 1.0' in metrics
        assert 'ovrouter_requests_total{model="slow",status="200"} 6.0' in metrics


async def test_fatal_error_restarts_and_next_request_gets_a_new_process(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model(retry_on_fatal=False)}) as r, r.client() as client:
        r.upstream.handler = like_the_fake_engine
        assert (await client.post("/v1/chat/completions", json=chat("echo"))).status_code == 200
        first = r.harness.spawner.last
        fatal = await client.post("/v1/chat/completions", json=chat("echo", "boom [[fatal]]"))
        assert fatal.status_code == 503 and fatal.headers["retry-after"]
        assert "unrecoverable" in fatal.json()["error"]["message"]
        assert "CL_OUT_OF_RESOURCES" in fatal.json()["error"]["message"]
        ok = await client.post("/v1/chat/completions", json=chat("echo", "fine now"))
        assert ok.status_code == 200 and content(ok) == "fine now"
        backend = r.backend("echo")
        assert backend.pid not in (None, first.pid) and backend.restarts == 1
        assert not first.alive
        metrics = (await client.get("/metrics")).text
        assert 'ovrouter_model_restarts_total{model="echo",reason="fatal"} 1.0' in metrics


async def test_crash_mid_request_is_a_clean_502_and_the_model_comes_back(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model(retry_on_fatal=False)}) as r, r.client() as client:
        r.upstream.handler = like_the_fake_engine
        assert (await client.post("/v1/chat/completions", json=chat("echo"))).status_code == 200
        pid = r.backend("echo").pid
        crashed = await client.post("/v1/chat/completions", json=chat("echo", "[[crash]]"))
        assert crashed.status_code == 502 and crashed.json()["error"]["code"] == "request_crashed_model"
        ok = await client.post("/v1/chat/completions", json=chat("echo", "still here"))
        assert ok.status_code == 200 and r.backend("echo").pid != pid


async def test_ordinary_engine_error_passes_through_and_keeps_the_process(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r, r.client() as client:
        r.upstream.handler = like_the_fake_engine
        await client.post("/v1/chat/completions", json=chat("echo"))
        pid = r.backend("echo").pid
        error = await client.post("/v1/chat/completions", json=chat("echo", "[[error]]"))
        assert error.status_code == 500 and "error" in error.json()
        assert r.backend("echo").pid == pid and r.backend("echo").restarts == 0


async def test_api_keys_guard_v1_and_admin_keys_guard_api(tmp_path: Path) -> None:
    keys = {"api_keys": ["user-key"], "admin_keys": ["root-key"]}
    async with fake_router(tmp_path, {"echo": model()}, router=keys) as r, r.client() as client:
        anonymous = await client.post("/v1/chat/completions", json=chat("echo"))
        assert anonymous.status_code == 401 and anonymous.json()["error"]["type"] == "authentication_error"
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/upstream/echo/health")).status_code == 401
        user = {"Authorization": "Bearer user-key"}
        assert (await client.post("/v1/chat/completions", json=chat("echo"), headers=user)).status_code == 200
        assert (await client.get("/api/models", headers=user)).status_code == 401
        admin = {"Authorization": "Bearer root-key"}
        assert (await client.get("/api/models", headers=admin)).status_code == 200
        assert (await client.get("/health")).status_code == 200
        async with sdk(r, "wrong") as wrong, sdk(r, "user-key") as right:
            with pytest.raises(openai.AuthenticationError):
                await wrong.chat.completions.create(model="echo", messages=[{"role": "user", "content": "x"}])
            good = await right.chat.completions.create(model="echo", messages=[{"role": "user", "content": "x"}])
        assert good.choices[0].message.content == "x"


async def test_preload_starts_with_the_router(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"hot": model(preload=True), "cold": model()}) as r:
        await wait_for(lambda: r.backend("hot").state is State.READY, 10, "preload")
        assert r.backend("cold").state is State.STOPPED


async def test_models_of_other_tasks_route_by_model_field(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"emb": model(task="embeddings"), "chat": model()}) as r, r.client() as client:
        async def embeds(call: Call) -> FakeReply:
            inputs = json.loads(call.body)["input"]
            data = [{"object": "embedding", "index": i, "embedding": [0.5, 0.5]} for i, _ in enumerate(inputs)]
            return FakeReply.json(200, {"object": "list", "data": data, "model": "emb"})

        r.upstream.handler = embeds
        reply = await client.post("/v1/embeddings", json={"model": "emb", "input": ["a", "b"]})
        assert reply.status_code == 200 and len(reply.json()["data"]) == 2
        assert r.upstream.calls[0].path == "/v1/embeddings" and r.backend("chat").state is State.STOPPED


async def test_cohere_v2_rerank_path_routes_like_v1(tmp_path: Path) -> None:
    # the model server serves /v2/rerank (Cohere's v2 SDK) and the router answered it 404
    async with fake_router(tmp_path, {"rr": model(task="rerank"), "chat": model()}) as r, r.client() as client:
        async def ranks(call: Call) -> FakeReply:
            return FakeReply.json(200, {"results": [{"index": 0, "relevance_score": 0.5}]})

        r.upstream.handler = ranks
        body = {"model": "rr", "query": "q", "documents": ["a"]}
        assert (await client.post("/v2/rerank", json=body)).status_code == 200
        assert r.upstream.calls[-1].path == "/v2/rerank"
        wrong = await client.post("/v2/rerank", json={**body, "model": "chat"})
        assert wrong.status_code == 400 and "needs task rerank" in wrong.json()["error"]["message"]


async def test_metrics_endpoint_exposes_the_documented_series(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r, r.client() as client:
        await client.post("/v1/chat/completions", json=chat("echo"))
        text = (await client.get("/metrics")).text
        for name in (
            "ovrouter_model_loaded",
            "ovrouter_model_starts_total",
            "ovrouter_requests_total",
            "ovrouter_request_duration_seconds_bucket",
            "ovrouter_cold_start_duration_seconds_bucket",
            "ovrouter_in_flight",
            "ovrouter_queued",
            "ovrouter_config_valid",
        ):
            assert name in text, name
        assert 'ovrouter_model_loaded{model="echo"} 1.0' in text


async def test_only_the_named_families_are_exposed(tmp_path: Path) -> None:
    async with fake_router(tmp_path / "a", {"m": model()}) as r, r.client() as client:
        assert "vllm:" not in (await client.get("/metrics")).text  # the default: ovrouter names only
    async with fake_router(tmp_path / "b", {"m": model()}, router={"metrics_names": ["vllm"]}) as r, \
            r.client() as client:
        text = (await client.get("/metrics")).text
        assert "vllm:num_requests_running" in text and "ovrouter_" not in text


def answer(words: list[str], stream: bool) -> FakeReply:
    """A chat answer of ``words`` (one token each) with its usage, as the fake engine sends it."""
    usage = {"prompt_tokens": 7, "completion_tokens": len(words), "total_tokens": 7 + len(words)}
    if not stream:
        return FakeReply.json(200, {"id": "c", "object": "chat.completion", "model": "m", "usage": usage,
                                    "choices": [{"index": 0, "message": {"role": "assistant",
                                                                        "content": " ".join(words)},
                                                 "finish_reason": "stop"}]})
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    events = [{**chunk, "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]} for w in words]
    events.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    events.append({**chunk, "choices": [], "usage": usage})
    compact = [json.dumps(e, separators=(",", ":")).encode() for e in events]  # as the model server writes them
    return FakeReply(chunks=[b"data: " + e + b"\n\n" for e in compact] + [b"data: [DONE]\n\n"], content_type=SSE)


async def test_vllm_names_are_added_on_request_and_equal_the_routers_own(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"m": model()}, router={"metrics_names": ["ovrouter", "vllm"]}) as r, \
            r.client() as client:
        async def fake_engine(call: Call) -> FakeReply:
            return answer(["one", "two", "three", "four", "five"], json.loads(call.body).get("stream", False))

        r.upstream.handler = fake_engine
        plain = await client.post("/v1/chat/completions", json=chat("m"))
        assert plain.status_code == 200
        streamed = await r.post("/v1/chat/completions", chat("m", stream=True, stream_options={"include_usage": True}))
        assert streamed.status == 200 and streamed.body.endswith(b"data: [DONE]\n\n")
        text = (await client.get("/metrics")).text
        families = {family.name: family for family in text_string_to_metric_families(text)}
        assert set(VLLM_NAMES) <= set(families), sorted(set(VLLM_NAMES) - set(families))
        samples = _samples(text)
        for name in VLLM_NAMES:
            if name != "vllm:kv_cache_usage_perc":  # the fake engine reports no KV cache
                assert (_vllm_sample(name), (("model_name", "m"),)) in samples, name
        pairs = [("vllm:time_to_first_token_seconds_count", "ovrouter_time_to_first_token_seconds_count"),
                 ("vllm:e2e_request_latency_seconds_sum", "ovrouter_request_duration_seconds_sum"),
                 ("vllm:generation_tokens_total", "ovrouter_completion_tokens_total"),
                 ("vllm:prompt_tokens_total", "ovrouter_prompt_tokens_total")]
        for vllm, ours in pairs:
            assert _value(samples, vllm, model_name="m") == _value(samples, ours, model="m") > 0, vllm
        assert _value(samples, "vllm:request_success_total", model_name="m") == 2
        assert families["vllm:e2e_request_latency_seconds"].type == "histogram"


class Stall(asyncio.Event):
    """A stream item that is never set: ``reached`` tells the chunks before it were relayed."""

    def __init__(self) -> None:
        super().__init__()
        self.reached = asyncio.Event()

    async def wait(self) -> Any:
        self.reached.set()
        return await super().wait()


async def test_an_operator_cancels_a_request_in_flight(tmp_path: Path) -> None:
    stalls = {"model": "m", "messages": [{"role": "user", "content": "one two [[stall]] three"}], "stream": True}
    async with fake_router(tmp_path, {"m": model()}) as r, r.client() as client:
        stall = Stall()

        async def stalling(call: Call) -> FakeReply:  # ends by a cancel only
            return FakeReply(chunks=[b'data: {"choices":[{"index":0,"delta":{"content":"one"}}]}\n\n', stall],
                             content_type=SSE)

        r.upstream.handler = stalling
        assert (await client.post("/api/models/m/load")).status_code == 200
        stream = asyncio.ensure_future(r.post("/v1/chat/completions", stalls))
        await asyncio.wait_for(stall.reached.wait(), 10)  # the stream is under way
        running = [row for row in (await client.get("/api/requests")).json()["requests"]
                   if row["state"] == "running" and row["path"] == "/v1/chat/completions"]
        assert len(running) == 1
        cancelled = await client.post(f"/api/requests/{running[0]['id']}/cancel")
        assert cancelled.status_code == 200
        reply = await asyncio.wait_for(stream, 10)
        first, *rest = reply.body.decode().splitlines()
        assert first.startswith("data: ")
        errors = [json.loads(line[6:])["error"] for line in rest if line.startswith("data: {\"error\"")]
        assert errors and errors[0]["code"] == "request_cancelled"
        rows = (await client.get("/api/requests")).json()["requests"]
        assert rows[0]["state"] == "cancelled"
        assert (await client.post(f"/api/requests/{running[0]['id']}/cancel")).status_code == 404
        async with asyncio.timeout(10):
            while r.backend("m").in_flight:
                await asyncio.sleep(0.02)


def events_of(exchange: Exchange) -> list[tuple[str, dict[str, Any]]]:
    """The (event, data) pairs of an SSE body so far."""
    seen, kind = [], None
    for line in exchange.body.decode().splitlines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: ") and kind:
            seen.append((kind, json.loads(line[6:])))
    return seen


async def until(predicate: Any, what: str) -> None:
    try:
        async with asyncio.timeout(10):
            while not predicate():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def test_api_events_streams_state_changes_and_finished_requests(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"m": model()}) as r, r.client() as client:
        listening, hang_up = Exchange(), asyncio.Event()
        task = asyncio.ensure_future(r.request("GET", "/api/events", disconnect=hang_up, into=listening))
        await until(lambda: any(kind == "snapshot" for kind, _ in events_of(listening)), "the snapshot")
        assert (await client.post("/v1/chat/completions", json=chat("m"))).status_code == 200
        await until(lambda: any(k == "request" and d["state"] == "done" for k, d in events_of(listening)), "done")
        hang_up.set()
        await asyncio.wait_for(task, 10)
        seen = events_of(listening)
        states = [d["state"] for k, d in seen if k == "state" and d["model"] == "m"]
        assert states[:2] == ["starting", "ready"]
        finished = [d for k, d in seen if k == "request" and d["state"] == "done"]
        assert finished[0]["model"] == "m" and finished[0]["status"] == 200


async def test_event_and_log_streams_end_when_the_server_shuts_down(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"m": model()}) as r, r.client() as client:
        r.harness.spawner.on_spawn = lambda proc: proc.say("INFO: model m loaded")
        assert (await client.post("/api/models/m/load")).status_code == 200
        events, logs = Exchange(), Exchange()
        streams = [asyncio.ensure_future(r.request("GET", "/api/events", into=events)),
                   asyncio.ensure_future(r.request("GET", "/api/models/m/logs?follow=1", into=logs))]
        await until(lambda: events.body.startswith(b"event: snapshot\n"), "the snapshot")
        await until(lambda: b"\n" in logs.body, "the log so far")
        assert logs.body.split(b"\n")[0]
        r.service.console.close_streams()  # what uvicorn's SIGINT/SIGTERM handler now also does
        await asyncio.wait_for(asyncio.gather(*streams), 10)  # both streams end: the server need not wait on them
