"""Proxy overhead: the trivial backend direct, through nginx, and through ovrouter.

Rounds are interleaved (every target at every connection count, then again), so a noisy
neighbour hurts all targets alike; each figure is the median over the rounds. Besides req/s,
each cell reports the CPU time the serving process spent per request (the backend's when
direct, the router's alone through ovrouter, from ``/proc/<pid>/task/*/schedstat``): on a
shared box it moves far less with the neighbours' load than req/s does.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from bench import plots
from bench.common import Context, Section, SectionSkipped, Table, median, ratio
from bench.loadgen import LoadResult, Target, run_load
from bench.nginx import start_nginx
from bench.procs import free_port, wait_http
from bench.routerctl import start_router

__all__ = ["TRIVIAL_BODY", "TRIVIAL_MODEL", "Backends", "run", "start_backends", "trivial_router_model"]

log = logging.getLogger(__name__)

TRIVIAL_MODEL = "trivial"
TRIVIAL_BODY = json.dumps(
    {"model": TRIVIAL_MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
).encode()
CHAT = "/v1/chat/completions"
TARGET_ADDED_P50_MS = 0.5
TARGET_RPS_RATIO = 0.45


@dataclass(slots=True)
class Backends:
    """Base URLs of what is running: direct is always there; nginx/router when available."""

    direct: str
    nginx: str | None = None
    router: str | None = None
    router_start_s: float | None = None
    router_error: str | None = None
    notes: tuple[str, ...] = ()
    pids: dict[str, int] = field(default_factory=dict)  # target -> the process whose CPU a request costs

    def targets(self) -> dict[str, str]:
        found = {"direct": self.direct, "nginx": self.nginx, "ovrouter": self.router}
        return {name: url for name, url in found.items() if url}


def trivial_router_model(port: int) -> dict[str, object]:
    """The trivial backend as a ``url:`` model, with limits above the bench's 64 connections."""
    return {"url": f"http://127.0.0.1:{port}", "health_path": "/health", "max_concurrency": 256, "max_queue": 256}


def start_backends(ctx: Context, name: str) -> Backends:
    """Trivial backend, then nginx and the router in front of it when they can run here."""
    port = free_port()
    proc = ctx.procs.spawn(f"{name}-trivial", [ctx.python, "-m", "bench.trivial_backend", "--port", str(port)])
    wait_http(f"http://127.0.0.1:{port}/health", proc, timeout_s=30)
    backends = Backends(direct=f"http://127.0.0.1:{port}", pids={"direct": proc.pid})
    notes = []
    if ctx.tools.nginx:
        _, nginx_port = start_nginx(ctx.procs, ctx.tools.nginx, ctx.section_tmp(f"{name}-nginx"), f"127.0.0.1:{port}")
        backends.nginx = f"http://127.0.0.1:{nginx_port}"
    else:
        notes.append("nginx is not installed (`make bench-deps` installs nginx-light): the nginx column is missing.")
    try:
        backends.router, backends.router_start_s, backends.pids["ovrouter"] = _start_trivial_router(ctx, name, port)
    except SectionSkipped as exc:
        notes.append(f"ovrouter not measured: {exc}.")
    except (RuntimeError, TimeoutError) as exc:  # keep the direct and nginx figures; the section still fails
        backends.router_error = str(exc)
        notes.append(f"ovrouter not measured, it failed to start: {exc}")
    backends.notes = tuple(notes)
    return backends


def _start_trivial_router(ctx: Context, name: str, port: int) -> tuple[str, float, int]:
    from bench.routerctl import router_config

    tmp = ctx.section_tmp(f"{name}-router")
    config = router_config(tmp / "state", {TRIVIAL_MODEL: trivial_router_model(port)})
    router = start_router(ctx.procs, tmp, config, name=f"{name}-router")
    status, body = router.post(CHAT, json.loads(TRIVIAL_BODY))
    if status != 200:
        raise RuntimeError(f"router did not proxy the trivial backend: {status} {body}")
    return router.url, router.start_s, router.proc.pid


