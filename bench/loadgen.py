"""Closed-loop HTTP load: wrk when installed, else an asyncio client with the same accounting.

Both keep ``connections`` keep-alive connections busy for ``duration_s`` (each sends its
next request as soon as the previous answer is complete) and report every request:
completed ones, errors by kind (non-2xx status, connect, read/write, timeout), latency
percentiles over all samples, and the CPU seconds the generator itself spent (wrk's
process, from its rusage; the asyncio generator's thread), so that a figure of CPU per
request can show the client's share apart from the server's. Only loopback targets are
accepted. A target with several ``bodies`` sends them in turn (wrk: request by request;
asyncio: connection by connection).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast
from urllib.parse import urlsplit

import numpy as np

from bench.procs import die_with_parent

__all__ = ["PERCENTILES", "LoadResult", "Target", "parse_wrk", "run_asyncio", "run_load", "run_wrk"]

log = logging.getLogger(__name__)

Tool = Literal["wrk", "asyncio"]
WRK_SCRIPT = Path(__file__).with_name("wrk_post.lua")
PERCENTILES: tuple[float, ...] = (*range(1, 100), 99.5, 99.9, 99.99)
LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


@dataclass(frozen=True, slots=True)
class Target:
    """One HTTP endpoint on loopback and the JSON body POSTed to it (or ``bodies``, sent in turn)."""

    url: str
    body: bytes
    bodies: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        host = urlsplit(self.url).hostname
        if host not in LOOPBACK:
            raise ValueError(f"load is sent to loopback only, not {host!r}")
        if any(b"\n" in body for body in (self.body, *self.bodies)):
            raise ValueError("a body must be one line (wrk receives the bodies as lines)")

    def all_bodies(self) -> tuple[bytes, ...]:
        return self.bodies or (self.body,)


@dataclass(slots=True)
class LoadResult:
    """What one closed-loop run measured."""

    tool: Tool
    connections: int
    duration_s: float
    requests: int
    errors: dict[str, int] = field(default_factory=dict)
    pct_ms: dict[float, float] = field(default_factory=dict)
    mean_ms: float = 0.0
    max_ms: float = 0.0
    cpu_s: float | None = None  # the generator's own CPU seconds over the run

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def ok(self) -> int:
        return self.requests - self.errors.get("status", 0)

    @property
    def rps(self) -> float:
        """Successful responses per second."""
        return self.ok / self.duration_s if self.duration_s > 0 else 0.0

    def p(self, percentile: float) -> float:
        return self.pct_ms.get(float(percentile), float("nan"))


def run_load(tool: Tool, target: Target, connections: int, duration_s: float) -> LoadResult:
    if tool == "wrk":
        return run_wrk(target, connections, duration_s)
    return run_asyncio(target, connections, duration_s)


# --- wrk ---------------------------------------------------------------------------------------


def run_wrk(target: Target, connections: int, duration_s: float, wrk: str = "wrk") -> LoadResult:
    """wrk with one thread (the load generator shares the 2 cores with what it measures)."""
    seconds = max(1, round(duration_s))
    argv = [wrk, "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "10s", "-s", str(WRK_SCRIPT), target.url]
    bodies = target.all_bodies()
    env = {**os.environ, "BENCH_BODY": bodies[0].decode(), "BENCH_BODIES": b"\n".join(bodies).decode()}
    code, stdout, stderr, cpu_s = _run_child(argv, env, seconds + 30)
    try:
        result = parse_wrk(stdout, connections)
    except ValueError:
        result = None
    if code != 0 or result is None:
        raise RuntimeError(f"wrk failed ({code}): {stderr.strip() or stdout.strip()}"[:500])
    result.cpu_s = cpu_s
    return result


def _run_child(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str, str, float]:
    """``argv`` run to its end: exit code, stdout, stderr and its own CPU seconds (user + system, from wait4)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err,  # noqa: PLW1509 - only a prctl
                                preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                _, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read(), usage.ru_utime + usage.ru_stime


def parse_wrk(stdout: str, connections: int) -> LoadResult:
    """The ``BENCH_JSON`` line that ``bench/wrk_post.lua`` prints as a :class:`LoadResult`; ValueError without one."""
    line = next((ln for ln in stdout.splitlines() if ln.startswith("BENCH_JSON ")), None)
    if line is None:
        raise ValueError("wrk printed no BENCH_JSON line")
    return _from_wrk(json.loads(line.removeprefix("BENCH_JSON ")), connections)


