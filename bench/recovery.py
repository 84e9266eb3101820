"""Recovery: a ``[[fatal]]`` answer, or ``kill -9`` of the model process, to the next successful answer.

While a paced steady load (``STEADY_RPS`` requests/s from 4 clients) runs against the
model through the router, the fault is injected at t0; a probe then sends requests back
to back until one succeeds. Recovery = that success's arrival - t0. Every request of the
steady load and of the probe is counted, ok or failed, with its status.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from bench import plots
from bench.common import Context, Section, Table, extreme, median
from bench.realmodel import DEMO_GGUF, real_model
from bench.routerctl import Router, fake_model, router_config, start_router

__all__ = ["Episode", "run"]

log = logging.getLogger(__name__)

STEADY_RPS = 100.0
CLIENTS = 4
RECOVERY_LIMIT_S = 60.0  # an episode gives up (and says so) when no answer succeeds by then
REQUEST_TIMEOUT_S = 20.0
CHAT = "/v1/chat/completions"


@dataclass(slots=True)
class Episode:
    """One fault and what the clients saw around it (times relative to t0, the fault)."""

    model: str
    fault: str
    old_pid: int | None = None
    new_pid: int | None = None
    fault_status: int | None = None
    recovery_s: float = float("nan")
    probes: int = 0
    probe_failures: int = 0
    steady: list[tuple[float, float, int]] = field(default_factory=list)  # (end s, latency ms, status)

    @property
    def steady_failed(self) -> int:
        return sum(1 for _, _, status in self.steady if status != 200)

    def failure_statuses(self) -> str:
        counts: dict[int, int] = {}
        for _, _, status in self.steady:
            if status != 200:
                counts[status] = counts.get(status, 0) + 1
        return ", ".join(f"{count}x {status or 'conn'}" for status, count in sorted(counts.items())) or "-"


def _body(model: str, text: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, object]) -> int:
    try:
        async with session.post(url, json=body) as resp:
            await resp.read()
            return resp.status
    except (aiohttp.ClientError, TimeoutError):
        return 0


async def _steady(session: aiohttp.ClientSession, url: str, model: str, stop: asyncio.Event,
                  out: list[tuple[float, float, int]]) -> None:
    interval_s = CLIENTS / STEADY_RPS
    next_at = time.perf_counter()
    while not stop.is_set():
        start = time.perf_counter()
        status = await _post(session, url, _body(model, "steady load"))
        end = time.perf_counter()
        out.append((end, (end - start) * 1000, status))
        next_at = max(next_at + interval_s, end)
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))


async def _probe(session: aiohttp.ClientSession, url: str, model: str, episode: Episode, t0: float) -> None:
    deadline = t0 + RECOVERY_LIMIT_S
    while time.perf_counter() < deadline:
        episode.probes += 1
        if await _post(session, url, _body(model, "probe")) == 200:
            episode.recovery_s = time.perf_counter() - t0
            return
        episode.probe_failures += 1
        await asyncio.sleep(0.005)


async def _episode(router: Router, episode: Episode, inject: Callable[[aiohttp.ClientSession], Awaitable[None]],
                   settle_s: float) -> None:
    url = router.url + CHAT
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        stop = asyncio.Event()
        raw: list[tuple[float, float, int]] = []
        workers = [asyncio.create_task(_steady(session, url, episode.model, stop, raw)) for _ in range(CLIENTS)]
        await asyncio.sleep(settle_s)
        t0 = time.perf_counter()
        await inject(session)
        await _probe(session, url, episode.model, episode, t0)
        await asyncio.sleep(settle_s)
        stop.set()
        await asyncio.gather(*workers)
    episode.steady = [(end - t0, ms, status) for end, ms, status in raw]


def _run_episode(router: Router, model: str, fault: str, settle_s: float) -> Episode:
    import uvloop

    episode = Episode(model=model, fault=fault, old_pid=router.pid(model))

    async def fatal(session: aiohttp.ClientSession) -> None:
        episode.fault_status = await _post(session, router.url + CHAT, _body(model, "[[fatal]]"))

    async def kill(session: aiohttp.ClientSession) -> None:
        assert episode.old_pid is not None
        os.kill(episode.old_pid, signal.SIGKILL)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_episode(router, episode, fatal if fault == "[[fatal]]" else kill, settle_s))
    episode.new_pid = router.pid(model)
    log.info("%s %s: recovered in %.3f s, pid %s -> %s", model, fault, episode.recovery_s, episode.old_pid,
             episode.new_pid)
    return episode


def _models(ctx: Context) -> dict[str, object]:
    # retry_on_fatal off: the marker is in the request, so a retry would hit [[fatal]] again and cost a second
    # restart (plus a backoff); a real fatal error (device lost) belongs to the process, not to the request.
    # stable_after_s 0.5: each episode starts on a backend that has been READY long enough to count as stable,
    # so every fault is a "first failure" (relaunched at once) rather than climbing the backoff ladder.
    limits = {"preload": True, "max_concurrency": 64, "max_queue": 256, "retry_on_fatal": False, "stable_after_s": 0.5}
    models: dict[str, object] = {"fake": fake_model(load_s=0.2, **limits)}
    if Path(DEMO_GGUF).exists() and not ctx.quick:
        models["smollm2"] = {**real_model(), **limits}
    return models


def _rows(episodes: list[Episode]) -> list[list[object]]:
    rows: list[list[object]] = []
    for e in episodes:
        total = len(e.steady)
        span_s = (max(t for t, _, _ in e.steady) - min(t for t, _, _ in e.steady)) if total > 1 else 0.0
        rows.append([e.model, e.fault, e.fault_status or "-", e.recovery_s * 1000, e.probes, e.probe_failures,
                     total, total / span_s if span_s else None, e.steady_failed, e.failure_statuses(),
                     f"{e.old_pid} -> {e.new_pid}", e.new_pid is not None and e.new_pid != e.old_pid])
    return rows


def run(ctx: Context) -> Section:
    section = Section("recovery", "Recovery from a fatal error and from kill -9")
    tmp = ctx.section_tmp("recovery")
    config = router_config(ctx.model_state, _models(ctx), {"health_interval_s": 1})
    router = start_router(ctx.procs, tmp, config, name="recovery-router")
    for name in _models(ctx):
        router.load(name)  # preload: wait until READY
    repeats = ctx.count(3, 1)
    settle_s = ctx.scale(1.5, 0.8)
    faults = [("fake", "[[fatal]]"), ("fake", "kill -9")]
    if "smollm2" in _models(ctx):
        faults.append(("smollm2", "kill -9"))
    episodes = [_run_episode(router, m, f, settle_s) for m, f in faults for _ in range(repeats)]
    section.intro = (
        f"Steady load: {CLIENTS} clients pacing {STEADY_RPS:.0f} requests/s in all (4-token chats; a client whose "
        "answer takes longer sends its next request at once, so a slow model gets less) through the router "
        f"for {settle_s:.1f} s before and after the fault. The fault is injected at t0: a `[[fatal]]` chat "
        "(the fake engine answers 500 + `X-Backend-Fatal: 1`) or SIGKILL of the model server's pid from "
        "`/api/models`. Recovery = t0 -> the next successful answer of a probe that retries back to back "
        "(5 ms apart, ignoring `Retry-After`, as does the steady load). Config: `retry_on_fatal: false` (the marker "
        "travels with the request, so a retry would fault again), `stable_after_s: 0.5` (each fault is a first "
        "failure: relaunched at once, no backoff), `health_interval_s: 1`."
    )
    headers = ["model", "fault", "fault answer", "recovery ms", "probes", "probe failures", "steady requests",
               "steady req/s achieved", "steady failed", "failed as", "pid", "new process"]
    section.tables.append(Table(headers, _rows(episodes), "One row per episode."))
    summary = []
    stuck = [e for e in episodes if math.isnan(e.recovery_s)]
    if stuck:
        which = ", ".join(sorted({f"{e.model} {e.fault}" for e in stuck}))
        section.notes.append(f"NOT RECOVERED: {len(stuck)} episode(s) had no successful answer within "
                             f"{RECOVERY_LIMIT_S:.0f} s ({which}).")
    for model, fault in faults:
        times = [e.recovery_s * 1000 for e in episodes if e.model == model and e.fault == fault]
        failed = sum(e.steady_failed for e in episodes if e.model == model and e.fault == fault)
        summary.append([model, fault, median(times), extreme(times, min), extreme(times, max), failed])
    section.tables.append(Table(["model", "fault", "median recovery ms", "min", "max", "steady failed (all episodes)"],
                                summary))
    panels = {f"{e.model} {e.fault}": [(t, ms, status == 200) for t, ms, status in e.steady]
              for e in episodes[::repeats]}
    section.plots.append(plots.timeline(ctx.plot_path("recovery"), "Steady load around the fault", panels))
    section.data = {"episodes": [{k: v for k, v in asdict(e).items() if k != "steady"} for e in episodes]}
    return section
