"""Which models stay loaded: memory claims, measured sizes, evictions and rolling changes.

One :class:`Residency` per :class:`~router.state.registry.Registry`. It tells procman's
ProcessManager what each model takes on which device (:meth:`claim`: size from the
:class:`~router.state.sizes.SizeStore`, ``pin``, ``min_residency_s``) and what each device
allows (:meth:`budgets`, from ``router.memory_budget``); the manager's ``make_room``
does the rest. It also keeps what the operator sees: the last eviction of each model
and its reason, the memory gauges, the ``evict`` and ``rolling`` events.

A *rolling* change (a reload that changes what a loaded model's process runs, or
``POST /api/models/{name}/restart``) starts the new process beside the old one when the
model's ``restart`` is ``rolling`` and the budget (and counts) allow both; new requests
go to it once it is READY, and the old one finishes its in-flight requests and stops. A
new process that fails leaves the old one serving, with the reason in ``rolling_error``.
Otherwise the change is stop-first (procman's ``update`` / ``restart``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from modelserver.spec import ModelSpec
from procman import Backend, BackendSpec, Evicted, State, Transition
from procman.placement import Claim
from router.state.memwatch import MemoryWatch, budgets_now
from router.state.model import Fleet, Model
from router.state.sizes import SizeStore

__all__ = ["Residency"]

log = logging.getLogger(__name__)

Publish = Callable[[str, Mapping[str, Any]], Any]


class Residency:
    def __init__(self, registry: Fleet) -> None:
        self.registry = registry
        self.store = SizeStore(Path(registry.config.router.state_dir) / "memory.json")
        self.watch = MemoryWatch(self.store, self._loaded)
        self.evictions: dict[str, dict[str, Any]] = {}  # model -> its last eviction
        self.rolling_errors: dict[str, str] = {}
        self.publish: Publish | None = None  # the router's event bus, once it exists
        self._task: asyncio.Task[None] | None = None
        self._changing: dict[str, asyncio.Lock] = {}  # one change of a model at a time
        self._retiring: set[asyncio.Task[None]] = set()  # old backends of rolling changes, draining
        registry.manager.subscribe(Evicted, self._evicted)
        registry.manager.subscribe(Transition, self._transition)

    # -- what procman's make_room reads ----------------------------------------------------------

    def claim(self, name: str) -> Claim:
        model = self.registry.models.get(name)
        if model is None:
            return Claim()
        size = self.store.size_of(model.spec)
        return Claim(size.device, size.bytes, model.spec.pin, model.spec.min_residency_s)

    def budgets(self) -> dict[str, int]:
        specs = (m.spec for m in self.registry.models.values())
        return budgets_now(self.registry.config.router.memory_budget, specs, self.store)

    def _loaded(self) -> Iterator[tuple[ModelSpec, Backend]]:
        return ((m.spec, m.backend) for m in list(self.registry.models.values()))

    # -- running --------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.watch.run(), name="memory watch")

    async def stop(self) -> None:
        """Stop measuring; the manager's shutdown stops the processes (retiring ones included)."""
        tasks = [*self._retiring, *([self._task] if self._task is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None

    def forget(self, name: str) -> None:
        self.watch.forget(name)
        self.evictions.pop(name, None)
        self.rolling_errors.pop(name, None)
        self._changing.pop(name, None)

    # -- what the operator sees -----------------------------------------------------------------

    def row(self, name: str) -> dict[str, Any]:
        """The memory fields of a model's ``/api/models`` row."""
        model = self.registry.models[name]
        size = self.store.size_of(model.spec)
        figures = self.registry.manager.memory().get(size.device or "", {})
        return {
            "memory": {**size.as_dict(), "budget_bytes": figures.get("budget_bytes"),
                       "device_used_bytes": figures.get("used_bytes"), "pin": model.spec.pin,
                       "min_residency_s": model.spec.min_residency_s, "restart": model.spec.restart,
                       "reported": self.watch.reports.get(name)},
            "last_eviction": self.evictions.get(name),
            "rolling_error": self.rolling_errors.get(name),
        }

    def _evicted(self, news: Evicted) -> None:
        size = self.claim(news.name)
        record = {"reason": news.reason, "for": news.target, "at": time.time(), "device": size.device,
                  "size_bytes": size.size_bytes, "budget_bytes": self.budgets().get(size.device or "")}
        self.evictions[news.name] = record
        self.registry.metrics.evictions.labels(news.reason).inc()
        self._publish("evict", {"model": news.name, **record})

    def _transition(self, news: Transition) -> None:
        if news.new is State.READY and self.registry.is_current(news.name, news.generation):
            self.watch.wake()  # measure a fresh process at once
        self.update_gauges()

    def update_gauges(self) -> None:
        metrics = self.registry.metrics
        for device, figures in self.registry.manager.memory().items():
            metrics.memory_budget.labels(device).set(figures["budget_bytes"])
            metrics.memory_used.labels(device).set(figures["used_bytes"])
        for name, model in self.registry.models.items():
            metrics.model_memory.labels(name).set(self.store.size_of(model.spec).bytes)

    def _publish(self, kind: str, data: Mapping[str, Any]) -> None:
        if self.publish is not None:
            self.publish(kind, data)

    # -- changes of a loaded model -----------------------------------------------------------------

    async def change(self, model: Model, spec: BackendSpec) -> None:
        """Apply a changed process spec: rolling where it may, else stop-first (procman's update)."""
        async with self._lock(model):
            if self._may_roll(model):
                retired = await self._roll(model, spec, "reload")
            else:
                retired = None
                await model.backend.update(spec)
        self._retire(retired)

    async def restart(self, model: Model) -> None:
        """``POST /api/models/{name}/restart``: rolling where it may, else stop-first."""
        async with self._lock(model):
            if self._may_roll(model):
                retired = await self._roll(model, model.backend.spec, "manual")
            else:
                retired = None
                await model.backend.restart("manual")
        self._retire(retired)

    def _retire(self, old: Backend | None) -> None:
        """Drain and stop a replaced backend in the background: neither the next change nor the caller waits."""
        if old is not None:
            task = asyncio.create_task(old.close(drain=True), name=f"retire {old.name}")
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    def _lock(self, model: Model) -> asyncio.Lock:
        return self._changing.setdefault(model.spec.name, asyncio.Lock())

    def _may_roll(self, model: Model) -> bool:
        name = model.spec.name
        if model.spec.restart != "rolling" or model.backend.state is not State.READY or model.spec.url is not None:
            return False
        if self.registry.manager.can_roll(name, self.registry.scopes(name)):
            return True
        log.info("%s: not enough room for a second process; the change is stop-first", name)
        return False

    async def _roll(self, model: Model, spec: BackendSpec, reason: str) -> Backend | None:
        """Start ``spec`` beside the current process and switch to it; the old backend (to close), or None."""
        name, old, manager = model.spec.name, model.backend, self.registry.manager
        successor = manager.successor(name, spec)
        log.info("%s: rolling %s: starting a new process beside pid=%s", name, reason, old.pid)
        self._publish("rolling", {"model": name, "phase": "starting", "reason": reason, "old_pid": old.pid})
        await successor.restart(reason)  # a start from no process, its reason the change's; settles READY or not
        if successor.state is not State.READY:
            error = successor.last_error or f"it ended {successor.state.value}"
            self.rolling_errors[name] = f"the new process failed to start; the old one keeps serving: {error}"
            log.warning("%s: %s", name, self.rolling_errors[name])
            self._publish("rolling", {"model": name, "phase": "failed", "reason": reason, "error": error})
            await manager.drop_successor(name)
            return None
        stopped = old.state is State.STOPPED or (old.state is State.STOPPING and old.counters.then == "stop")
        if self.registry.models.get(name) is not model or model.backend is not old or stopped:
            await manager.drop_successor(name)  # removed, replaced or stopped meanwhile: the new process is not wanted
            if stopped and model.backend is old:
                await old.update(spec)  # the next start runs the new spec
            return None
        manager.promote(name, restart_reason=reason if reason == "manual" else None)
        self.registry.bind(model, successor)
        self.rolling_errors.pop(name, None)
        log.info("%s: requests now go to pid=%s; pid=%s drains and stops", name, successor.pid, old.pid)
        self._publish("rolling", {"model": name, "phase": "switched", "reason": reason, "old_pid": old.pid,
                                  "pid": successor.pid})
        self._publish("state", {"model": name, "state": successor.state.value, "old": old.state.value,
                                "pid": successor.pid, "reason": f"restart:{reason}", "last_error": None,
                                "started_at": successor.started_at, "at": time.time()})  # the dashboard's new pid
        return old
