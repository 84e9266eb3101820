"""`command:` backends that are other servers, told honestly: a stream the upstream closes early
(as llama-cpp-python's server does on every health probe) is reported as exactly that and restarts
nothing; ``health_interval_s: 0`` probes only while starting, so no probe cuts a stream; a
``kill -9`` is reported as a death with its signal. The upstream is tests/procs/cutstream.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import router.path.recovery
from router.config import ConfigError, load_config
from tests.router_helpers import RunningRouter, fake_model, running_router, write_config

pytestmark = pytest.mark.timeout(120)

STANDIN = str(Path(__file__).parent / "procs" / "cutstream.py")
CHUNKS = 3  # token chunks the stand-in sends before it holds; the client gets these and the first chunk


def standin(*args: str, **settings: Any) -> dict[str, Any]:
    command = [sys.executable, STANDIN, "--port", "${PORT}", "--chunks", str(CHUNKS), *args]
    return {"command": command, "loading_progress": "off", **settings}


def body(path: str, name: str = "llama") -> dict[str, Any]:
    if path == "/v1/completions":
        return {"model": name, "prompt": "once upon a time", "stream": True}
    return {"model": name, "messages": [{"role": "user", "content": "hi"}], "stream": True}


def parse(line: str) -> Any:
    payload = line[len("data: "):]
    return "[DONE]" if payload == "[DONE]" else json.loads(payload)


async def stream(router: RunningRouter, path: str, name: str = "llama",
                 on_held: Callable[[], Any] | None = None) -> list[Any]:
    """The events of one stream; ``on_held`` runs once the client has the first chunk and the tokens."""
    events: list[Any] = []
    async with router.client.stream("POST", path, json=body(path, name)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(parse(line))
                if len(events) == CHUNKS + 1 and on_held is not None:
                    await on_held()
    return events


async def stats(router: RunningRouter, name: str) -> dict[str, int]:
    reply = await router.client.get(f"/upstream/{name}/stats")
    assert reply.status_code == 200
    return reply.json()  # type: ignore[no-any-return]


async def row(router: RunningRouter, name: str) -> dict[str, Any]:
    rows = (await router.client.get("/api/models")).json()["models"]
    return next(r for r in rows if r["name"] == name)


async def until(predicate: Callable[[], Any], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("cut", ["abort", "clean"])
async def test_a_stream_a_health_probe_cuts_is_reported_as_an_upstream_close_and_restarts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: str, path: str
) -> None:
    monkeypatch.setattr(router.path.recovery, "DEATH_GRACE_S", 0.2)  # only speeds the test up
    llama = standin("--cut", cut, health_path="/v1/models", health_interval_s=0.05)  # llama-cpp-python as issue 17
    async with running_router(write_config(tmp_path, {"llama": llama})) as r:
        events = await stream(r, path)  # the stand-in holds the stream until a probe cuts it: it cannot end alone
        pid = r.backend("llama").pid
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1 and len(events) == CHUNKS + 3
        message = events[-2]["error"]["message"]
        assert message == (f"model 'llama' upstream closed the stream after {CHUNKS + 1} chunks without finishing; "
                           f"the process (pid {pid}) is still running")
        upstream = await stats(r, "llama")
        assert upstream["cuts"] == 1 and upstream["pid"] == pid
        model = await row(r, "llama")
        assert model["pid"] == pid and model["restarts"] == 0 and model["state"] == "ready"
        assert r.backend("llama").starts == 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_health_interval_0_probes_only_while_starting_and_no_probe_cuts_a_stream(tmp_path: Path,
                                                                                       path: str) -> None:
    quiet = standin(health_path="/v1/models", health_interval_s=0)
    probed = standin("--no-interrupt", health_path="/v1/models", health_interval_s=0.05)  # the clock to wait on
    async with running_router(write_config(tmp_path, {"quiet": quiet, "probed": probed})) as r:
        await stats(r, "probed")  # started: its probes now run every 0.05 s
        seen: dict[str, int] = {}

        async def hold_through_probes() -> None:
            seen.update(await stats(r, "quiet"))
            start = (await stats(r, "probed"))["models_requests"]
            await until(lambda: _more(r, "probed", start + 3))  # three probe periods went by for "probed"
            assert (await r.client.post("/upstream/quiet/release")).status_code == 200

        # on_held runs only if the first chunks arrive while the stream is held: relayed as they come, not buffered
        events = await stream(r, path, "quiet", on_held=hold_through_probes)
        assert events[-1] == "[DONE]" and not [e for e in events if isinstance(e, dict) and "error" in e]
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        after = await stats(r, "quiet")
        assert seen["holding"] == 1 and after["cuts"] == 0
        assert after["models_requests"] == seen["models_requests"] >= 1  # the start's probes, none since


async def _more(r: RunningRouter, name: str, count: int) -> bool:
    return (await stats(r, name))["models_requests"] >= count


async def test_kill_9_of_a_command_backend_is_reported_as_a_death_with_its_signal(tmp_path: Path) -> None:
    async with running_router(write_config(tmp_path, {"llama": standin()})) as r:
        killed: list[int] = []

        async def kill() -> None:
            pid = r.backend("llama").pid
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)

        events = await stream(r, "/v1/chat/completions", on_held=kill)
        assert events[-1] == "[DONE]" and len(events) == CHUNKS + 3
        assert events[-2]["error"]["message"] == (
            f"model 'llama' died after {CHUNKS + 1} chunks: its process (pid {killed[0]}) was killed by SIGKILL "
            "(signal 9); retry the request")

        async def relaunched() -> bool:
            model = await row(r, "llama")
            return model["state"] == "ready" and model["pid"] not in (None, killed[0])

        await until(relaunched)
        model = await row(r, "llama")
        assert model["restarts"] == 1 and model["exit_code"] == -signal.SIGKILL
        assert f"pid={killed[0]} exited unexpectedly with code -9 (SIGKILL)" in model["last_error"]
        answer = await r.client.post("/v1/chat/completions", json={**body("/v1/chat/completions"), "stream": False})
        assert answer.status_code == 200


async def test_a_probe_that_waits_behind_a_stream_gets_the_server_killed_as_hung_and_the_stream_says_so(
    tmp_path: Path,
) -> None:
    # llama-cpp-python with --interrupt_requests false and periodic /v1/models probes: why the recipe says 0
    llama = standin("--no-interrupt", health_path="/v1/models", health_interval_s=0.05, health_timeout_s=0.2,
                    health_failures=2)
    async with running_router(write_config(tmp_path, {"llama": llama})) as r:
        pid = (await stats(r, "llama"))["pid"]  # started first (idle, its probes pass): the stream runs on this one
        events = await stream(r, "/v1/chat/completions")  # held until the probes kill it
        assert events[-1] == "[DONE]" and len(events) == CHUNKS + 3
        assert events[-2]["error"]["message"] == (
            f"model 'llama' died after {CHUNKS + 1} chunks: its process (pid {pid}) was killed by SIGKILL "
            "(signal 9) by ovrouter as hung (/v1/models failed 2 health probes in a row); retry the request")


async def test_path_prefix_goes_before_every_proxied_path_but_not_the_probe(tmp_path: Path) -> None:
    ovms = standin("--prefix", "/v3", path_prefix="/v3")  # OVMS serves the OpenAI API under /v3 only
    bare = standin("--prefix", "/v3")
    async with running_router(write_config(tmp_path, {"ovms": ovms, "bare": bare})) as r:
        chat = {**body("/v1/chat/completions", "ovms"), "stream": False}
        answer = await r.client.post("/v1/chat/completions", json=chat)
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "ok"
        missing = await r.client.post("/v1/chat/completions", json={**chat, "model": "bare"})
        assert missing.status_code == 404  # the same server without path_prefix: the proof the prefix was sent


@pytest.mark.parametrize(("model", "problem"), [
    (fake_model(path_prefix="/v3"), "`path_prefix` is for `command` or `url` backends"),
    (standin(path_prefix="v3/"), "path_prefix"),
])
def test_path_prefix_is_checked(tmp_path: Path, model: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load_config(write_config(tmp_path, {"m": model}))
