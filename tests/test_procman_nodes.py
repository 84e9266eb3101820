"""Placement across nodes (:func:`procman.nodes.choose_node`, pure) and the bearer token of a process on a node."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from modelserver.spec import ModelSpec
from procman.address import Address
from procman.nodes import Node, Seat, choose_node
from procman.placement import Holder
from procman.prober import HttpProber
from procman.process import TOKEN_ENV, child_command
from procman.spec import BackendSpec
from router.edge.upstream import UpstreamPool
from tests.modelserver_helpers import amodelserver

GIB = 1024**3
N1 = Node("aaaaaaaa11", "aaaaaaaa", "127.0.0.1", {"GPU.0": 1.0, "CPU": 1.0})
N2 = Node("bbbbbbbb22", "bbbbbbbb", "127.0.0.1", {"GPU.0": 1.0, "CPU": 1.0})
GPU = {"GPU.0": 1.0}


def seat(node: Node, name: str, *, idle: bool = True, last_used: float = 0.0, size: int = 0,
         resources: dict[str, float] | None = None, going: bool = False) -> Seat:
    holder = Holder(name, "CPU", size, idle=idle, last_used=last_used, going=going)
    return Seat(node.id, holder, GPU if resources is None else resources)


def choose(seats: list[Seat], resources: dict[str, float] = GPU, budgets: dict[str, int] | None = None,
           size: int = 0, **kw: object):  # type: ignore[no-untyped-def]
    return choose_node("t", "CPU", size, resources, [N1, N2], seats, budgets or {}, 100.0, **kw)  # type: ignore[arg-type]


def test_fits_on_the_node_whose_resource_is_free() -> None:
    choice = choose([seat(N1, "a")])
    assert choice.node == N2 and choice.placement.fits


def test_no_free_resource_stops_the_least_recently_used_idle_holder() -> None:
    choice = choose([seat(N1, "a", last_used=50), seat(N2, "b", last_used=10)])
    assert choice.node == N2 and choice.placement.stop == ("b",) and not choice.placement.fits


def test_a_busy_holder_is_never_stopped() -> None:
    choice = choose([seat(N1, "a", idle=False), seat(N2, "b", idle=False)])
    assert choice.placement.wait == "busy" and not choice.placement.stop


def test_a_node_already_freeing_room_is_preferred_over_stopping_another_model() -> None:
    choice = choose([seat(N1, "a", last_used=99), seat(N2, "b", last_used=1, going=True)])
    assert choice.node == N2 and choice.placement.wait == "stopping" and not choice.placement.stop


def test_memory_budgets_apply_to_each_node() -> None:
    seats = [seat(N1, "a", size=GIB, resources={}, idle=False)]
    choice = choose(seats, resources={}, budgets={"CPU": GIB}, size=GIB // 2)
    assert choice.node == N2 and choice.placement.fits


def test_no_node_with_the_resource_is_a_clear_never() -> None:
    choice = choose([], resources={"GPU.7": 1})
    assert choice.node is None and "no live node advertises {GPU.7: 1}" in (choice.placement.never or "")


def test_a_pinned_node_that_is_gone_is_named() -> None:
    dead = Node("cccccccc33", "cccccccc", "10.0.0.3", alive=False)
    choice = choose_node("t", None, 0, {}, [N1, dead], [], {}, 0.0, pin="cccccccc")
    assert choice.node is None and "placement.node 'cccccccc' is not a live node" in (choice.placement.never or "")
    assert choose_node("t", None, 0, {}, [N1, N2], [], {}, 0.0, pin="bbbbbbbb22").node == N2


def test_a_process_on_a_node_gets_its_own_environment_and_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROUTER_SECRET", "x")
    spec = BackendSpec("m", argv=("serve", "--port", "${PORT}"), env={"A": "1"}, transport="tcp")
    argv, env = child_command(spec, Address("tcp", host="10.0.0.2", port=9, token="tok"), inherit=False)
    assert argv == ["serve", "--port", "9"] and env[TOKEN_ENV] == "tok" and env["A"] == "1"
    assert "ROUTER_SECRET" not in env
    assert "ROUTER_SECRET" in child_command(spec, Address("tcp", port=9))[1]  # a local child: as before
    assert "tok" not in repr(Address("tcp", port=9, token="tok"))


async def test_a_model_server_given_a_token_requires_it_on_every_endpoint(tmp_path: Path) -> None:
    spec = ModelSpec(name="m", engine="fake", task="llm")
    async with amodelserver(spec=spec, env={TOKEN_ENV: "s3cret"}, wait=False) as server:
        address = Address("tcp", port=int(server.base_url.rsplit(":", 1)[1]), token="s3cret")
        prober = HttpProber()
        for _ in range(600):
            if await prober.probe(address, "/health", 2):
                break
            await asyncio.sleep(0.1)
        assert await prober.probe(address, "/health", 2)
        assert not await prober.probe(Address("tcp", port=address.port), "/health", 2)
        async with httpx.AsyncClient(base_url=server.base_url) as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            for path in ("/health", "/v1/models"):
                refused = await client.get(path)
                assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
                assert refused.json()["error"]["type"] == "authentication_error"
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 401
            wrong = await client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer s3cre"})
            assert wrong.status_code == 401
        pool = UpstreamPool()  # the router's client sends the token of the address
        try:
            reply = await pool.request(address, "POST", "/v1/chat/completions",
                                       [("content-type", "application/json")],
                                       b'{"model":"m","messages":[{"role":"user","content":"hi"}]}', 30)
            assert reply.status == 200 and b"hi" in await reply.read()
            reply.close()
        finally:
            await pool.close()


def test_a_node_whose_device_is_unhealthy_is_avoided() -> None:
    assert choose([], avoid={"aaaaaaaa"}).node == N2
    choice = choose([], avoid={"aaaaaaaa", "bbbbbbbb"})
    assert choice.node is None and "unhealthy on every node that could run it" in (choice.placement.never or "")


def test_device_health_is_kept_per_node() -> None:
    from router.state.devices import DeviceHealth

    health = DeviceHealth(threshold=2)
    health.record_fatal("aaaaaaaa/GPU.0", "m1")
    assert health.record_fatal("aaaaaaaa/GPU.0", "m2") is not None
    health.record_fatal("bbbbbbbb/GPU.0", "m3")
    assert health.unhealthy_nodes("gpu.0") == {"aaaaaaaa"} and health.unhealthy("GPU.0") is None


def test_ray_takes_cpu_gpu_and_memory_as_their_own_options() -> None:
    from procman.rayengine import _ray_resources
    from procman.spawner import Where

    where = Where("m", "n", "127.0.0.1", {"GPU.0": 1, "CPU": 2, "GPU": 1})
    assert _ray_resources(where) == {"resources": {"GPU.0": 1}, "num_cpus": 2, "num_gpus": 1}
