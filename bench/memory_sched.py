"""Memory-aware loading vs a count: a working set larger than memory, a skewed mix of requests.

Eight fake models of unequal sizes (``fake.memory_mb``: 1200, 800, 400, 400 and four of
200 MiB; 3.5 GiB together) share a 2 GiB budget. Requests pick a model by a Zipf law
(s = 1.1) over a fixed shuffled order, from ``CLIENTS`` closed-loop clients. Two routers
serve the same mix:

- ``memory_budget: {CPU: 2GiB}`` (``min_residency_s`` 2): loads as many as fit, evicting
  the least recently used idle ones;
- ``max_loaded_models: 2``: the largest count that is safe for any pair of these models
  (1200 + 800 MiB), which is what a count has to assume without sizes.

Each cold start costs ``LOAD_S`` (the fake's load time). A request *hit* when it found
its model loaded: its latency is under half a load; *added latency* is a request's
latency minus the median latency of hits. Evictions come from ``ovrouter_evictions_total``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.common import Context, Section, Table, percentile
from bench.procs import http_get
from bench.routerctl import Router, fake_model, router_config, start_router

__all__ = ["run"]

log = logging.getLogger(__name__)

SIZES_MB = (1200, 800, 400, 400, 200, 200, 200, 200)
BUDGET = "2GiB"
MAX_LOADED = 2
LOAD_S = 0.5
CLIENTS = 4
ZIPF_S = 1.1
SEED = 14
REQUEST_TIMEOUT_S = 60.0


@dataclass(slots=True)
class Run:
    policy: str
    latencies_s: list[float] = field(default_factory=list)
    failed: dict[int, int] = field(default_factory=dict)
    evictions: float = 0.0
    seconds: float = 0.0

    def figures(self) -> dict[str, Any]:
        hits = [x for x in self.latencies_s if x < LOAD_S / 2]
        warm = percentile(hits, 50) if hits else 0.0
        added = [max(x - warm, 0.0) * 1000 for x in self.latencies_s]
        total = len(self.latencies_s) + sum(self.failed.values())
        return {
            "policy": self.policy, "requests": total, "failed": sum(self.failed.values()),
            "hit_rate": len(hits) / total if total else float("nan"),
            "evictions_per_min": self.evictions / self.seconds * 60 if self.seconds else float("nan"),
            "added_p50_ms": percentile(added, 50), "added_p99_ms": percentile(added, 99),
            "rps": total / self.seconds if self.seconds else float("nan"),
        }


def _mix(names: list[str], count: int) -> list[str]:
    rng = random.Random(SEED)
    order = names[:]
    rng.shuffle(order)
    weights = [1 / (rank + 1) ** ZIPF_S for rank in range(len(order))]
    return rng.choices(order, weights, k=count)


def _models() -> dict[str, Any]:
    models = {}
    for index, size_mb in enumerate(SIZES_MB):
        model = fake_model(load_s=LOAD_S)
        model["fake"]["memory_mb"] = size_mb
        models[f"m{index}-{size_mb}mb"] = model
    return models


def _config(ctx: Context, policy: str) -> dict[str, Any]:
    config = router_config(ctx.section_tmp(f"memsched-{policy}") / "state", _models(), {"min_residency_s": 2})
    if policy == "memory":
        config["router"]["memory_budget"] = {"CPU": BUDGET}
    else:
        config["router"]["max_loaded_models"] = MAX_LOADED
    return config


def _evictions(router: Router) -> float:
    status, body = http_get(router.url + "/metrics", timeout_s=10)
    if status != 200:
        return float("nan")
    pattern = re.compile(r"^ovrouter_evictions_total\{[^}]*\} ([0-9.e+]+)$", re.M)
    return sum(float(x) for x in pattern.findall(body.decode()))


async def _drive(url: str, plan: list[str], run: Run) -> None:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for name in plan:
        queue.put_nowait(name)

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            name = queue.get_nowait()
            body = {"model": name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
            started = time.perf_counter()
            try:
                status = (await http.post("/v1/chat/completions", json=body)).status_code
            except httpx.HTTPError:
                status = 0
            if status == 200:
                run.latencies_s.append(time.perf_counter() - started)
            else:
                run.failed[status] = run.failed.get(status, 0) + 1

    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as http:
        await asyncio.gather(*(client(http) for _ in range(CLIENTS)))


def _one(ctx: Context, policy: str, plan: list[str]) -> Run:
    router = start_router(ctx.procs, ctx.section_tmp(f"memsched-{policy}"), _config(ctx, policy), f"router-{policy}")
    run = Run(policy)
    started = time.perf_counter()
    asyncio.run(_drive(router.url, plan, run))
    run.seconds = time.perf_counter() - started
    run.evictions = _evictions(router)
    ctx.procs.stop_all()
    return run


def run(ctx: Context) -> Section:
    requests = ctx.count(400, 60)
    plan = _mix(list(_models()), requests)
    runs = [_one(ctx, policy, plan) for policy in ("memory", "count")]
    figures = [r.figures() for r in runs]
    rows = [[f["policy"], f["requests"], f["failed"], f"{f['hit_rate'] * 100:.1f}%", f"{f['evictions_per_min']:.1f}",
             f"{f['added_p50_ms']:.1f}", f"{f['added_p99_ms']:.1f}", f"{f['rps']:.1f}"] for f in figures]
    table = Table(["policy", "requests", "failed", "hit rate", "evictions/min", "added p50 ms", "added p99 ms",
                   "requests/s"], rows,
                  caption=f"{len(SIZES_MB)} models ({sum(SIZES_MB)} MiB), budget {BUDGET} vs max_loaded_models "
                          f"{MAX_LOADED}; {CLIENTS} clients, Zipf s={ZIPF_S}, cold start {LOAD_S}s")
    return Section("memory_sched", "Memory-aware loading vs max_loaded_models (skewed mix)", intro=__doc__ or "",
                   tables=[table], data={"runs": figures, "sizes_mb": list(SIZES_MB), "budget": BUDGET})
