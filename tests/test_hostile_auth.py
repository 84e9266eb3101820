"""Keys on EVERY route: with ``router.api_keys`` / ``admin_keys`` set, each route of the router (read from the
app, so a route added later is covered without a test edit) refuses a request without its key with a 401 in
its protocol's error shape, takes the key the ways OpenAI's, Anthropic's and Ollama's clients send it, and
never repeats a key; the same for a model server given a bearer token (every route of every task).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from modelserver_helpers import modelserver

from modelserver.app import build_app as modelserver_app
from modelserver.engines import make_engine
from modelserver.spec import build_model_spec
from router.app import build_app
from router.config import ConfigError, parse_config
from tests.hostile_corpus import Answer, Case, Target, fault, send, targets
from tests.router_fakes import fake_router

pytestmark = pytest.mark.timeout(120)

MODELS = {name: {"engine": "fake", "loading_progress": "off", "idle_timeout_s": 0} for name in ("tiny", "other")}
USER, ADMIN = "sk-user-0123456789", "sk-admin-9876543210"
KEYS = {"api_keys": [USER], "admin_keys": [ADMIN]}
TARGETS = targets(build_app(parse_config({"models": MODELS}, Path("."))), "tiny", "other")

#: The routes that need no key, and why: a liveness probe, the dashboard's static files (it asks for the admin
#: key itself and holds no data), Ollama's root ("Ollama is running", what apps probe before they send a key), and
#: the 404 of a path that is not Ollama's API (as for any unknown path).
OPEN = {"/health", "/ui", "/ui/", "/ui/{file}", "/ollama", "/ollama/", "/ollama/{rest:path}"}
#: The routes that take the admin keys (the rest take the API keys).
ADMIN_ROUTES = ("/api/", "/metrics", "/models")


def _key_for(target: Target) -> str:
    return ADMIN if target.template.startswith(ADMIN_ROUTES) else USER


BODY = Case("a-model", b'{"model": "tiny"}')


async def _ask(app: Any, target: Target, headers: dict[str, str]) -> Answer:
    """``target`` with a small JSON body and ``headers``; a stream is hung up on once its head arrived."""
    return await send(app, target, BODY, list(headers.items()))


def _refusal_fault(target: Target, answer: Answer, *keys: str) -> str | None:
    """What is wrong with ``answer`` as a 401 (status, the path's error shape, a key repeated)."""
    text = answer.body.decode(errors="replace")
    if answer.status != 401:
        return f"{answer.status} {text[:100]}"
    problem = fault(answer.status, answer.headers.get("content-type", ""), answer.body, target.path)
    if problem is None and any(key in text for key in keys):
        problem = f"a key repeated: {text[:200]}"
    if problem is None and answer.headers.get("www-authenticate") is None:
        problem = "no WWW-Authenticate"
    return problem


async def test_every_route_but_the_open_ones_refuses_a_request_without_its_key_in_its_protocols_shape(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    assert OPEN <= {t.template for t in TARGETS}, "an open route is gone: update OPEN"
    async with fake_router(tmp_path, MODELS, router=KEYS) as router:
        faults = []
        for target in TARGETS:
            if target.template in OPEN:
                continue
            right = _key_for(target)
            wrong = USER if right == ADMIN else ADMIN  # the other kind of key is no key here
            for headers in ({}, {"Authorization": f"Bearer {wrong}"}, {"x-api-key": wrong},
                            {"Authorization": "Basic " + right}, {"Authorization": right}):
                answer = await _ask(router.app, target, headers)
                if (problem := _refusal_fault(target, answer, right, wrong)) is not None:
                    faults.append(f"{target!r} {list(headers)}: {problem}")
        assert not faults, "\n".join(faults)
        for target in (t for t in TARGETS if t.template in OPEN):
            assert (await _ask(router.app, target, {})).status != 401, target
    assert not [r for r in caplog.records if USER in r.getMessage() or ADMIN in r.getMessage()]


@pytest.mark.parametrize("headers", [
    {"Authorization": "Bearer {key}"},  # OpenAI's SDKs, the ollama client's headers=, curl
    {"Authorization": "bearer  {key} "},  # the scheme is case-insensitive (RFC 9110), spaces around are not the key
    {"x-api-key": "{key}"},  # Anthropic's SDKs and Claude Code
    {"Authorization": "Bearer placeholder", "x-api-key": "{key}"},  # a client that sends both: one is enough
    {"Authorization": "Bearer {key}", "x-api-key": "placeholder"},
], ids=["bearer", "lower-case-bearer", "x-api-key", "placeholder-bearer-and-x-api-key", "bearer-and-placeholder"])
async def test_every_keyed_route_takes_its_key_as_each_client_sends_it(tmp_path: Path, headers: dict[str, str]) -> None:
    async with fake_router(tmp_path, MODELS, router=KEYS) as router:
        refused = []
        for target in TARGETS:
            sent = {name: value.format(key=_key_for(target)) for name, value in headers.items()}
            answer = await _ask(router.app, target, sent)
            if answer.status == 401:
                refused.append(f"{target!r}: {answer.body[:150]!r}")
        assert not refused, "\n".join(refused)


@pytest.mark.parametrize(("keys", "says"), [
    ([""], "an empty key"),  # an unset variable templated into the file: it let a request with no key through
    (["sk-ok", " "], "an empty key"),
    (["sk with space"], "spaces"),
    ("sk-a-string-not-a-list", "expected a list"),
])
def test_a_key_no_client_can_send_is_a_config_error_that_never_repeats_a_key(keys: object, says: str) -> None:
    for field in ("api_keys", "admin_keys"):
        with pytest.raises(ConfigError) as caught:
            parse_config({"router": {field: keys}, "models": MODELS}, Path("."))
        text = str(caught.value)
        assert f"router.{field}" in text and says in text, text
        assert "sk-" not in text, text


TASKS = ("llm", "embeddings", "rerank", "transcription", "speech", "vlm")


@pytest.mark.parametrize("task", TASKS)
async def test_a_model_server_with_a_token_refuses_every_route_without_it_in_its_protocols_shape(task: str) -> None:
    spec = build_model_spec("tiny", {"engine": "fake", "task": task, "fake": {"token_delay_s": 0, "load_s": 0}})
    token = "tok-0123456789"
    app = modelserver_app(spec, make_engine(spec), token=token)
    faults = []
    for target in targets(app, "tiny", "tiny"):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"x-api-key": "nope"}, {"Authorization": token}):
            if (problem := _refusal_fault(target, await _ask(app, target, headers), token)) is not None:
                faults.append(f"{target!r} {list(headers)}: {problem}")
        for headers in ({"Authorization": f"Bearer {token}"}, {"Authorization": f"bearer {token}"},
                        {"x-api-key": token}):
            if (await _ask(app, target, headers)).status == 401:
                faults.append(f"{target!r} {list(headers)}: refused")
    assert not faults, "\n".join(faults)


