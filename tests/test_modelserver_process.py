"""``python -m modelserver`` as a real process with the fake engine: CLI forms, faults, exits, disconnects."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from modelserver_helpers import ModelServerProcess, modelserver, spawn_modelserver

from modelserver.cli import EXIT_FATAL
from modelserver.engines.fake import ABORT_EXIT_CODE, CRASH_EXIT_CODE
from modelserver.errors import FATAL_HEADER
from modelserver.spec import ModelSpec, build_model_spec


def fake_spec(name: str = "tiny-fake", **fake: float | str) -> ModelSpec:
    return build_model_spec(name, {"engine": "fake", "fake": {"load_s": 0, "token_delay_s": 0.01, **fake}})


def chat(content: str, **params: object) -> dict[str, object]:
    return {"model": "tiny-fake", "messages": [{"role": "user", "content": content}], **params}


def wait_for(predicate: object, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


@pytest.fixture(scope="module")
def shared() -> Iterator[ModelServerProcess]:
    """One fake server for the tests that leave it healthy."""
    with modelserver(spec=fake_spec(token_delay_s=0.05)) as server:
        yield server


def test_openai_sdk_chat_and_stream(shared: ModelServerProcess) -> None:
    with openai.OpenAI(base_url=shared.base_url + "/v1", api_key="unused", max_retries=0) as client:
        answer = client.chat.completions.create(model="tiny-fake", messages=[{"role": "user", "content": "hi there"}])
        assert answer.choices[0].message.content == "hi there"
        assert answer.usage is not None and answer.usage.completion_tokens == 2
        chunks = list(
            client.chat.completions.create(
                model="tiny-fake",
                messages=[{"role": "user", "content": "one two three"}],
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "one two three"
        assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 6
        completion = client.completions.create(model="tiny-fake", prompt="a b c", max_tokens=2)
        assert (completion.choices[0].text, completion.choices[0].finish_reason) == ("a b", "length")


def test_streamed_words_arrive_one_by_one(shared: ModelServerProcess) -> None:
    with (
        shared.client() as client,
        client.stream("POST", "/v1/chat/completions", json=chat("w1 w2 w3 w4", stream=True)) as r,
    ):
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    contents = [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert contents == ["", "w1", " w2", " w3", " w4", None]
    assert events[-1] == "data: [DONE]"


def test_413_over_the_wire_with_and_without_content_length(tmp_path: Path) -> None:
    spec = fake_spec().model_copy(update={"max_request_mb": 0.5})
    big = json.dumps(chat("x " * 400_000)).encode()
    with modelserver(spec=spec) as server, server.client() as client:
        response = client.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
        assert response.status_code == 413
        assert "0.5 MiB" in response.json()["error"]["message"]
        chunked = client.post(
            "/v1/chat/completions", content=iter([big[i : i + 65536] for i in range(0, len(big), 65536)])
        )
        assert chunked.status_code == 413
        assert "0.5 MiB" in chunked.json()["error"]["message"]
        assert client.post("/v1/chat/completions", json=chat("small")).status_code == 200


def test_disconnect_mid_stream_cancels_the_generation(shared: ModelServerProcess) -> None:
    words = " ".join(f"w{i}" for i in range(400))  # 20 s at 0.05 s per word
    before = shared.health().json()["cancelled"]
    received = 0
    with shared.client() as client, client.stream("POST", "/v1/chat/completions", json=chat(words, stream=True)) as r:
        for line in r.iter_lines():
            received += line.startswith("data: ")
            if received == 3:
                break  # leaving the block closes the connection mid-stream
    assert received == 3
    wait_for(lambda: shared.health().json()["cancelled"] == before + 1)
    assert shared.health().json()["running"] == 0


def test_disconnect_before_a_non_streamed_answer_cancels_it(shared: ModelServerProcess) -> None:
    words = " ".join(f"w{i}" for i in range(400))  # 20 s at 0.05 s per word
    before = shared.health().json()["cancelled"]
    body = json.dumps(chat(words)).encode()
    head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: "
    head += str(len(body))
    host, port = shared.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        wait_for(lambda: shared.health().json()["running"] == 1)  # hang up once it generates, not before
    wait_for(lambda: shared.health().json()["cancelled"] == before + 1)
    assert shared.health().json()["running"] == 0


def test_health_is_503_loading_until_the_fake_load_is_done() -> None:
    with modelserver(spec=fake_spec(load_s=3), wait=False) as server:  # a window a busy poller cannot miss
        seen: set[str] = set()

        def ready() -> bool:
            try:
                response = server.health()
            except httpx.TransportError:
                return False
            seen.add(f"{response.status_code} {response.json()['status']}")
            return response.status_code == 200

        wait_for(ready, timeout_s=60)
        assert seen >= {"503 loading", "200 ready"}


def test_failed_load_logs_the_reason_and_exits_non_zero_promptly() -> None:
    server = spawn_modelserver(spec=fake_spec(fail_load="weights are corrupt"))
    try:
        assert server.wait_exit(timeout_s=30) == 1
        assert "failed to load tiny-fake: weights are corrupt" in server.log_text()
    finally:
        server.stop()


def test_crash_marker_exits_the_process_at_once(tmp_path: Path) -> None:
    with modelserver(spec=fake_spec()) as server, server.client() as client:
        with pytest.raises(httpx.TransportError):
            client.post("/v1/chat/completions", json=chat("bye [[crash]]"))
        assert server.wait_exit(timeout_s=30) == CRASH_EXIT_CODE


def test_hang_marker_blocks_requests_and_health() -> None:
    with modelserver(spec=fake_spec(), stop_timeout_s=1) as server, server.client(timeout_s=1) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json=chat("wait [[hang]]"))
        with pytest.raises(httpx.ReadTimeout):
            server.health(timeout_s=1)
        assert server.proc.poll() is None  # alive, but answers nothing: the router must kill it


def test_fatal_marker_over_the_wire_answers_then_the_process_exits_at_once() -> None:
    with modelserver(spec=fake_spec(), uds=True) as server, server.client() as client:
        response = client.post("/v1/chat/completions", json=chat("[[fatal]]"))
        assert response.status_code == 500
        assert response.headers[FATAL_HEADER] == "1"
        assert "CL_OUT_OF_RESOURCES" in response.json()["error"]["message"]
        assert server.wait_exit(timeout_s=30) == EXIT_FATAL  # never touches the device again
        assert "exiting after a fatal engine error" in server.log_text()


def test_second_suspect_error_within_a_minute_answers_fatal_and_exits() -> None:
    with modelserver(spec=fake_spec(), uds=True) as server, server.client() as client:
        first = client.post("/v1/chat/completions", json=chat("[[suspect]]"))
        assert first.status_code == 500 and FATAL_HEADER not in first.headers
        assert first.json()["error"]["code"] == "engine_suspect"
        assert client.get("/health").status_code == 200
        second = client.post("/v1/chat/completions", json=chat("again [[suspect]]"))
        assert second.status_code == 500 and second.headers[FATAL_HEADER] == "1"
        assert "CL_MEM_OBJECT_ALLOCATION_FAILURE" in second.json()["error"]["message"]
        assert server.wait_exit(timeout_s=30) == EXIT_FATAL


def test_abort_marker_prints_a_fatal_line_and_exits_non_zero() -> None:
    with modelserver(spec=fake_spec()) as server, server.client() as client:
        with pytest.raises(httpx.TransportError):
            client.post("/v1/chat/completions", json=chat("[[abort]]"))
        assert server.wait_exit(timeout_s=30) == ABORT_EXIT_CODE
        assert "GPU plugin can't finish correctly" in server.log_text()


def test_sigterm_shuts_down_gracefully() -> None:
    with modelserver(spec=fake_spec()) as server:
        os.killpg(server.pid, signal.SIGTERM)
        # uvicorn re-raises the signal after its graceful shutdown, so the parent sees "killed by SIGTERM"
        assert server.wait_exit(timeout_s=30) == -signal.SIGTERM
        assert "Application shutdown complete" in server.log_text()


def test_sigterm_during_a_long_stream_still_exits_promptly() -> None:
    with modelserver(spec=fake_spec(token_delay_s=0.05)) as server, server.client() as client:
        words = " ".join(f"w{i}" for i in range(1000))  # 50 s of stream
        with client.stream("POST", "/v1/chat/completions", json=chat(words, stream=True)) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            os.killpg(server.pid, signal.SIGTERM)
            received = 0
            with contextlib.suppress(httpx.TransportError):  # the stream is cut after the grace period
                for _ in lines:
                    received += 1
        assert server.wait_exit(timeout_s=60) == -signal.SIGTERM
        assert received < 1000
        assert "timeout graceful shutdown exceeded" in server.log_text()


def test_config_file_form_on_a_unix_socket(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("models:\n  tiny:\n    engine: fake\n    fake: {load_s: 0, token_delay_s: 0}\n", encoding="utf-8")
    with modelserver("--config", str(config), "--model", "tiny", uds=True) as server, server.client() as client:
        assert server.uds is not None and server.uds.is_socket()
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        answer = client.post("/v1/chat/completions", json=chat("via socket")).json()
        assert answer["choices"][0]["message"]["content"] == "via socket"
        assert "POST /v1/chat/completions 200" in server.wait_log("POST /v1/chat/completions 200")


def test_unknown_model_in_config_exits_2_naming_the_known_ones(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("models:\n  tiny:\n    engine: fake\n", encoding="utf-8")
    server = spawn_modelserver("--config", str(config), "--model", "huge")
    try:
        assert server.wait_exit(timeout_s=30) == 2
        assert "no such model (known: tiny)" in server.log_text()
    finally:
        server.stop()


def test_no_config_form_with_the_fake_engine() -> None:
    with modelserver("--engine", "fake", "--name", "dbg") as server, server.client() as client:
        assert client.get("/health").json()["model"] == "dbg"
