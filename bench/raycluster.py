"""Ray engine: cold start through a Ray cluster vs local children, and recovery after a node is lost.

A ``ray.cluster_utils.Cluster`` on 127.0.0.1 (a head and two workers advertising
``{"GPU.0": 1, "worker": 1}``, all pinned to loopback) is started in the bench process,
which does not join it; one router runs with ``engine: {kind: ray}`` (a Ray driver of its
own) and one with the local engine, on the same models: the fake engine (load 0 s: what
the engine itself costs) and the demo SmolLM2 GGUF (converted IR and cache shared with
the other real-model sections). Cold start = a streamed chat for a stopped model, from
sending to the first content delta; repetitions alternate local/ray. Node loss: the node
running a model is removed (``cluster.remove_node``) and the section times until the
router reports the model READY on another node, and until a chat is answered again.
Skipped without the ``ray`` extra (``make test-ray`` installs it).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import time
from typing import Any

import aiohttp

from bench.common import Context, Section, SectionSkipped, Table, median, ratio
from bench.procs import wait_until
from bench.realmodel import MODEL, _payload, real_model, require_model, stream_chat
from bench.routerctl import Router, fake_model, router_config, start_router

__all__ = ["run"]

log = logging.getLogger(__name__)

NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 100 * 1024**2}
WORKER = {**NODE, "resources": {"GPU.0": 1, "worker": 1}}
FAKE = "fake"


def _require_ray() -> None:
    if importlib.util.find_spec("ray") is None:
        raise SectionSkipped("the `ray` extra is not installed (`make test-ray` installs it into .venv)")


def _cold(router: Router, model: str) -> float:
    """Seconds from sending a streamed chat to a stopped ``model`` to its first content delta."""
    import uvloop

    router.unload(model)

    async def once() -> float:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            stats = await stream_chat(session, router.url + "/v1/chat/completions", _payload(model, 4))
        if stats.status != 200:
            raise RuntimeError(f"cold request to {model} answered {stats.status}")
        return float(stats.ttft_s)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(once())


def _answers(router: Router, model: str) -> bool:
    status, _ = router.post("/v1/chat/completions", {"model": model, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hi"}]}, timeout_s=60)
    return status == 200


def _node_loss(cluster: Any, router: Router) -> tuple[float, float]:
    """Remove the node running ``loss``; (s until READY on another node, s until a chat is answered)."""
    router.load("loss")
    node = router.models()["loss"]["node"]
    victim = next(n for n in cluster.worker_nodes if n.node_id.startswith(node))
    started = time.perf_counter()
    cluster.remove_node(victim)
    wait_until(lambda: (row := router.models()["loss"])["state"] == "ready" and row.get("node") not in (None, node),
               60, "loss READY on another node", interval_s=0.05)
    ready_s = time.perf_counter() - started
    wait_until(lambda: _answers(router, "loss"), 60, "loss answering")
    answered_s = time.perf_counter() - started
    cluster.add_node(**WORKER)  # whole again for the next round
    cluster.wait_for_nodes()
    return ready_s, answered_s


def run(ctx: Context) -> Section:
    _require_ray()
    require_model()
    from procman.rayengine import LOOPBACK_ENV

    os.environ.update(LOOPBACK_ENV)  # read when ray is imported: every Ray address stays on 127.0.0.1
    from ray.cluster_utils import Cluster

    section = Section("ray", "Ray engine: cold start through Ray vs local, recovery after node loss")
    tmp = ctx.section_tmp("ray")
    models = {FAKE: fake_model(), MODEL: real_model(), "loss": fake_model(placement={"resources": {"worker": 1}})}
    started = time.perf_counter()
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={**NODE, "include_dashboard": False})
    local = ray_router = None
    try:
        cluster.add_node(**WORKER)
        cluster.add_node(**WORKER)
        cluster.wait_for_nodes()
        cluster_s = time.perf_counter() - started
        local = start_router(ctx.procs, tmp / "local", router_config(ctx.model_state, models), name="ray-local")
        config = router_config(ctx.model_state, models)
        config["router"]["engine"] = {"kind": "ray", "address": cluster.address, "namespace": "ovrouter-bench"}
        ray_router = start_router(ctx.procs, tmp / "ray", config, name="ray-router")
        for router in (local, ray_router):
            router.load(MODEL)  # the first start ever converts the GGUF (not a cold start)
        cold: dict[tuple[str, str], list[float]] = {}
        for _ in range(ctx.count(5, 1)):
            for model in (FAKE, MODEL):
                for label, router in (("local", local), ("ray", ray_router)):
                    cold.setdefault((model, label), []).append(_cold(router, model))
        losses = [_node_loss(cluster, ray_router) for _ in range(ctx.count(3, 1))]
    finally:
        for router in (ray_router, local):
            if router is not None:
                ctx.procs.stop(router.proc)
        cluster.shutdown()
    rows: list[list[object]] = []
    for model in (FAKE, MODEL):
        here, there = cold[(model, "local")], cold[(model, "ray")]
        rows.append([f"{model}: local engine", median(here), min(here), max(here), 1.0])
        rows.append([f"{model}: ray engine", median(there), min(there), max(there), ratio(median(there), median(here))])
    section.tables.append(Table(["cold start, request -> first token", "median s", "min s", "max s", "x local"], rows,
                                "the same router build and models; the Ray nodes are on this machine"))
    ready, answered = [r for r, _ in losses], [a for _, a in losses]
    section.tables.append(Table(["after cluster.remove_node of the model's node", "median s", "min s", "max s"], [
        ["READY on another node", median(ready), min(ready), max(ready)],
        ["a chat answered again", median(answered), min(answered), max(answered)],
    ]))
    section.intro = (f"{len(cold[(FAKE, 'local')])} alternating repetitions per model; {len(losses)} node losses. "
                     f"Starting the 3-node cluster took {cluster_s:.1f} s (not counted).")
    section.data = {"cold_s": {f"{m}/{e}": v for (m, e), v in cold.items()}, "node_loss": losses,
                    "cluster_start_s": cluster_s}
    return section