def cpu_s(pid: int) -> float | None:
    """CPU seconds the process ``pid`` has run, all its threads (None where /proc cannot tell)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total_ns = 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                total_ns += int(stat.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total_ns / 1e9


Cpu = dict[str, dict[int, list[float]]]


def _measure(ctx: Context, targets: dict[str, str], levels: list[int],
             pids: dict[str, int]) -> tuple[dict[str, dict[int, list[LoadResult]]], Cpu]:
    rounds = ctx.count(3, 1)
    duration_s = ctx.scale(4.0, 0.5)
    results: dict[str, dict[int, list[LoadResult]]] = {t: {c: [] for c in levels} for t in targets}
    cpu: Cpu = {t: {c: [] for c in levels} for t in targets}
    for url in targets.values():  # warm-up: connections, lazy imports, caches
        run_load(ctx.loadgen, Target(url + CHAT, TRIVIAL_BODY), 4, ctx.scale(1.0, 0.3))
    for index in range(rounds):
        for connections in levels:
            for name, url in targets.items():
                before = cpu_s(pids[name]) if name in pids else None
                result = run_load(ctx.loadgen, Target(url + CHAT, TRIVIAL_BODY), connections, duration_s)
                after = cpu_s(pids[name]) if name in pids else None
                if before is not None and after is not None and result.requests:
                    cpu[name][connections].append((after - before) / result.requests * 1e6)
                log.info("round %d %s c=%d: %.0f req/s p50 %.3f ms", index, name, connections, result.rps, result.p(50))
                results[name][connections].append(result)
    return results, cpu


def _representative(runs: list[LoadResult]) -> LoadResult:
    """The round with the median throughput (its percentiles are plotted)."""
    return sorted(runs, key=lambda r: r.rps)[len(runs) // 2]


def _summary(runs: list[LoadResult], cpu_us: list[float]) -> dict[str, float]:
    return {
        "cpu_us": median(cpu_us) if cpu_us else float("nan"),
        "rps": median([r.rps for r in runs]),
        "rps_min": min(r.rps for r in runs),
        "rps_max": max(r.rps for r in runs),
        "p50_ms": median([r.p(50) for r in runs]),
        "p99_ms": median([r.p(99) for r in runs]),
        "requests": float(sum(r.requests for r in runs)),
        "errors": float(sum(r.error_count for r in runs)),
    }


def _table(summaries: dict[str, dict[int, dict[str, float]]], levels: list[int]) -> Table:
    rows = []
    for connections in levels:
        base = summaries["direct"][connections]
        for name, by_level in summaries.items():
            s = by_level[connections]
            rows.append([
                connections, name, s["rps"], f"{s['rps_min']:,.0f}-{s['rps_max']:,.0f}", s["p50_ms"], s["p99_ms"],
                int(s["requests"]), int(s["errors"]), ratio(s["rps"], base["rps"]),
                s["p50_ms"] - base["p50_ms"], s["p99_ms"] - base["p99_ms"], s["cpu_us"],
            ])
    headers = ["conns", "target", "req/s", "req/s range", "p50 ms", "p99 ms", "requests", "errors",
               "x direct req/s", "+p50 ms", "+p99 ms", "CPU us/req"]
    return Table(headers, rows, "Non-streaming chat completions, closed loop; median over rounds. CPU us/req: "
                 "of the backend when direct, of the router alone through ovrouter (nginx: not measured).")


def _targets_table(summaries: dict[str, dict[int, dict[str, float]]]) -> Table:
    rows = []
    direct = summaries["direct"]
    for name in ("ovrouter", "nginx"):
        if name not in summaries or 16 not in direct:
            continue
        rps_x = ratio(summaries[name][16]["rps"], direct[16]["rps"])
        added = summaries[name][1]["p50_ms"] - direct[1]["p50_ms"]
        rows.append([name, "req/s at 16 conns vs direct", rps_x, f">= {TARGET_RPS_RATIO}",
                     "met" if rps_x is not None and rps_x >= TARGET_RPS_RATIO else "MISSED"])
        rows.append([name, "added p50 at 1 conn (ms)", added, f"<= {TARGET_ADDED_P50_MS}",
                     "met" if added <= TARGET_ADDED_P50_MS else "MISSED"])
    return Table(["proxy", "figure", "value", "target (issue 4)", "verdict"], rows)


def run(ctx: Context) -> Section:
    section = Section("overhead", "Proxy overhead (trivial backend)")
    levels = [1, 16, 64] if not ctx.quick else [1, 16]
    backends = start_backends(ctx, "overhead")
    section.notes.extend(backends.notes)
    if backends.router_error:
        section.status = "failed"
    results, cpu = _measure(ctx, backends.targets(), levels, backends.pids)
    summaries = {name: {c: _summary(runs, cpu[name][c]) for c, runs in by_level.items()}
                 for name, by_level in results.items()}
    section.intro = (
        f"Trivial OpenAI-compatible backend (`bench/trivial_backend.py`, uvicorn+httptools+uvloop, one process). "
        f"Load generator: **{ctx.loadgen}**, one thread, keep-alive connections, "
        f"{ctx.count(3, 1)} interleaved round(s) of {ctx.scale(4.0, 0.5):g} s per cell (wrk: whole seconds)."
    )
    section.tables.append(_table(summaries, levels))
    section.tables.append(_targets_table(summaries))
    section.plots.append(plots.lines(
        ctx.plot_path("overhead_throughput"), "Throughput vs connections", "connections", "req/s",
        {name: {c: s["rps"] for c, s in by_level.items()} for name, by_level in summaries.items()},
    ))
    panels = {f"{c} connection(s)": {n: _representative(results[n][c]).pct_ms for n in results} for c in levels}
    section.plots.append(plots.latency_curves(ctx.plot_path("overhead_latency"), "Latency by percentile", panels))
    section.data = {"summaries": summaries, "router_start_s": backends.router_start_s}
    return section

