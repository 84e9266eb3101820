"""The cold-start marks a model server shows in ``/health`` (what the bench's breakdown is built from)."""

from __future__ import annotations

import sys

import pytest
from modelserver_helpers import modelserver

ORDER = ("process", "interpreter", "imports", "load_start", "loaded", "first_request")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process start time comes from /proc")
def test_health_shows_the_start_marks_in_order() -> None:
    with modelserver("--engine", "fake", "--task", "llm") as server, server.client() as client:
        before = server.health().json()["startup"]
        assert "first_request" not in before
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        marks = server.health().json()["startup"]
    times = [marks[name] for name in ORDER]
    assert times == sorted(times), marks
    assert marks["loaded"] - marks["process"] < 60
    assert "engine_load_s" in marks  # the OpenVINO engines report their pipeline construction time there
