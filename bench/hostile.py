"""Hostile load: the router's memory under many large uploads, its file descriptors under an idle flood.

Uploads: N concurrent 50 MiB chat bodies (a 50 MiB system message, a short question) to a
fake-engine model over loopback, once with the default ``max_buffered_body_mb`` (256) and
once with the budget out of the way (what the router did before it had one). The router's
own RSS (not its model processes') is sampled every 20 ms; the peak is reported.

Idle flood: 1000 connections that never send a byte (half of them half a request head,
slowloris), then a normal request and a cold start while they are open, the router's open
file descriptors counted before, during, and after ``head_timeout_s`` reaped them; once
with ``max_connections`` auto (far above 1000 here), once at 256 (what auto gives under a
1024 open-file limit: each connection beyond it closes the one idle the longest).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from typing import Any

import httpx
import psutil

from bench.common import Context, Section, Table
from bench.procs import wait_until
from bench.routerctl import Router, fake_model, router_config, start_router
from router.edge.connlimits import raise_open_file_limit

__all__ = ["run"]

log = logging.getLogger(__name__)

MIB = 1024 * 1024
HEAD_TIMEOUT_S = 5.0


def _body(size_mb: int) -> bytes:
    padding = "a" * (size_mb * MIB)
    return json.dumps({"model": "sink", "max_tokens": 2, "messages": [
        {"role": "system", "content": padding}, {"role": "user", "content": "hello world"}]}).encode()


class _PeakRss:
    """Samples one process's RSS in a thread until stopped; the peak in MiB."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        self._proc = psutil.Process(pid)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.peak_mb = self.start_mb = self._proc.memory_info().rss / MIB
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            with contextlib.suppress(psutil.Error):
                self.peak_mb = max(self.peak_mb, self._proc.memory_info().rss / MIB)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


async def _uploads(url: str, body: bytes, count: int) -> list[int]:
    timeout = httpx.Timeout(600, connect=30)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=count)) as client:
        async def one() -> int:
            try:
                reply = await client.post(url + "/v1/chat/completions", content=body,
                                          headers={"content-type": "application/json"})
                return reply.status_code
            except httpx.HTTPError as exc:
                log.warning("upload failed: %s", exc)
                return 0
        return list(await asyncio.gather(*(one() for _ in range(count))))


def _upload_row(ctx: Context, label: str, budget_mb: float, count: int, size_mb: int) -> list[object]:
    tmp = ctx.section_tmp(f"hostile-{int(budget_mb)}")
    config = router_config(tmp / "state", {"sink": fake_model(max_request_mb=size_mb + 8, max_concurrency=count,
                                                             preload=True)})
    config["router"].update(max_buffered_body_mb=budget_mb, body_wait_s=600)
    router = start_router(ctx.procs, tmp, config, name=f"router-{int(budget_mb)}")
    wait_until(lambda: router.state("sink") == "READY", 120, "sink READY", 0.05)
    body = _body(size_mb)
    with _PeakRss(router.proc.pid) as rss:
        began = time.perf_counter()
        statuses = asyncio.run(_uploads(router.url, body, count))
        seconds = time.perf_counter() - began
    after = psutil.Process(router.proc.pid).memory_info().rss / MIB
    ctx.procs.stop(router.proc)
    shown = ", ".join(f"{statuses.count(s)}x {s}" for s in sorted(set(statuses)))
    return [label, count, size_mb, rss.start_mb, rss.peak_mb, after, seconds, shown]


def _fds(pid: int) -> int:
    return int(psutil.Process(pid).num_fds())


def _flood_rows(ctx: Context, count: int, max_connections: int) -> list[list[object]]:
    raise_open_file_limit()  # the bench holds the other end of every connection
    tmp = ctx.section_tmp(f"hostile-flood-{max_connections}")
    models = {"warm": fake_model(preload=True), "cold": fake_model(load_s=0.2)}
    config = router_config(tmp / "state", models)
    config["router"].update(head_timeout_s=HEAD_TIMEOUT_S, max_connections=max_connections)
    router = start_router(ctx.procs, tmp, config, name=f"router-flood-{max_connections}")
    limit = f"max_connections {max_connections or 'auto'}"
    wait_until(lambda: router.state("warm") == "READY", 120, "warm READY", 0.05)
    pid = router.proc.pid
    before = _fds(pid)
    rows: list[list[object]] = [[limit, "before the flood", before, "-", "-"]]
    idle = []
    try:
        for index in range(count):
            sock = socket.create_connection(("127.0.0.1", int(router.url.rsplit(":", 1)[1])), timeout=30)
            if index % 2:
                sock.sendall(b"GET /health HTTP/1.1\r\n")  # half a head, never finished
            idle.append(sock)
        expected = min(count, max_connections or count)
        wait_until(lambda: _fds(pid) >= expected, 30, "the flood accepted", 0.05)
        warm = _timed(router, "warm")
        cold = _timed(router, "cold")
        rows.append([limit, f"{count} idle connections opened", _fds(pid), warm, cold])
        wait_until(lambda: _fds(pid) < before + 30, HEAD_TIMEOUT_S + 60, "the flood reaped", 0.1)  # + the cold model
        rows.append([limit, f"after head_timeout_s={HEAD_TIMEOUT_S:g}", _fds(pid), _timed(router, "warm"), "-"])
    finally:
        for sock in idle:
            sock.close()
        ctx.procs.stop(router.proc)
    return rows


def _timed(router: Router, model: str) -> str:
    began = time.perf_counter()
    status, _ = router.post("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}]},
                            timeout_s=120)
    return f"{status} in {(time.perf_counter() - began) * 1000:.0f} ms"


def run(ctx: Context) -> Section:
    count, size_mb = ctx.count(16, 4), ctx.count(50, 8)
    uploads = [
        _upload_row(ctx, "max_buffered_body_mb 256 (default)", 256, count, size_mb),
        _upload_row(ctx, "no budget (100000)", 100_000, count, size_mb),
    ]
    flood = _flood_rows(ctx, ctx.count(1000, 100), 0) + _flood_rows(ctx, ctx.count(1000, 100), ctx.count(256, 32))
    data: dict[str, Any] = {"uploads": uploads, "flood": flood}
    return Section(
        "hostile", "Hostile load: large uploads and idle connections",
        intro=__doc__.split("\n\n", 1)[1].strip() if __doc__ else "",
        tables=[
            Table(["router", "uploads", "MiB each", "RSS before MiB", "peak RSS MiB", "RSS after MiB", "seconds",
                   "statuses"], uploads, "router RSS (its own process) under concurrent uploads"),
            Table(["router", "moment", "router fds", "warm request", "cold start"], flood,
                  "open file descriptors of the router under an idle flood"),
        ],
        data=data,
    )
