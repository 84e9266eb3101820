"""The Ray engine: each backend process runs under one Ray actor, on the node procman's placement chose.

The engine only executes: it spawns (an actor pinned to the node, holding the backend's
``resources``, which starts the process there with the local engine's own spawner: its
own process group, ``PR_SET_PDEATHSIG`` and the group watchdog), waits for the exit,
signals, and streams the log lines back. Idle stop, cold start, fatal kill, hang
detection, backoff, blame and the budgets stay procman's decisions.

Fate-sharing: the actors are owned by the router (a Ray driver) and are not detached, so
when the router dies Ray kills them, and each process dies with its actor (its death
signal). A node that is lost, or an actor killed from outside (``ray.kill``), ends the
wait with an external kill (``-SIGKILL``): no request is blamed, and procman relaunches
the model on a node that fits.

``ray`` is an optional extra (``pip install 'ovrouter[ray]'``); nothing here imports it
until the engine is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from procman.nodes import Node
from procman.spawner import OUTPUT_DRAIN_S, LineCallback, Where

__all__ = ["ACTOR_PREFIX", "LOOPBACK_ENV", "ProcessActor", "RayHandle", "RaySpawner", "import_ray"]

log = logging.getLogger(__name__)

#: Every named actor of ovrouter starts with this (``ray list actors`` shows whose they are).
ACTOR_PREFIX = "ovrouter-"
#: Environment for a Ray that stays on this box and reports nothing home.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
#: How long one log-line poll waits on the node for a new line.
LINES_POLL_S = 1.0
#: Lines an actor keeps for the router to read (older ones are dropped if the router falls behind).
KEEP_LINES = 2000
#: A start the cluster cannot place on the chosen node within this fails (a resource still held there).
START_TIMEOUT_S = 60.0
#: An actor that stays unreachable this long (its node not yet declared dead) is taken as lost.
UNAVAILABLE_S = 10.0


def import_ray() -> Any:
    """The ``ray`` module, or an ImportError that says how to install it."""
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    try:
        import ray
    except ImportError as exc:
        raise ImportError("router.engine kind 'ray' needs Ray: pip install 'ovrouter[ray]'") from exc
    return ray


class ProcessActor:
    """Runs on a node, one per backend process (wrapped with ``ray.remote`` by :class:`RaySpawner`)."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._first = 0  # the index of _lines[0] among every line the process printed
        self._exit: asyncio.Future[int] | None = None
        self._handle: Any = None
        self._new: asyncio.Event | None = None

    async def start(self, argv: list[str], env: dict[str, str], cwd: str | None, router_python: str) -> int:
        """Start the process (the router's Python becomes this node's); its pid."""
        from procman.spawner import SubprocessSpawner

        if argv and argv[0] == router_python:
            argv = [sys.executable, *argv[1:]]
        self._new = asyncio.Event()
        workdir = cwd if cwd is not None and os.path.isdir(cwd) else None
        self._handle = await SubprocessSpawner().spawn(argv, {**os.environ, **env}, workdir, self._line)
        self._exit = asyncio.ensure_future(self._handle.wait())
        self._exit.add_done_callback(lambda _: self._wake())
        return int(self._handle.pid)

    def _line(self, text: str) -> None:
        self._lines.append(text)
        if len(self._lines) > KEEP_LINES:
            drop = len(self._lines) - KEEP_LINES // 2
            del self._lines[:drop]
            self._first += drop
        self._wake()

    def _wake(self) -> None:
        if self._new is not None:
            self._new.set()
            self._new = asyncio.Event()

    async def lines(self, cursor: int) -> tuple[int, list[str], bool]:
        """Lines from ``cursor`` on (waiting up to LINES_POLL_S for one), the next cursor, and whether it exited."""
        assert self._exit is not None and self._new is not None
        if cursor >= self._first + len(self._lines) and not self._exit.done():
            waiter = asyncio.ensure_future(self._new.wait())
            await asyncio.wait({waiter}, timeout=LINES_POLL_S)
            waiter.cancel()
        lines = self._lines[max(cursor - self._first, 0):]
        return self._first + len(self._lines), lines, self._exit.done() and not lines

    async def wait(self) -> int:
        assert self._exit is not None
        return await asyncio.shield(self._exit)

    def signal(self, sig: int) -> None:
        if self._handle is not None:
            self._handle.signal_group(sig)


