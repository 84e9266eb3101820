"""CORS (``router.cors_origins``): loopback pages allowed by default, preflights answered for ``/v1``,
``/models`` and ``/upstream`` without an API key, the allow-origin header on proxied and streamed
answers, a list that replaces the default (``[]`` for none, ``"*"``), and the config check, in-process
(the real app over fakes: tests/router_fakes.py); a reload that changes it, through a real router."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from router.config import ConfigError, load_config
from tests.openai_schema import check
from tests.router_fakes import Call, FakeReply, echo, fake_router
from tests.router_helpers import fake_model, running_router, write_config

pytestmark = pytest.mark.timeout(120)

SITE = "http://localhost:3000"
PREFLIGHT = {"origin": SITE, "access-control-request-method": "POST",
             "access-control-request-headers": "authorization,content-type,x-stainless-os"}
CHAT = {"model": "echo", "messages": [{"role": "user", "content": "a b c"}]}


def model() -> dict[str, object]:
    return {"engine": "fake", "loading_progress": "off"}


async def streams(call: Call) -> FakeReply:
    """A chat stream for ``"stream": true``, else the echo."""
    if json.loads(call.body).get("stream"):
        return FakeReply(chunks=[b'data: {"choices":[]}\n\n', b"data: [DONE]\n\n"], content_type=b"text/event-stream")
    return await echo(call)


async def test_pages_on_this_machine_are_allowed_by_default_and_others_refused(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}) as r, r.client() as client:
        for origin in (SITE, "http://127.0.0.1:5173", "http://[::1]:8000", "http://localhost"):
            preflight = await client.options("/v1/chat/completions", headers={**PREFLIGHT, "origin": origin})
            assert preflight.status_code == 200, (origin, preflight.text)
            assert preflight.headers["access-control-allow-origin"] == origin
        listed = await client.get("/v1/models", headers={"origin": SITE})
        assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == SITE
        for origin in ("http://evil.example", "http://localhost.evil.example:3000", "http://127.0.0.1.nip.io"):
            refused = await client.options("/v1/chat/completions", headers={**PREFLIGHT, "origin": origin})
            assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers, origin
            assert "router.cors_origins" in refused.json()["error"]["message"]
            plain = await client.get("/v1/models", headers={"origin": origin})
            assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


async def test_an_empty_list_turns_cors_off(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}, router={"cors_origins": []}) as r, r.client() as client:
        preflight = await client.options("/v1/chat/completions", headers=PREFLIGHT)
        assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers
        check(preflight.json(), "ErrorResponse")
        listed = await client.get("/v1/models", headers={"origin": SITE})
        assert listed.status_code == 200 and "access-control-allow-origin" not in listed.headers


async def test_preflights_and_answers_carry_cors_for_the_allowed_origin(tmp_path: Path) -> None:
    settings = {"cors_origins": [SITE], "api_keys": ["k"]}
    async with fake_router(tmp_path, {"echo": model()}, router=settings) as r, r.client("k") as client, \
            r.client() as bare:
        r.upstream.handler = streams
        for url in ("/v1/chat/completions", "/v1/models", "/models/load", "/models/sse", "/upstream/echo/health"):
            preflight = await bare.options(url, headers=PREFLIGHT)  # a browser sends no key with a preflight
            assert preflight.status_code == 200, (url, preflight.text)
            assert preflight.headers["access-control-allow-origin"] == SITE
            assert "POST" in preflight.headers["access-control-allow-methods"]
            assert preflight.headers["access-control-allow-headers"] == PREFLIGHT["access-control-request-headers"]
        reply = await client.post("/v1/chat/completions", json=CHAT, headers={"origin": SITE})
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == SITE
        assert "retry-after" in reply.headers["access-control-expose-headers"].lower()
        async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                                 headers={"origin": SITE}) as stream:
            assert stream.headers["access-control-allow-origin"] == SITE
            assert b"[DONE]" in b"".join([chunk async for chunk in stream.aiter_bytes()])
        refused = await bare.get("/v1/models", headers={"origin": SITE})  # no key: 401, still readable by the page
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == SITE
        operator = await bare.options("/api/models", headers=PREFLIGHT)  # /api is not for browsers elsewhere
        assert "access-control-allow-origin" not in operator.headers


async def test_a_list_replaces_the_default_and_refuses_another_origin_with_an_openai_error(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"echo": model()}, router={"cors_origins": [SITE]}) as r, r.client() as client:
        loopback = await client.options("/v1/models", headers={**PREFLIGHT, "origin": "http://127.0.0.1:8000"})
        assert loopback.status_code == 400, "a listed origin replaces the loopback default"
        refused = await client.options("/v1/chat/completions", headers={**PREFLIGHT, "origin": "http://evil.example"})
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        check(refused.json(), "ErrorResponse")
        assert "router.cors_origins" in refused.json()["error"]["message"]
        plain = await client.get("/v1/models", headers={"origin": "http://evil.example"})
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


async def test_star_allows_any_origin_and_a_reload_changes_the_setting(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"echo": fake_model()}, router={"cors_origins": ["*"]})
    async with running_router(path) as router:
        anywhere = await router.client.options("/v1/embeddings", headers={**PREFLIGHT, "origin": "http://a.example"})
        assert anywhere.status_code == 200 and anywhere.headers["access-control-allow-origin"] == "*"
        data = yaml.safe_load(path.read_text())
        data["router"]["cors_origins"] = []
        path.write_text(yaml.safe_dump(data))
        assert (await router.client.post("/api/reload")).json()["ok"] is True
        after = await router.client.get("/v1/models", headers={"origin": "http://a.example"})
        assert "access-control-allow-origin" not in after.headers


def test_an_origin_with_a_path_is_a_config_error(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"echo": fake_model()}, router={"cors_origins": ["localhost:3000/app"]})
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert any("router.cors_origins" in line and "localhost:3000/app" in line for line in caught.value.errors)
