"""The hostile corpus (tests/hostile_corpus.py) against EVERY route of the router, in-process over the fake
upstream, and of the model server for every task on its fake engine: each answer is a 4xx JSON error (or a
2xx where the body is valid), nothing is logged with a traceback, and the model process the requests name is
the same one afterwards (for the model server: its runtime is still ready, not failed).

The routes are read from the apps, so a route added later is covered without editing this file.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from modelserver.app import build_app as modelserver_app
from modelserver.engines import make_engine
from modelserver.spec import build_model_spec
from router.app import build_app
from router.config import parse_config
from tests.hostile_corpus import Case, Target, corpus, fault, targets
from tests.router_fakes import fake_router

pytestmark = pytest.mark.timeout(120)

MIB = 1024 * 1024
MODELS = {name: {"engine": "fake", "loading_progress": "off", "max_request_mb": 1, "idle_timeout_s": 0}
          for name in ("tiny", "other")}
TARGETS = targets(build_app(parse_config({"models": MODELS}, Path("."))), "tiny", "other")


@dataclass
class Answer:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


async def send(app: Any, target: Target, case: Case) -> Answer:
    """``case`` to ``target`` through the ASGI app; a stream is hung up on once its head arrived."""
    pieces = [case.body[i * len(case.body) // case.pieces:(i + 1) * len(case.body) // case.pieces]
              for i in range(case.pieces)]
    headers = [(b"content-type", case.content_type.encode("latin-1"))]
    if case.pieces == 1 or case.declared is not None:
        declared = case.declared if case.declared is not None else len(case.body)
        headers.append((b"content-length", str(declared).encode()))
    else:
        headers.append((b"transfer-encoding", b"chunked"))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": target.method,
             "scheme": "http", "path": target.path, "raw_path": target.path.encode(), "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 40000), "server": ("testserver", 80)}
    gone, answer = asyncio.Event(), Answer()

    async def receive() -> dict[str, Any]:
        if pieces and not (case.cut and len(pieces) == 1):
            piece = pieces.pop(0)
            return {"type": "http.request", "body": piece, "more_body": bool(pieces)}
        if case.cut:
            gone.set()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def reply(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
            if answer.headers.get("content-type", "").startswith("text/event-stream"):
                gone.set()  # an endless stream: the client hangs up
        elif message["type"] == "http.response.body":
            answer.body += message.get("body", b"")

    await asyncio.wait_for(app(scope, receive, reply), 30)
    return answer


@pytest.mark.parametrize("target", TARGETS, ids=repr)
async def test_every_route_answers_the_hostile_corpus_with_a_4xx_json_error_or_a_2xx(
        tmp_path: Path, target: Target, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    async with fake_router(tmp_path, MODELS) as router:
        await router.service.registry.models["tiny"].backend.ensure_ready()
        tiny_pid = router.backend("tiny").pid
        cases = corpus("other" if target.acts else "tiny", 2 * MIB)
        faults = []
        for case in cases:
            answer = await send(router.app, target, case)
            if case.cut and answer.status == 0:
                continue  # nobody left to answer
            content_type = answer.headers.get("content-type", "")
            if (problem := fault(answer.status, content_type, answer.body, target.path)) is not None:
                faults.append(f"{case.name}: {problem}")
        assert not faults, f"{target!r}:\n" + "\n".join(faults)
        assert router.backend("tiny").pid == tiny_pid and router.backend("tiny").restarts == 0
    logged = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not logged, "\n".join(f"{r.name}: {r.getMessage()}" for r in logged)


TASKS = ("llm", "embeddings", "rerank", "transcription", "speech", "vlm")


@pytest.mark.parametrize("task", TASKS)
async def test_every_model_server_route_answers_the_hostile_corpus_with_a_4xx_json_error_or_a_2xx(
        task: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    spec = build_model_spec("tiny", {"engine": "fake", "task": task, "max_request_mb": 1,
                                     "fake": {"token_delay_s": 0, "load_s": 0}})
    app = modelserver_app(spec, make_engine(spec))
    faults = []
    for target in targets(app, "tiny", "tiny"):
        for case in corpus("tiny", 2 * MIB):
            answer = await send(app, target, case)
            if case.cut and answer.status == 0:
                continue
            content_type = answer.headers.get("content-type", "")
            if (problem := fault(answer.status, content_type, answer.body, target.path)) is not None:
                faults.append(f"{target!r} {case.name}: {problem}")
    assert not faults, "\n".join(faults)
    assert app.state.runtime.status == "ready"
    logged = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not logged, "\n".join(f"{r.name}: {r.getMessage()}" for r in logged)
