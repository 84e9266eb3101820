"""The Ray engine on a real Ray cluster on 127.0.0.1 (a head and two workers advertising {"GPU.0": 1}).

Run by ``make test-ray`` (which installs the ``ray`` extra and sets OVROUTER_TEST_RAY=1);
skipped elsewhere, so ``make test`` neither needs Ray nor pays for its start. One cluster
serves the module (starting one takes ~10 s); after every test no model-server process
and no ovrouter actor may be left, and after the module no Ray process either.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from procman.rayengine import ACTOR_PREFIX, LOOPBACK_ENV
from tests.modelserver_helpers import free_port
from tests.router_helpers import RunningRouter, fake_model, running_router, write_config

if not os.environ.get("OVROUTER_TEST_RAY"):
    pytest.skip("Ray tests run with `make test-ray` (OVROUTER_TEST_RAY=1)", allow_module_level=True)
os.environ.update(LOOPBACK_ENV)  # read when ray is imported: every Ray address stays 127.0.0.1
ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.slow

NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 100 * 1024**2}
WORKER = {**NODE, "resources": {"GPU.0": 1, "worker": 1}}
RAY_DAEMONS = ("raylet", "gcs_server", "ray::", "default_worker.py", "ray/dashboard", "log_monitor.py",
               "monitor.py", "runtime_env/agent")


def _ray_processes() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            line = " ".join(proc.info["cmdline"] or [])
            if any(d in line for d in RAY_DAEMONS) and proc.pid != os.getpid() and _ours(proc):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _ours(proc: psutil.Process) -> bool:
    """A process of this test session's cluster (other engineers may run Ray on the same box)."""
    try:
        return bool(proc.info.get("environ") and proc.info["environ"].get("OVROUTER_TEST_RAY_SESSION")
                    == str(os.getpid()))
    except (psutil.Error, AttributeError):
        return False


def _model_servers(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            line = " ".join(proc.info["cmdline"] or [])
            env = proc.info.get("environ") or {}
            if "-m modelserver" in line and env.get("OVROUTER_TEST_RAY_SESSION") == tag:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _our_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(ACTOR_PREFIX)]


def _wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g}s: {what}")
        time.sleep(0.1)


async def _await_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g}s: {what}")
        await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    os.environ["OVROUTER_TEST_RAY_SESSION"] = str(os.getpid())  # marks this session's Ray and model processes
    head = {**NODE, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, connect=True, head_node_args=head)
    try:
        cluster.add_node(**WORKER)
        cluster.add_node(**WORKER)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        _wait_for(lambda: not _ray_processes(), 30, "every Ray process (raylet, gcs_server, workers) gone")


@pytest.fixture(autouse=True)
def no_leaked_children(cluster: Cluster) -> Iterator[None]:
    """Replaces the suite's leak check here: Ray keeps its own workers while the cluster lives; what a
    test starts (model servers, ovrouter actors) must be gone when it ends."""
    yield
    tag = os.environ["OVROUTER_TEST_RAY_SESSION"]
    _wait_for(lambda: not _model_servers(tag), 30, "every model-server process gone")
    _wait_for(lambda: not _our_actors(), 30, "every ovrouter actor gone")


def _config(tmp_path: Path, cluster: Cluster, models: dict[str, Any], **router: Any) -> Path:
    engine = {"kind": "ray", "address": cluster.address, "namespace": "ovrouter-test"}
    defaults = {"min_residency_s": 0, "idle_timeout_s": 0}
    return write_config(tmp_path, models, router={"engine": engine, **router}, defaults=defaults)


def _gpu_model(**extra: Any) -> dict[str, Any]:
    return fake_model(placement={"resources": {"GPU.0": 1}}, **extra)


async def _chat(router: RunningRouter, model: str, text: str = "hello there") -> httpx.Response:
    return await router.client.post("/v1/chat/completions",
                                    json={"model": model, "messages": [{"role": "user", "content": text}]})


def _rows(router: RunningRouter) -> dict[str, dict[str, Any]]:
    return {name: model.backend.snapshot() for name, model in router.service.registry.models.items()}


async def test_two_gpu_models_land_on_different_nodes_and_a_third_evicts_the_lru(cluster: Cluster,
                                                                                  tmp_path: Path) -> None:
    models = {"a": _gpu_model(), "b": _gpu_model(), "c": _gpu_model()}
    async with running_router(_config(tmp_path, cluster, models)) as router:
        assert (await _chat(router, "a")).status_code == 200
        assert (await _chat(router, "b")).status_code == 200
        rows = _rows(router)
        assert rows["a"]["node"] and rows["b"]["node"] and rows["a"]["node"] != rows["b"]["node"]
        assert rows["a"]["address"].startswith("http://127.0.0.1:")
        assert (await _chat(router, "a")).status_code == 200  # b is now the least recently used
        reply = await _chat(router, "c")
        assert reply.status_code == 200, reply.text
        assert "hello there" in reply.json()["choices"][0]["message"]["content"]
        rows = _rows(router)
        assert rows["b"]["state"] == "stopped" and rows["a"]["state"] == "ready" and rows["c"]["state"] == "ready"
        assert rows["c"]["node"] != rows["a"]["node"]
        listed = (await router.client.get("/api/models")).json()
        assert {m["name"]: m.get("node") for m in listed["models"]}["c"] == rows["c"]["node"]


async def test_a_fatal_error_relaunches_that_model_and_leaves_the_others(cluster: Cluster, tmp_path: Path) -> None:
    models = {"a": _gpu_model(), "b": _gpu_model()}
    async with running_router(_config(tmp_path, cluster, models)) as router:
        for name in models:
            assert (await _chat(router, name)).status_code == 200
        before = {name: router.backend(name).pid for name in models}
        await _chat(router, "a", "boom [[fatal]]")
        await _await_for(lambda: router.backend("a").pid not in (None, before["a"])
                         and router.backend("a").state.value == "ready", 5, "a relaunched with a new pid")
        assert router.backend("b").pid == before["b"]
        assert (await _chat(router, "a")).status_code == 200