class RaySpawner:
    """Spawns each process under a Ray actor on ``where.node`` (see the module doc).

    ``address``: the cluster (``auto``, ``host:port``); the router connects as a driver on
    first use, unless this process is a driver already. ``namespace``: where the actors live.
    """

    def __init__(self, address: str | None = "auto", namespace: str = "ovrouter") -> None:
        self.address = address
        self.namespace = namespace
        self._actor_class: Any = None
        self._count = 0
        self._connecting: asyncio.Lock | None = None

    async def connect(self) -> Any:
        """Join the cluster (once); the ``ray`` module."""
        ray = import_ray()
        self._connecting = self._connecting or asyncio.Lock()
        async with self._connecting:
            if not ray.is_initialized():
                await asyncio.to_thread(
                    ray.init, address=self.address, namespace=self.namespace, log_to_driver=False,
                    configure_logging=False,
                )
            if self._actor_class is None:
                self._actor_class = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(ProcessActor)
        return ray

    async def nodes(self) -> Sequence[Node]:
        """The cluster's nodes now (dead ones included, marked so)."""
        ray = await self.connect()
        return [_node(raw) for raw in await asyncio.to_thread(ray.nodes)]

    async def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, on_line: LineCallback,
        where: Where | None = None,
    ) -> RayHandle:
        """Start ``argv`` on ``where.node``; OSError when Ray cannot place or start it there."""
        if where is None:
            raise OSError("the Ray engine runs a process only where procman's placement put it (no node given)")
        ray = await self.connect()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._count += 1
        actor = self._actor_class.options(
            name=f"{ACTOR_PREFIX}{where.name}-{self._count}", namespace=self.namespace, **_ray_resources(where),
            scheduling_strategy=NodeAffinitySchedulingStrategy(where.node, soft=False),
        ).remote()
        try:
            pid = await asyncio.wait_for(actor.start.remote(list(argv), dict(env), cwd, sys.executable),
                                         START_TIMEOUT_S)
        except BaseException as exc:
            _kill(ray, actor)
            if isinstance(exc, TimeoutError | ray.exceptions.RayError):
                raise OSError(f"Ray did not start it on node {where.node_name}: {_first_line(exc)}") from None
            raise
        return RayHandle(ray, actor, int(pid), where, on_line)


class RayHandle:
    """A process under a Ray actor, as procman sees it (:class:`procman.spawner.ProcessHandle`)."""

    def __init__(self, ray: Any, actor: Any, pid: int, where: Where, on_line: LineCallback) -> None:
        self._ray = ray
        self._actor = actor
        self._pid = pid
        self.where = where
        self._returncode: int | None = None
        self._killed = False  # ovrouter killed the actor itself (a SIGKILL of the process)
        self.lost = False  # the actor or its node went away without ovrouter asking: not the process's fault
        self._pump = asyncio.get_running_loop().create_task(self._pump_lines(on_line))

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._returncode

    async def wait(self) -> int:
        """The exit code; ``-SIGKILL`` when the actor or its node is gone (an external kill)."""
        code = await self._exit_code()
        self._returncode = code
        if not self._pump.done():
            await asyncio.wait({self._pump}, timeout=OUTPUT_DRAIN_S)
            self._pump.cancel()
        _kill(self._ray, self._actor)  # its resources are free for the next process
        return code

    async def _exit_code(self) -> int:
        exceptions = self._ray.exceptions
        unreachable_since: float | None = None
        while True:
            try:
                return int(await self._actor.wait.remote())
            except exceptions.ActorUnavailableError:
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > UNAVAILABLE_S:
                    log.warning("%s pid=%d: node %s unreachable for %gs; taken as lost", self.where.name, self._pid,
                                self.where.node_name, UNAVAILABLE_S)
                    self.lost = not self._killed
                    return -signal.SIGKILL
                await asyncio.sleep(0.5)
            except exceptions.RayError as exc:  # ActorDiedError: ray.kill, or its node is gone
                if not self._killed:
                    self.lost = True
                    log.warning("%s pid=%d on node %s: its actor is gone (%s)", self.where.name, self._pid,
                                self.where.node_name, _first_line(exc))
                return -signal.SIGKILL

    def signal_group(self, sig: int) -> None:
        if self._returncode is not None:
            return
        self._actor.signal.remote(sig)  # fire and forget: a gone actor is no error here
        if sig == signal.SIGKILL:
            self._killed = True
            _kill(self._ray, self._actor)  # an unreachable node cannot deliver it: the actor's death does

    async def _pump_lines(self, on_line: LineCallback) -> None:
        cursor = 0
        while True:
            try:
                cursor, lines, done = await self._actor.lines.remote(cursor)
            except self._ray.exceptions.RayError:
                return
            for line in lines:
                try:
                    on_line(line)
                except Exception:
                    log.exception("log line callback failed")
            if done:
                return


#: Resources Ray takes only as their own options (``resources=`` refuses them).
_OPTION_OF = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory"}


def _ray_resources(where: Where) -> dict[str, Any]:
    """``placement.resources`` as actor options: ``CPU``/``GPU``/``memory`` by their own keywords, the rest custom."""
    options: dict[str, Any] = {"resources": {k: v for k, v in where.resources.items() if k not in _OPTION_OF}}
    options.update({_OPTION_OF[k]: v for k, v in where.resources.items() if k in _OPTION_OF})
    return options


def _node(raw: Mapping[str, Any]) -> Node:
    resources = {k: float(v) for k, v in (raw.get("Resources") or {}).items() if not k.startswith("node:")}
    return Node(id=str(raw["NodeID"]), name=str(raw["NodeID"])[:8], ip=str(raw.get("NodeManagerAddress", "")),
                resources=resources, alive=bool(raw.get("Alive")))


def _kill(ray: Any, actor: Any) -> None:
    with contextlib.suppress(Exception):
        ray.kill(actor, no_restart=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
