"""Start ``python -m modelserver`` as a real child process, on a free TCP port or a Unix socket.

Typical use::

    with modelserver("--engine", "fake") as server:          # waits for /health 200
        server.client().post("/v1/chat/completions", json=...)

    with modelserver(spec=my_spec, uds=True) as server:      # as the router launches it
        ...

    async with amodelserver("--engine", "fake") as server:   # the same, from async tests
        async with server.async_client() as client: ...

The process runs in its own session (process group); leaving the block stops it with
SIGTERM, then SIGKILL after ``stop_timeout_s``, and always reaps it. Its stdout and stderr
go to a log file (``server.log_text()``), shown in the error when it fails to become ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from modelserver.spec import SPEC_ENV, ModelSpec

__all__ = [
    "ModelServerProcess",
    "amodelserver",
    "free_port",
    "modelserver",
    "spawn_modelserver",
]

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ModelServerProcess:
    """A running model server: its process, where it listens and its log."""

    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    uds: Path | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self, timeout_s: float = 60.0) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=str(self.uds)) if self.uds else None
        return httpx.Client(base_url=self.base_url, transport=transport, timeout=timeout_s)

    def async_client(self, timeout_s: float = 60.0) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(uds=str(self.uds)) if self.uds else None
        return httpx.AsyncClient(base_url=self.base_url, transport=transport, timeout=timeout_s)

    def wait_log(self, needle: str, timeout_s: float = 60.0) -> str:
        """The log once it holds ``needle`` (a request's access line is written after its response)."""
        deadline = time.monotonic() + timeout_s
        while needle not in (text := self.log_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return text

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def health(self, timeout_s: float = 30.0) -> httpx.Response:
        with self.client(timeout_s) as client:
            return client.get("/health")

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Poll ``/health`` until 200; fail at once (with the log) if the process exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"model server exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if self.health(timeout_s=1.0).status_code == 200:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"model server not ready after {timeout_s}s:\n{self.log_text()[-3000:]}")

    def wait_exit(self, timeout_s: float = 30.0) -> int:
        """The exit status; a process still running after ``timeout_s`` fails the test with its log and threads."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            threads = _thread_names(self.proc.pid)
            raise AssertionError(f"model server still running after {timeout_s}s (threads: {threads}):\n"
                                 f"{self.log_text()[-3000:]}") from None

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM the process group, SIGKILL after ``timeout_s``; always reaps. Returns the exit status."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        self._signal(signal.SIGKILL)  # anything the server left in its group
        if self._tmp is not None:
            self._tmp.cleanup()
        return self.proc.returncode

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def spawn_modelserver(
    *args: str,
    spec: ModelSpec | None = None,
    uds: bool = False,
    env: Mapping[str, str] | None = None,
    log_dir: Path | None = None,
    python: Sequence[str] = (sys.executable,),
) -> ModelServerProcess:
    """Start a model server (without waiting). ``args`` are CLI flags; ``spec`` goes through the env."""
    tmp = tempfile.TemporaryDirectory(prefix="modelserver-")
    folder = log_dir or Path(tmp.name)
    child_env = {**os.environ, **(env or {})}
    if spec is not None:
        child_env[SPEC_ENV] = spec.to_env()
        args = ("--model", spec.name, *args)
    socket_path = Path(tmp.name) / "model.sock" if uds else None
    if socket_path is not None:
        listen, base_url = ["--uds", str(socket_path)], "http://modelserver"
    else:
        port = free_port()
        listen, base_url = ["--port", str(port)], f"http://127.0.0.1:{port}"
    log_path = folder / "modelserver.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*python, "-m", "modelserver", *args, *listen],
            cwd=ROOT,
            env=child_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return ModelServerProcess(proc, base_url, log_path, socket_path, tmp)


@contextlib.contextmanager
def modelserver(
    *args: str,
    spec: ModelSpec | None = None,
    uds: bool = False,
    env: Mapping[str, str] | None = None,
    wait: bool = True,
    ready_timeout_s: float = 120.0,
    stop_timeout_s: float = 10.0,
) -> Iterator[ModelServerProcess]:
    """A model server for the block, ready when ``wait`` (the default); stopped and reaped after."""
    server = spawn_modelserver(*args, spec=spec, uds=uds, env=env)
    try:
        if wait:
            server.wait_ready(ready_timeout_s)
        yield server
    finally:
        server.stop(stop_timeout_s)


@contextlib.asynccontextmanager
async def amodelserver(
    *args: str,
    spec: ModelSpec | None = None,
    uds: bool = False,
    env: Mapping[str, str] | None = None,
    wait: bool = True,
    ready_timeout_s: float = 120.0,
    stop_timeout_s: float = 10.0,
) -> AsyncIterator[ModelServerProcess]:
    """:func:`modelserver` for async tests: start, readiness and stop run off the event loop."""
    server = spawn_modelserver(*args, spec=spec, uds=uds, env=env)
    try:
        if wait:
            await asyncio.to_thread(server.wait_ready, ready_timeout_s)
        yield server
    finally:
        await asyncio.to_thread(server.stop, stop_timeout_s)


def _thread_names(pid: int) -> list[str]:
    """The names of a process's threads (``/proc/PID/task/*/comm``): where a process that should have exited waits."""
    names = []
    for comm in Path(f"/proc/{pid}/task").glob("*/comm"):
        with contextlib.suppress(OSError):
            names.append(comm.read_text().strip())
    return sorted(names)
