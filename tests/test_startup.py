"""The cold-start marks a model server shows in ``/health`` (what the bench's breakdown is built from)."""

from __future__ import annotations

import os
import sys

import pytest
from modelserver_helpers import modelserver

from modelserver import startup
from procman import process

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


@pytest.mark.parametrize("order", [("loaded", "listening"), ("listening", "loaded")])
def test_readiness_is_announced_once_after_both_halves(
    order: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    readiness = startup.Readiness("t0k3n")
    getattr(readiness, order[0])()
    assert capsys.readouterr().out == ""
    getattr(readiness, order[1])()
    getattr(readiness, order[1])()
    readiness.loaded()
    assert capsys.readouterr().out == startup.READY_PREFIX + "t0k3n\n"


def test_readiness_without_a_token_prints_nothing_and_the_token_leaves_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    silent = startup.Readiness(None)
    silent.loaded()
    silent.listening()
    assert capsys.readouterr().out == ""
    monkeypatch.setenv(startup.READY_ENV, "abc")
    readiness = startup.Readiness.from_env()
    assert startup.READY_ENV not in os.environ
    readiness.loaded()
    readiness.listening()
    assert capsys.readouterr().out == startup.READY_PREFIX + "abc\n"


def test_the_model_server_and_procman_agree_on_the_readiness_line() -> None:
    assert (startup.READY_ENV, startup.READY_PREFIX) == (process.READY_ENV, process.READY_PREFIX)