def _from_wrk(data: dict[str, object], connections: int) -> LoadResult:
    lat = data["latency_us"]
    assert isinstance(lat, dict)
    errors = {k: int(v) for k, v in dict(data["errors"]).items() if v}  # type: ignore[call-overload]
    return LoadResult(
        tool="wrk",
        connections=connections,
        duration_s=int(data["duration_us"]) / 1e6,  # type: ignore[call-overload]
        requests=int(data["requests"]),  # type: ignore[call-overload]
        errors=errors,
        pct_ms={float(p): us / 1000 for p, us in lat["pct"].items()},
        mean_ms=float(lat["mean"]) / 1000,
        max_ms=float(lat["max"]) / 1000,
    )


# --- asyncio -----------------------------------------------------------------------------------


class _Exchange(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: write a request, resolve a future with the status."""

    def __init__(self) -> None:
        import httptools

        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[int] | None = None
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except Exception as exc:  # noqa: BLE001 - a malformed answer is a read error of this request
            self._fail(ConnectionError(f"bad response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError("connection closed"))
        if not self.closed.done():
            self.closed.set_result(None)

    def on_message_complete(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(self._parser.get_status_code())
        if not self._parser.should_keep_alive() and self.transport is not None:
            self.transport.close()

    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    def send(self, request: bytes) -> asyncio.Future[int]:
        assert self.transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self._waiter


def _request_bytes(target: Target) -> tuple[str, int, bytes]:
    parts = urlsplit(target.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    head = (
        f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(target.body)}\r\n\r\n"
    )
    return host, port, head.encode() + target.body


@dataclass(slots=True)
class _Tally:
    samples_ns: list[int] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def _worker(host: str, port: int, request: bytes, deadline: float, tally: _Tally) -> None:
    loop = asyncio.get_running_loop()
    conn: _Exchange | None = None
    while time.perf_counter() < deadline:
        if conn is None or conn.transport is None or conn.transport.is_closing():
            try:
                _, conn = await asyncio.wait_for(loop.create_connection(_Exchange, host, port), 10)
            except (OSError, TimeoutError):
                tally.error("connect")
                await asyncio.sleep(0.01)
                continue
        start = time.perf_counter_ns()
        try:
            status = await asyncio.wait_for(conn.send(request), 10)  # type: ignore[union-attr]
        except TimeoutError:
            tally.error("timeout")
            conn.transport.close()  # type: ignore[union-attr]
            continue
        except ConnectionError:
            tally.error("read")
            continue
        tally.samples_ns.append(time.perf_counter_ns() - start)
        if not 200 <= status < 400:
            tally.error("status")
    if conn is not None and conn.transport is not None:
        conn.transport.close()


async def _drive(target: Target, connections: int, duration_s: float) -> tuple[_Tally, float]:
    requests = [_request_bytes(Target(target.url, body)) for body in target.all_bodies()]
    tally = _Tally()
    start = time.perf_counter()
    deadline = start + duration_s
    await asyncio.gather(*(_worker(*requests[i % len(requests)], deadline, tally) for i in range(connections)))
    return tally, time.perf_counter() - start


def run_asyncio(target: Target, connections: int, duration_s: float) -> LoadResult:
    """The fallback generator: uvloop + httptools, every request's latency kept."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        cpu_before = _thread_cpu_s()
        tally, elapsed = runner.run(_drive(target, connections, duration_s))
        cpu_s = _thread_cpu_s() - cpu_before
    samples_ms = np.asarray(tally.samples_ns, dtype=np.float64) / 1e6
    pct = dict(zip(PERCENTILES, np.percentile(samples_ms, PERCENTILES), strict=True)) if samples_ms.size else {}
    return LoadResult(
        tool="asyncio",
        connections=connections,
        duration_s=elapsed,
        requests=len(tally.samples_ns),
        errors=tally.errors,
        pct_ms={float(k): float(v) for k, v in pct.items()},
        mean_ms=float(samples_ms.mean()) if samples_ms.size else 0.0,
        max_ms=float(samples_ms.max()) if samples_ms.size else 0.0,
        cpu_s=cpu_s,
    )


def _thread_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_THREAD)  # the generator runs on this thread alone
    return usage.ru_utime + usage.ru_stime
