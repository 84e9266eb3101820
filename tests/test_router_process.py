"""``ovrouter serve`` as a real process: SIGKILL leaves no model process, SIGTERM lets a
stream finish and stops every model, SIGHUP reloads the config, ``ovrouter status`` prints the table."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from tests.modelserver_helpers import free_port
from tests.router_helpers import fake_model, write_config

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def router_process(config: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    log = open(config.parent / "router.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("router did not start:\n" + (config.parent / "router.log").read_text())
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        log.close()


def model_pids(port: int) -> list[int]:
    rows = httpx.get(f"http://127.0.0.1:{port}/api/models", timeout=5).json()["models"]
    return [row["pid"] for row in rows if row["pid"]]


def gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids):
            return True
        time.sleep(0.05)
    return False


def test_sigkill_of_the_router_leaves_no_model_process(tmp_path: Path) -> None:
    port = free_port()
    config = write_config(tmp_path, {"a": fake_model(preload=True), "b": fake_model(preload=True)})
    with router_process(config, port) as proc:
        deadline = time.monotonic() + 60
        while len(pids := model_pids(port)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pids) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        assert gone(pids, 30.0), "model processes outlived a SIGKILLed router"


def test_sigkill_of_the_router_leaves_no_grandchild_of_a_shell_wrapped_command(tmp_path: Path) -> None:
    port = free_port()
    server = f"{sys.executable} -m modelserver --engine fake --port ${{PORT}}"
    wrapped = {"command": ["sh", "-c", f"{server} & wait"], "preload": True}
    config = write_config(tmp_path, {"wrapped": wrapped}, router={"transport": "tcp"})
    with router_process(config, port) as proc:
        deadline = time.monotonic() + 60
        while not (pids := model_pids(port)) and time.monotonic() < deadline:
            time.sleep(0.05)
        shell = psutil.Process(pids[0])
        grandchildren = [child.pid for child in shell.children(recursive=True)]
        watchdogs = [p.pid for p in psutil.Process(proc.pid).children() if "watchdog.py" in " ".join(p.cmdline())]
        assert grandchildren and len(watchdogs) == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        assert gone([shell.pid, *grandchildren], 30.0), "a shell-wrapped model's child outlived a SIGKILLed router"
        assert gone(watchdogs, 30.0)


def test_sigterm_finishes_the_stream_then_stops_every_model(tmp_path: Path) -> None:
    port = free_port()
    config = write_config(tmp_path, {"echo": fake_model(fake={"load_s": 0, "token_delay_s": 0.1})})
    with router_process(config, port) as proc:
        body = {"model": "echo", "stream": True, "messages": [{"role": "user", "content": " ".join("abcdefghij")}]}
        chunks: list[str] = []
        under_way = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60) as r:
                for text in r.iter_text():
                    chunks.append(text)
                    if '"content":"a"' in "".join(chunks).replace(" ", ""):
                        under_way.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert under_way.wait(60), "the stream never got its first word"  # a cold start may take seconds
        pids = model_pids(port)
        proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
        text = "".join(chunks)
        assert '"content":"j"' in text.replace(" ", "") and "[DONE]" in text, "the in-flight stream completed"
        assert pids and gone(pids, 30.0)


def test_status_command_prints_the_models_table(tmp_path: Path) -> None:
    port = free_port()
    config = write_config(
        tmp_path, {"echo": fake_model(preload=True), "idle": fake_model()}, router={"admin_keys": ["adm"], "port": port}
    )
    with router_process(config, port):
        deadline = time.monotonic() + 60
        out = ""
        while "ready" not in out and time.monotonic() < deadline:
            out = subprocess.run(
                [sys.executable, "-m", "router.cli", "status", "--config", str(config)], capture_output=True, text=True
            ).stdout
        lines = out.splitlines()
        assert lines[0].startswith("MODEL") and any(line.split()[:2] == ["echo", "ready"] for line in lines)
        assert any(line.split()[:2] == ["idle", "stopped"] for line in lines)
        denied = subprocess.run(
            [sys.executable, "-m", "router.cli", "status", "--url", f"http://127.0.0.1:{port}", "--key", "wrong"],
            capture_output=True,
            text=True,
        )
        assert denied.returncode == 1 and "401" in denied.stderr


def test_sighup_reloads_the_config(tmp_path: Path) -> None:
    """Signalled as a user would (``kill -HUP``): a real process, never the test runner's own."""
    port = free_port()
    config = write_config(tmp_path, {"echo": fake_model()})
    with router_process(config, port) as proc:
        data = yaml.safe_load(config.read_text())
        data["models"]["hup"] = fake_model()
        config.with_suffix(".tmp").write_text(yaml.safe_dump(data, sort_keys=False))
        os.replace(config.with_suffix(".tmp"), config)
        proc.send_signal(signal.SIGHUP)
        deadline, status = time.monotonic() + 60, dict[str, Any]()
        while "hup" not in status.get("models", {}) and time.monotonic() < deadline:
            time.sleep(0.05)
            status = httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=5).json()
        assert sorted(status["models"]) == ["echo", "hup"] and status["last_reload"]["source"] == "SIGHUP"
        assert proc.poll() is None  # reloaded, still serving
