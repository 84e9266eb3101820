"""Which models stay loaded: memory claims, measured sizes, evictions and rolling changes.

One :class:`Residency` per :class:`~router.state.registry.Registry`. It tells procman's
ProcessManager what each model takes on which device (:meth:`claim`: size from the
:class:`~router.state.sizes.SizeStore`, ``pin``, ``min_residency_s``) and what each device
allows (:meth:`budgets`, from ``router.memory_budget``); the manager's ``make_room``
does the rest. It also keeps what the operator sees: the last eviction of each model
and its reason, the memory gauges, the ``evict`` and ``rolling`` events.

A *rolling* change (a reload that changes what a loaded model's process runs, or
``POST /api/models/{name}/restart``) is procman's: ``backend.replace(spec, rolling=...)``
starts the new process beside the old one when the model's ``restart`` is ``rolling`` and
the budget (and counts) allow both; new requests go to it once it is READY, and the old
one finishes its in-flight requests and stops. A new process that fails leaves the old
one serving; this module hears procman's ``Rolled`` notices and keeps the reason in
``rolling_error``, and publishes the ``rolling`` events. Otherwise the change is stop-first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from modelserver.spec import ModelSpec
from procman import Backend, BackendSpec, Evicted, Rolled, State, Transition
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
        registry.manager.subscribe(Evicted, self._evicted)
        registry.manager.subscribe(Transition, self._transition)
        registry.manager.subscribe(Rolled, self._rolled)

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
        """Stop measuring; the manager's shutdown stops the processes (a replacement's included)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    def forget(self, name: str) -> None:
        self.watch.forget(name)
        self.evictions.pop(name, None)
        self.rolling_errors.pop(name, None)

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
        if news.new is State.READY:
            self.watch.wake()  # measure a fresh process at once
        self.update_gauges()

    def _rolled(self, news: Rolled) -> None:
        data = {"model": news.name, "phase": news.phase, "reason": news.reason, "old_pid": news.old_pid}
        if news.phase == "failed":
            self.rolling_errors[news.name] = f"the new process failed to start; the old one keeps serving: {news.error}"
            self._publish("rolling", {**data, "error": news.error})
        elif news.phase == "switched":
            self.rolling_errors.pop(news.name, None)
            self.watch.wake()  # measure the fresh process at once
            self._publish("rolling", {**data, "pid": news.pid})
            model = self.registry.models.get(news.name)
            started_at = model.backend.started_at if model is not None else None
            self._publish("state", {"model": news.name, "state": State.READY.value, "old": State.READY.value,
                                    "pid": news.pid, "reason": f"restart:{news.reason}", "last_error": None,
                                    "started_at": started_at, "at": time.time()})  # the dashboard's new pid
        else:
            self._publish("rolling", data)
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

    # -- changes of a loaded model (procman replaces the process: rolling where it may) ----------------

    async def change(self, model: Model, spec: BackendSpec, stop_first: bool = False) -> None:
        """Apply a changed process spec: rolling where the model asks, room allows and ``stop_first`` is not set,
        else stop-first."""
        await model.backend.replace(spec, rolling=model.spec.restart == "rolling" and not stop_first)

    async def restart(self, model: Model) -> None:
        """``POST /api/models/{name}/restart``: rolling where the model asks and room allows, else stop-first; with
        the config's settings (a rolling change whose new process failed left the old ones running)."""
        spec = self.registry.process_spec(model)
        pending = spec if spec.process_view != model.backend.spec.process_view else None
        await model.backend.replace(pending, rolling=model.spec.restart == "rolling")
