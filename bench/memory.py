"""Memory: the router's RSS with 10 configured models, each model server's, and what a stop gives back.

RSS counts shared pages (Python, OpenVINO libraries) in every process; USS is the memory
unique to a process, i.e. what the OS gets back when it exits. A stopped model's
process must be gone: then every byte of it is returned, which we check by pid.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import Context, Section, Table, pid_alive, rss_mb
from bench.procs import wait_until
from bench.realmodel import DEMO_GGUF, real_model
from bench.routerctl import Router, fake_model, router_config, start_router

__all__ = ["run"]

log = logging.getLogger(__name__)

IDLE_MODEL = "fake-idle"
IDLE_TIMEOUT_S = 3.0


def _models(ctx: Context) -> dict[str, Any]:
    models: dict[str, Any] = {}
    if DEMO_GGUF.exists() and not ctx.quick:
        models["smollm2"] = real_model()
    models[IDLE_MODEL] = fake_model(idle_timeout_s=IDLE_TIMEOUT_S)
    for index in range(ctx.count(10, 3) - len(models)):
        models[f"fake-{index}"] = fake_model()
    return models


def _router_row(label: str, router: Router) -> list[object]:
    own = rss_mb(router.proc.pid)
    proc = psutil.Process(router.proc.pid)
    rss = proc.memory_info().rss / 2**20
    uss = proc.memory_full_info().uss / 2**20
    return [label, router.proc.pid, rss, uss, own[0] if own else None]


def _model_rows(router: Router, names: list[str]) -> tuple[list[list[object]], dict[str, tuple[int, float, float]]]:
    rows, seen = [], {}
    for name in names:
        pid = router.pid(name)
        figures = rss_mb(pid) if pid else None
        if pid and figures:
            seen[name] = (pid, figures[0], figures[1])
            rows.append([f"model server {name}", pid, figures[0], figures[1], None])
    return rows, seen


def _stop_and_check(router: Router, name: str, how: str) -> list[object]:
    """Stop ``name`` by ``how`` (unload | idle); [model, how, pid, seconds, process gone, available-memory delta]."""
    if how == "idle":  # one request, then nothing: the idle timer runs from the request's end
        status, _ = router.post("/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "x"}]})
        if status != 200:
            raise RuntimeError(f"{name}: request before the idle stop answered {status}")
    pid = router.pid(name)
    if pid is None:
        raise RuntimeError(f"{name} has no process to stop")
    available_before = psutil.virtual_memory().available
    start = time.perf_counter()
    if how == "unload":
        router.unload(name)
    else:
        wait_until(lambda: router.state(name) == "STOPPED", IDLE_TIMEOUT_S + 30, f"{name} idle stop", 0.05)
    wait_until(lambda: not pid_alive(pid), 30, f"pid {pid} exit", 0.02)
    seconds = time.perf_counter() - start
    freed_mb = (psutil.virtual_memory().available - available_before) / 2**20
    return [name, how, pid, seconds, not pid_alive(pid), freed_mb]


def run(ctx: Context) -> Section:
    section = Section("memory", "Memory: router and model servers, and what a stop gives back")
    tmp = ctx.section_tmp("memory")
    models = _models(ctx)
    router = start_router(ctx.procs, tmp, router_config(ctx.model_state, models), name="memory-router")
    rows = [_router_row(f"router, {len(models)} models configured, none loaded", router)]
    for name in models:  # the idle-stopping one last, so it is still up when measured
        if name != IDLE_MODEL:
            router.load(name)
    router.load(IDLE_MODEL)
    model_rows, seen = _model_rows(router, [IDLE_MODEL, *[n for n in models if n != IDLE_MODEL]])
    rows.append(_router_row(f"router, all {len(models)} loaded", router))
    rows += model_rows
    section.tables.append(Table(["process", "pid", "RSS MiB", "USS MiB", "RSS with children MiB"], rows,
                                "USS = memory unique to the process (returned to the OS when it exits)."))
    stops = []
    first_real = next((n for n in seen if n == "smollm2"), next(n for n in seen if n != IDLE_MODEL))
    stops.append([*_stop_and_check(router, IDLE_MODEL, "idle"), seen[IDLE_MODEL][2]])
    stops.append([*_stop_and_check(router, first_real, "unload"), seen[first_real][2]])
    section.tables.append(Table(
        ["model", "stopped by", "pid", "stop -> process gone s", "process gone", "system available +MiB",
         "its USS MiB"],
        stops, f"`idle` = one request, then `idle_timeout_s: {IDLE_TIMEOUT_S:g}`; the time is from the request's end. "
        "The system-wide figure is noisy (other processes allocate meanwhile); the pid check is the proof.",
    ))
    gone = all(row[4] for row in stops)
    section.notes.append(f"Stopped models gave back all their memory (process gone): {'yes' if gone else 'NO'}.")
    real = "smollm2 on OpenVINO, the others" if "smollm2" in models else "all"
    section.intro = f"{len(models)} models configured and loaded: {', '.join(models)} ({real} on the fake engine)."
    section.data = {"rows": rows, "stops": stops, "config_dir": str(Path(router.config_path).parent)}
    return section
