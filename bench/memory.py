"""Memory: the router's RSS with 10 configured models, each model server's, and what a stop gives back;
then SmolLM2 alone, every process ovrouter keeps for it counted once per page, against llama.cpp's server.

RSS counts shared pages (Python, OpenVINO libraries) in every process; USS is the memory
unique to a process, i.e. what the OS gets back when it exits. A stopped model's
process must be gone: then every byte of it is returned, which we check by pid.

What a set of processes holds is the union of their resident pages (:mod:`bench.pages`: exact
from the page frame numbers in ``/proc/PID/pagemap``, else the sum of PSS): a page the router
and the model server both map (the Python binary, libc) is one page of RAM, as in the one
process of llama.cpp's server whose RSS is the peer's figure. The verdict (issue 24 item 3)
is on router + watchdog + SmolLM2 model server after :data:`STREAMS` streams of
:data:`STREAM_TOKENS` tokens; the spare interpreter is reported beside it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import psutil

from bench import pages
from bench.common import Context, Section, Table, pid_alive, rss_mb
from bench.procs import wait_until
from bench.realmodel import DEMO_GGUF, measure, real_model
from bench.routerctl import Router, fake_model, router_config, start_router
from procman.spawner import WATCHDOG

__all__ = ["run"]

log = logging.getLogger(__name__)

IDLE_MODEL = "fake-idle"
IDLE_TIMEOUT_S = 3.0
REAL_MODEL = "smollm2"
#: llama.cpp's server on the same GGUF, RSS after load (recorded: it is not installable here), and the target.
LLAMACPP_MIB = 263.0
TARGET_RATIO = 1.3
STREAMS = 8
STREAM_TOKENS = 64
#: Rows of the model server's breakdown by mapping (the rest summed in one row).
BREAKDOWN_ROWS = 12


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
    ctx.procs.stop(router.proc)
    if "smollm2" in models:
        _alone(ctx, section)
    else:
        section.notes.append("SmolLM2 alone (the issue's memory target) is not measured in --quick mode "
                             "or without the demo GGUF.")
    return section


def _roles(router: Router) -> dict[str, int]:
    """pid of each process ovrouter keeps for the one model: router, model server, watchdog, spare interpreter."""
    server = router.pid(REAL_MODEL)
    roles = {"router": router.proc.pid, "model server": server or 0}
    for child in psutil.Process(router.proc.pid).children():
        argv = child.cmdline()
        if child.pid == server:
            continue
        if WATCHDOG in argv:
            roles["watchdog"] = child.pid
        elif "--spare" in argv:
            roles["spare interpreter"] = child.pid
    return roles


def _spare_ready(router: Router) -> bool:
    """The router lists a spare that printed its ready line (``GET /api/status``)."""
    spares = (router.get("/api/status").get("spares") or {}).get("spares") or []
    return any(spare.get("ready") for spare in spares)


def _snapshot(roles: dict[str, int]) -> dict[str, Any]:
    kept = [pid for role, pid in roles.items() if role != "spare interpreter"]
    return {"status": {role: pages.status(pid) for role, pid in roles.items()},
            "kept": pages.union(kept), "with spare": pages.union(roles.values()),
            "breakdown": pages.breakdown(roles["model server"])}


def _alone(ctx: Context, section: Section) -> None:
    """SmolLM2 alone: union of its processes right after load and after streams; the verdict line."""
    models = {REAL_MODEL: real_model(), "fake-stopped": fake_model()}  # a stopped model: the router keeps a spare
    router = start_router(ctx.procs, ctx.section_tmp("memory-alone"), router_config(ctx.model_state, models),
                          name="memory-alone-router")
    router.load(REAL_MODEL)
    wait_until(lambda: _spare_ready(router), 60, "a spare interpreter past its imports", 0.1)
    roles = _roles(router)
    loaded = _snapshot(roles)
    measure(router.url + "/v1/chat/completions", STREAMS, 1, STREAM_TOKENS)
    streamed = _snapshot(roles)
    _alone_tables(section, roles, loaded, streamed)
    _verdict(section, streamed)
    section.data["alone"] = {
        "roles": roles, "method": streamed["kept"].method,
        **{f"{when} {key}": snap[key].mib for when, snap in (("load", loaded), ("streams", streamed))
           for key in ("kept", "with spare")},
        "breakdown": streamed["breakdown"]}
    ctx.procs.stop(router.proc)


def _alone_tables(section: Section, roles: dict[str, int], loaded: dict[str, Any], streamed: dict[str, Any]) -> None:
    rows: list[list[object]] = []
    for role, pid in roles.items():
        now, then = streamed["status"][role], loaded["status"][role]
        rows.append([role, pid, then.rss, now.rss, now.hwm, now.anon, now.file])
    for key, label in (("kept", "router + watchdog + model server"), ("with spare", "... + spare interpreter")):
        method = streamed[key].method
        rows.append([f"{label}: RSS sum", None, loaded[key].rss_sum, streamed[key].rss_sum, None, None, None])
        rows.append([f"{label}: each page once ({method})", None, loaded[key].mib, streamed[key].mib, None, None, None])
    section.tables.append(Table(
        ["SmolLM2 alone", "pid", "MiB after load", f"MiB after {STREAMS} x {STREAM_TOKENS} tokens", "VmHWM MiB",
         "anon MiB", "file MiB"], rows,
        "A router with SmolLM2 (`config.yaml`'s demo model) loaded and switched to continuous batching, and "
        "one fake model configured and stopped, for which it keeps a spare interpreter (`spare_interpreters` at its "
        "default; with every configured model running it keeps none); then streamed chats, all at once. "
        "anon / file: RssAnon / RssFile + RssShmem after the streams. Each page once: the pages of the processes "
        "together, counted by physical frame (`pagemap`), or the sum of PSS where frames are hidden (`pss`)."))
    parts = list(streamed["breakdown"].items())
    shown = [name for name, _mib in parts[:BREAKDOWN_ROWS]]
    rows = [[name, loaded["breakdown"].get(name, 0.0), streamed["breakdown"][name]] for name in shown]
    rows.append([f"{len(parts) - len(shown)} more",
                 *(sum(mib for name, mib in snap["breakdown"].items() if name not in shown)
                   for snap in (loaded, streamed))])
    section.tables.append(Table(["SmolLM2 model server RSS by mapping", "MiB after load", "MiB after streams"], rows,
                                "From /proc/PID/smaps; `package X`: files under site-packages/X."))


def _verdict(section: Section, streamed: dict[str, Any]) -> None:
    kept, spare = streamed["kept"], streamed["with spare"]
    target = TARGET_RATIO * LLAMACPP_MIB
    met = kept.mib <= target
    line = (f"Memory target (issue 24): router + watchdog + SmolLM2 model server hold {kept.mib:.0f} MiB after "
            f"{STREAMS} streams of {STREAM_TOKENS} tokens, each page once ({kept.method}; RSS sum "
            f"{kept.rss_sum:.0f}), {kept.mib / LLAMACPP_MIB:.2f}x llama.cpp's server's "
            f"{LLAMACPP_MIB:.0f} MiB (recorded, not measured side by side): "
            f"target <= {TARGET_RATIO}x = {target:.0f} MiB {'met' if met else 'MISSED'}. The spare interpreter adds "
            f"{spare.mib - kept.mib:.0f} MiB beside it (`router.spare_interpreters: 0` removes it).")
    section.notes.append(line)
    log.info("%s", line)