def _raw_exchange(base_url: str, request: bytes, timeout_s: float) -> tuple[bytes, dict[str, Any]]:
    """``request`` sent from a thread (the server may answer and close before it is all sent); the answer's
    head and its JSON body."""
    host, _, port = base_url.removeprefix("http://").partition(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        def send() -> None:
            with contextlib.suppress(OSError):
                sock.sendall(request)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        reply = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                reply += chunk
        sender.join(timeout_s)
    head, _, body = reply.partition(b"\r\n\r\n")
    return head, json.loads(body)


def test_a_model_server_reached_directly_answers_in_json_with_its_token_or_a_malformed_request() -> None:
    token = "tok-direct-0123456789"
    key = {"x-api-key": token}
    with modelserver("--engine", "fake", env={"OVROUTER_MODEL_TOKEN": token}, wait=False) as server, \
            server.client(timeout_s=60) as client:
        deadline = time.monotonic() + 60
        while server.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if client.get("/health", headers=key).status_code == 200:
                    break
            time.sleep(0.05)
        refused = client.get("/health")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_token", refused.text
        assert token not in refused.text
        many = b"".join(b"x-h%d: v\r\n" % i for i in range(10_000))
        for request, status, says in [  # uvicorn answered the first two in plain text, and the others 401
            (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400, "well-formed"),
            (b"GARBAGE\x00 / HTTP/1.1\r\n\r\n", 400, "well-formed"),
            (b"GET /health HTTP/1.1\r\nHost: x\r\nx-big: " + b"v" * (8 << 20) + b"\r\n\r\n", 431, "larger than"),
            (b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n", 431, "more than 100 headers"),
        ]:
            head, error = _raw_exchange(server.base_url, request, 60)
            assert head.startswith(b"HTTP/1.1 %d" % status) and b"content-type: application/json" in head, head
            assert says in error["error"]["message"], error
        chat = {"messages": [{"role": "user", "content": "still here"}]}
        assert client.post("/v1/chat/completions", json=chat, headers=key).status_code == 200
        message = client.post("/v1/messages", json={**chat, "max_tokens": 4}, headers=key)
        assert message.status_code == 200 and message.json()["type"] == "message", message.text
