"""One model view: procman's probes are the only ``/health`` requests a model server gets, and the
router's observers (memory watch, console, ``/metrics``, model status, loading tickers) read what
those probes kept (``Backend.last_health``, ``last_load_s``, ``loading_for_s()``, ``ready()``)."""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from procman import HttpProber, State
from tests.procman_fakes import FakeProcess
from tests.router_fakes import chat, fake_router

MIB = 1 << 20
HEALTH = {
    "status": "ready", "model": "m", "task": "llm", "running": 1, "cache_usage": 0.25,
    "memory": {"device": "CPU", "counted_bytes": 321 * MIB, "peak_rss_bytes": 321 * MIB},
}


class CountingServer:
    """What a model server's socket sees: every request's path counted; ``/health`` answers :data:`HEALTH`."""

    def __init__(self) -> None:
        self.paths: collections.Counter[str] = collections.Counter()
        self.servers: list[asyncio.Server] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].decode()
            self.paths[path] += 1
            body = json.dumps(HEALTH).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            await writer.drain()
        finally:
            writer.close()

    def spawning(self, spawn: Callable[..., Any]) -> Callable[..., Any]:
        """``spawn`` of the fake spawner, listening on the process's socket before it returns."""

        async def listening(argv: Sequence[str], *args: Any) -> FakeProcess:
            proc: FakeProcess = await spawn(argv, *args)
            socket = argv[list(argv).index("--uds") + 1]
            self.servers.append(await asyncio.start_unix_server(self.serve, path=socket))
            return proc

        return listening

    async def close(self) -> None:
        for server in self.servers:
            server.close()
            await server.wait_closed()


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)
    assert predicate(), what


async def test_one_health_poll_per_model_the_probers_while_memwatch_console_and_metrics_read(
    tmp_path: Path,
) -> None:
    server = CountingServer()
    async with fake_router(tmp_path, {"m": {"engine": "fake", "health_interval_s": 2}}, prober=HttpProber()) as r:
        r.harness.spawner.spawn = server.spawning(r.harness.spawner.spawn)  # type: ignore[method-assign]
        watch = r.service.registry.residency.watch
        watch.interval_s = 0.005  # the memory watch reads as often as it likes: it asks nobody
        try:
            assert (await r.post("/v1/chat/completions", chat("m"))).status == 200
            assert server.paths["/health"] == 1  # readiness: one probe, answered 200
            rounds = 5
            async with r.client() as client:
                for index in range(rounds):
                    await r.harness.clock.advance(2.0)  # one health_interval_s of procman's clock
                    now = r.harness.clock.now
                    await until(lambda i=index: server.paths["/health"] >= 2 + i, "the watch's probe")
                    await until(lambda now=now: (h := r.backend("m").last_health) is not None and h.at >= now,
                                "its answer kept")  # the probe ended: the watch waits for the next interval
                    for _ in range(3):  # scrapes and dashboards between two probes
                        metrics = (await client.get("/metrics")).text
                        rows = (await client.get("/api/models")).json()["models"]
                    await asyncio.sleep(0.05)  # the memory watch reads ~10 times meanwhile
            assert server.paths["/health"] == 1 + rounds, server.paths  # the prober's cadence, nobody else's
            assert set(server.paths) == {"/health"}  # the chat went through the (fake) upstream
            assert not [c for c in r.upstream.calls if c.path.endswith("/health")]
            backend = r.backend("m")
            assert backend.last_health is not None and backend.last_health.body == HEALTH
            # what the observers show came from those probes: memory, the console's figures, the gauges
            size = r.service.registry.residency.store.size_of(r.service.registry.models["m"].spec)
            assert (size.source, size.bytes) == ("measured", 321 * MIB)
            row = next(row for row in rows if row["name"] == "m")
            assert row["reported"] == {"running": 1, "cache_usage": 0.25}
            assert row["memory"]["reported"]["counted_bytes"] == 321 * MIB
            assert 'ovrouter_backend_kv_cache_usage_ratio{model="m"} 0.25' in metrics
        finally:
            await server.close()


async def test_load_time_progress_and_readiness_come_from_procman(tmp_path: Path) -> None:
    async with fake_router(tmp_path, {"m": {"engine": "fake"}}) as r:
        backend, clock = r.backend("m"), r.harness.clock
        r.harness.spawner.on_spawn = lambda proc: setattr(proc, "healthy", False)
        starting = asyncio.ensure_future(backend.ensure_ready())
        await clock.advance(0.1)
        loading_s = backend.loading_for_s()
        assert backend.state is State.STARTING and loading_s is not None and 0.0 < loading_s <= 0.11
        ready = backend.ready()
        assert not ready.done() and backend.last_load_s is None
        r.harness.spawner.last.healthy = True
        await clock.advance(3.0)
        await starting
        assert ready.done() and backend.ready().done() and backend.loading_for_s() is None
        assert backend.last_load_s is not None and 0.1 <= backend.last_load_s <= 3.1  # procman's (fake) seconds
        async with r.client() as client:
            rows = (await client.get("/api/models")).json()["models"]
            assert next(row for row in rows if row["name"] == "m")["last_load_s"] == round(backend.last_load_s, 2)
            gauge = f'ovrouter_model_last_load_seconds{{model="m"}} {backend.last_load_s}'
            assert gauge in (await client.get("/metrics")).text
            await r.harness.clock.run(backend.stop())
            again = asyncio.ensure_future(backend.ensure_ready())
            await clock.advance(1.5)
            listed = (await client.get("/models")).json()["data"]
            progress = next(m for m in listed if m["id"] == "m")["status"]["progress"]
            assert progress["expected_s"] == round(backend.last_load_s, 2)
            assert 1.5 <= progress["elapsed_s"] <= 1.6  # by procman's clock, from the start's own beginning
            r.harness.spawner.last.healthy = True
            await clock.advance(1.0)
            await again
