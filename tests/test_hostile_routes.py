"""The hostile corpus (tests/hostile_corpus.py) against EVERY route of the router, in-process over the fake
upstream, and of the model server for every task on its fake engine: each answer is a 4xx JSON error (or a
2xx where the body is valid), nothing is logged with a traceback, and the model process the requests name is
the same one afterwards (for the model server: its runtime is still ready, not failed).

The routes are read from the apps, so a route added later is covered without editing this file.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from modelserver.app import build_app as modelserver_app
from modelserver.engines import make_engine
from modelserver.spec import build_model_spec
from router.app import build_app
from router.config import parse_config
from tests.hostile_corpus import Case, Target, corpus, fault, send, strangers, targets
from tests.router_fakes import fake_router

pytestmark = pytest.mark.timeout(120)

MIB = 1024 * 1024
MODELS = {name: {"engine": "fake", "loading_progress": "off", "max_request_mb": 1, "idle_timeout_s": 0}
          for name in ("tiny", "other")}
TARGETS = targets(build_app(parse_config({"models": MODELS}, Path("."))), "tiny", "other")


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


def _refused_method_fault(target: Target, status: int, headers: dict[str, str], body: bytes) -> str | None:
    """A method a route does not take: 405 naming the ones it does (404 where a catch-all route holds the path),
    in the error shape of the path's protocol."""
    if status not in (404, 405):
        return f"{status}: {body[:150]!r}"
    if status == 405 and not headers.get("allow"):
        return "405 without Allow"
    return fault(status, headers.get("content-type", ""), body, target.path)


async def test_every_route_answers_a_method_it_does_not_take_with_a_405_in_its_protocols_shape(
        tmp_path: Path) -> None:
    # Anthropic's and Ollama's clients got OpenAI's error object for a 405 (and the model server's 404s and 401s)
    body = Case("a-model", b'{"model": "tiny"}')
    async with fake_router(tmp_path, MODELS) as router:
        faults = []
        for target in strangers(router.app, "tiny", "other"):
            answer = await send(router.app, target, body)
            if (problem := _refused_method_fault(target, answer.status, answer.headers, answer.body)) is not None:
                faults.append(f"{target!r}: {problem}")
        for task in TASKS:
            spec = build_model_spec("tiny", {"engine": "fake", "task": task, "fake": {"token_delay_s": 0}})
            app = modelserver_app(spec, make_engine(spec))
            for target in strangers(app, "tiny", "tiny"):
                answer = await send(app, target, body)
                if (problem := _refused_method_fault(target, answer.status, answer.headers, answer.body)) is not None:
                    faults.append(f"{task}: {target!r}: {problem}")
    assert not faults, "\n".join(faults)


@pytest.mark.parametrize("raw", ["9" * 5000, "%C2%B2", "-1", "1e3"])  # int() refused the first two with a 500
async def test_a_request_id_that_is_no_small_number_is_a_400_naming_it(tmp_path: Path, raw: str) -> None:
    async with fake_router(tmp_path, MODELS) as router, router.client() as client:
        answer = await client.post(f"/api/requests/{raw}/cancel")
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "id", answer.text
        assert "GET /api/requests" in answer.json()["error"]["message"]