async def test_ray_kill_of_an_actor_is_an_external_kill(cluster: Cluster, tmp_path: Path) -> None:
    async with running_router(_config(tmp_path, cluster, {"a": _gpu_model()})) as router:
        assert (await _chat(router, "a")).status_code == 200
        old = router.backend("a").pid
        (name,) = _our_actors()
        ray.kill(ray.get_actor(name, namespace="ovrouter-test"))
        await _await_for(lambda: router.backend("a").pid != old, 20, "a relaunched")
        reply = await _chat(router, "a")
        assert reply.status_code == 200, reply.text
        row = router.backend("a").snapshot()
        assert row["retry_after_s"] in (None, 0) and row["restarts"] >= 1
        assert row["failures"] == 0  # an external kill: no failure counted, so no backoff on the next one either
        old = router.backend("a").pid
        (name,) = _our_actors()
        ray.kill(ray.get_actor(name, namespace="ovrouter-test"))  # twice in a row: still relaunched at once
        await _await_for(lambda: router.backend("a").pid != old, 20, "a relaunched again")
        assert (await _chat(router, "a")).status_code == 200 and router.backend("a").snapshot()["failures"] == 0


async def test_a_removed_node_relaunches_its_models_on_the_other(cluster: Cluster, tmp_path: Path) -> None:
    models = {"x": fake_model(placement={"resources": {"worker": 1}})}
    async with running_router(_config(tmp_path, cluster, models)) as router:
        loaded = await router.client.post("/api/models/x/load")  # the management API's start, as well as a chat's
        assert loaded.status_code == 200, loaded.text
        node = router.service.registry.manager.node_of(router.backend("x"))
        assert node is not None
        (victim,) = [n for n in cluster.worker_nodes if n.node_id == node.id]
        started = time.monotonic()
        await asyncio.to_thread(cluster.remove_node, victim)
        await _await_for(lambda: router.backend("x").state.value == "ready"
                         and router.backend("x").snapshot()["node"] not in (None, node.name), 10,
                         "x ready on the other node")
        print(f"relaunched on the other node {time.monotonic() - started:.2f}s after remove_node")
        assert (await _chat(router, "x")).status_code == 200
    cluster.add_node(**WORKER)  # whole again for the next test
    cluster.wait_for_nodes()


async def test_idle_stop_ends_the_actor_and_the_next_request_cold_starts(cluster: Cluster, tmp_path: Path) -> None:
    async with running_router(_config(tmp_path, cluster, {"a": _gpu_model(idle_timeout_s=2)})) as router:
        assert (await _chat(router, "a")).status_code == 200
        first = router.backend("a").pid
        await _await_for(lambda: not _our_actors(), 8, "the actor gone after idle_timeout_s 2")
        assert router.backend("a").state.value == "stopped"
        assert (await _chat(router, "a")).status_code == 200
        assert router.backend("a").pid != first


async def test_the_bearer_token_is_required_on_tcp(cluster: Cluster, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVROUTER_ROUTER_ONLY", "1")  # the router's, not the model's
    async with running_router(_config(tmp_path, cluster, {"a": _gpu_model()})) as router:
        assert (await _chat(router, "a")).status_code == 200
        address = router.backend("a").address
        assert address.kind == "tcp" and address.token
        async with httpx.AsyncClient(base_url=address.base_url) as direct:
            refused = await direct.get("/health")
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_token"
            assert (await direct.get("/v1/models", headers={"Authorization": "Bearer nope"})).status_code == 401
            ok = await direct.get("/health", headers={"Authorization": f"Bearer {address.token}"})
            assert ok.status_code == 200
        env = _model_servers(os.environ["OVROUTER_TEST_RAY_SESSION"])[0].environ()
        assert "OVROUTER_ROUTER_ONLY" not in env  # the model's environment, not the router's


def test_a_sigkilled_router_takes_its_model_processes_and_actors_with_it(cluster: Cluster, tmp_path: Path) -> None:
    path = _config(tmp_path, cluster, {"a": _gpu_model(), "b": _gpu_model()})
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = (tmp_path / "router.log").open("wb")
    router = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", "--config", str(path), "--port", str(port)],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: _answers(url + "/health"), 60, "the router listening")
        for name in ("a", "b"):
            body = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
            assert httpx.post(url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        tag = os.environ["OVROUTER_TEST_RAY_SESSION"]
        assert len(_model_servers(tag)) == 2 and len(_our_actors()) == 2
        router.send_signal(signal.SIGKILL)
        router.wait(10)
        started = time.monotonic()
        _wait_for(lambda: not _model_servers(tag) and not _our_actors(), 5, "no model server and no actor left")
        print(f"model servers and actors gone {time.monotonic() - started:.2f}s after the router's SIGKILL")
    finally:
        if router.poll() is None:
            router.kill()
            router.wait(10)
        log.close()


async def test_a_model_file_missing_on_the_node_is_a_one_line_503_naming_it(cluster: Cluster, tmp_path: Path) -> None:
    models = {"m": {"task": "llm", "path": str(tmp_path / "absent.gguf"), "placement": {"resources": {"GPU.0": 1}}}}
    async with running_router(_config(tmp_path, cluster, models)) as router:
        reply = await _chat(router, "m")
        assert reply.status_code == 503, reply.text
        message = reply.json()["error"]["message"]
        assert "\n" not in message and "on node " in message and "absent.gguf" in message, message
