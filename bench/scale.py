"""Scale: 100 configured fake models (10 preloaded): start time, listing latency, a one-model reload."""

from __future__ import annotations

import http.client
import json
import logging
import time
from typing import Any
from urllib.parse import urlsplit

from bench.common import Context, Section, Table, percentile
from bench.procs import wait_until
from bench.routerctl import Router, fake_model, router_config, start_router, write_config

__all__ = ["run"]

log = logging.getLogger(__name__)

PRELOADED = 10


def _models(count: int, preloaded: int, changed: str | None = None) -> dict[str, Any]:
    models = {}
    for index in range(count):
        name = f"fake-{index:03d}"
        delay = 0.002 if name == changed else 0.0
        models[name] = fake_model(load_s=0.0, token_delay_s=delay, preload=index < preloaded)
    return models


def _latencies(router: Router, path: str, count: int) -> tuple[list[float], Any]:
    """Milliseconds of ``count`` GETs of ``path`` on one keep-alive connection; the last body."""
    parts = urlsplit(router.url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
    samples, body = [], None
    try:
        for _ in range(count):
            start = time.perf_counter()
            conn.request("GET", path)
            resp = conn.getresponse()
            raw = resp.read()
            samples.append((time.perf_counter() - start) * 1000)
            if resp.status != 200:
                raise RuntimeError(f"GET {path}: {resp.status}")
            body = json.loads(raw)
    finally:
        conn.close()
    return samples, body


def _ready_pids(router: Router) -> dict[str, int]:
    return {n: int(e["pid"]) for n, e in router.models().items() if str(e.get("state", "")).upper() == "READY"
            and e.get("pid")}


def _reload(router: Router, config: dict[str, Any], count: int, preloaded: int) -> dict[str, Any]:
    """Change one preloaded model, reload; time until it runs again with a new pid; who else changed."""
    before = _ready_pids(router)
    changed = f"fake-{min(3, preloaded - 1):03d}"
    config["models"] = _models(count, preloaded, changed=changed)
    start = time.perf_counter()  # from the write: the config watcher may apply it before our POST does
    write_config(router.config_path, config)
    status, body = router.post("/api/reload")
    answered_s = time.perf_counter() - start
    if status >= 400:
        raise RuntimeError(f"POST /api/reload: {status} {body}")
    wait_until(lambda: _ready_pids(router).get(changed, before[changed]) != before[changed], 60,
               f"{changed} restarted", 0.01)
    applied_s = time.perf_counter() - start
    after = _ready_pids(router)
    others = {n: p for n, p in before.items() if n != changed}
    kept = sum(1 for n, p in others.items() if after.get(n) == p)
    entries = router.models()
    untouched = sum(1 for n, e in entries.items() if n not in before and not e.get("pid"))
    return {"answered_s": answered_s, "applied_s": applied_s, "kept": kept, "others": len(others),
            "stopped_untouched": untouched, "stopped_total": len(entries) - len(before), "changed": changed}


def run(ctx: Context) -> Section:
    count, preloaded = ctx.count(100, 20), ctx.count(PRELOADED, 3)
    section = Section("scale", f"Scale: {count} configured models")
    tmp = ctx.section_tmp("scale")
    config = router_config(tmp / "state", _models(count, preloaded))
    router = start_router(ctx.procs, tmp, config, name="scale-router")
    preload_s = router.start_s + wait_until(lambda: len(_ready_pids(router)) >= preloaded, 120, "preloads", 0.02)
    listed, body = _latencies(router, "/v1/models", ctx.count(200, 20))
    api, _ = _latencies(router, "/api/models", ctx.count(100, 10))
    listed_count = len(body.get("data", [])) if isinstance(body, dict) else 0
    reload = _reload(router, config, count, preloaded)
    rows = [
        ["router start -> /health 200", router.start_s * 1000, None, None],
        [f"router start -> all {preloaded} preloaded READY", preload_s * 1000, None, None],
        [f"GET /v1/models ({listed_count} models listed)", percentile(listed, 50), percentile(listed, 99), len(listed)],
        ["GET /api/models", percentile(api, 50), percentile(api, 99), len(api)],
        ["config written -> POST /api/reload answered", reload["answered_s"] * 1000, None, None],
        [f"config written -> {reload['changed']} READY on a new pid", reload["applied_s"] * 1000, None, None],
    ]
    section.tables.append(Table(["figure", "ms (p50)", "p99 ms", "samples"], rows))
    section.tables.append(Table(
        ["unchanged preloaded models that kept their pid", "unchanged stopped models left stopped"],
        [[f"{reload['kept']}/{reload['others']}", f"{reload['stopped_untouched']}/{reload['stopped_total']}"]],
    ))
    section.intro = (f"{count} fake-engine models (`load_s: 0`), the first {preloaded} with `preload: true`. "
                     f"The reload rewrites the config (by rename) changing `{reload['changed']}`'s `token_delay_s`, "
                     "then calls `POST /api/reload`.")
    if listed_count != count:
        section.notes.append(f"/v1/models listed {listed_count} models, expected {count}.")
    section.data = {"reload": reload, "v1_models_ms": listed[:50]}
    return section
