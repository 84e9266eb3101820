"""The router's models: config, procman backends, admission limits, eviction and reload.

Every request reaches a backend through ``model.backend.request()`` (procman's in-flight
guard around ``ensure_ready``); nothing here inspects a state first and then acts on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from modelserver.spec import ModelSpec
from procman import (
    LOADED,
    BackendSpec,
    BackendUnavailable,
    ProcessManager,
    Restarted,
    Scope,
    SparePool,
    Started,
    State,
    Stopped,
    SubprocessSpawner,
    Transition,
)
from router.config import Config, start_warnings
from router.metrics import Metrics
from router.reload import ConfigDiff, diff
from router.state.launch import backend_spec, spare_spec
from router.state.limits import MIB, BodyBudget, Limiter
from router.state.model import Model
from router.state.residency import Residency

__all__ = ["Model", "Registry"]

log = logging.getLogger(__name__)



def _manager(config: Config) -> ProcessManager:
    """The process manager on the configured engine (local children, or actors on a Ray cluster)."""
    router = config.router
    if router.engine.kind == "ray":
        from procman.rayengine import RaySpawner

        spawner = RaySpawner(router.engine.address, router.engine.namespace)
        return ProcessManager(Path(router.state_dir), port_range=router.port_range, spawner=spawner,
                              cluster=spawner.nodes)
    spares = SparePool(SubprocessSpawner(), spare_spec(config))  # count 0: every spawn goes straight through
    return ProcessManager(Path(router.state_dir), port_range=router.port_range, spawner=spares)


class Registry:
    """Owns one ProcessManager; ``apply(config)`` moves it to a new config with minimal restarts."""

    def __init__(self, config: Config, metrics: Metrics, manager: ProcessManager | None = None) -> None:
        self.config = config
        self.metrics = metrics
        if manager is None:
            manager = _manager(config)
        self.manager = manager
        manager.subscribe(Transition, self._transition)
        manager.subscribe(Started, self._started)
        manager.subscribe(Restarted, self._restarted)
        manager.subscribe(Stopped, self._stopped)
        manager.scopes = self.scopes
        self.residency = Residency(self)  # memory budgets, measured sizes, evictions, rolling changes
        manager.claims = self.residency.claim
        manager.budgets = self.residency.budgets
        self.models: dict[str, Model] = {}
        self._aliases: dict[str, str] = {}
        self.max_body_bytes = 1 << 20
        self.bodies = BodyBudget(int(config.router.max_buffered_body_mb * MIB), config.router.body_wait_s)
        metrics.buffered_bodies.set_function(lambda: self.bodies.held)
        metrics.body_waiters.set_function(lambda: self.bodies.waiting)
        self._tasks: set[asyncio.Task[Any]] = set()
        for spec in config.models.values():
            self._add(spec)

    # -- lookup -----------------------------------------------------------------------------

    def resolve(self, name: str) -> Model | None:
        return self.models.get(self._aliases.get(name, name))


    # -- lifecycle ----------------------------------------------------------------------------

    def _add(self, spec: ModelSpec) -> Model:
        backend = self.manager.add(backend_spec(spec, self.config.router, self.config.path))
        model = self.models[spec.name] = Model(spec, backend, Limiter(spec.name, spec.max_concurrency, spec.max_queue))
        self.metrics.in_flight.labels(spec.name).set_function(lambda: backend.in_flight)
        self.metrics.queued.labels(spec.name).set_function(lambda: model.limiter.queued)
        self.metrics.loaded.labels(spec.name).set(0)
        self._reindex()
        return model

    def _reindex(self) -> None:
        """Lookups the hot path makes, rebuilt whenever the set of models or their specs change."""
        self._aliases = {alias: m.spec.name for m in self.models.values() for alias in m.spec.aliases}
        # the body is read before its model is known: the largest limit of any model bounds it
        self.max_body_bytes = max((m.spec.max_request_bytes for m in self.models.values()), default=1 << 20)
        router = self.config.router
        self.bodies.configure(int(router.max_buffered_body_mb * MIB), router.body_wait_s, self.max_body_bytes)

    def start_spares(self) -> None:
        """Keep ``router.spare_interpreters`` ready from now on (from the event loop: they die with it)."""
        if self.manager.spares is not None:
            self.manager.spares.start()

    def start_preloads(self, names: Iterable[str] | None = None) -> None:
        for name in self.models if names is None else names:
            model = self.models[name]
            if model.spec.preload:
                self._spawn(self._preload(model), f"preload {name}")

    async def _preload(self, model: Model) -> None:
        try:
            await model.backend.ensure_ready()
        except BackendUnavailable as exc:
            log.warning("preload of %s failed: %s", model.spec.name, exc)

    def _spawn(self, coro: Any, what: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=what)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.residency.stop()
        await self.manager.shutdown()

    # -- reload -------------------------------------------------------------------------------

    async def apply(self, new: Config) -> ConfigDiff:
        """Removed models drain and stop, changed ones restart after their in-flight requests,
        router-only changes (aliases, limits) apply in place, unchanged ones are not touched."""
        old, self.config = self.config, new
        changes = diff(old.models, new.models)
        if self.manager.spares is not None:
            self.manager.spares.configure(spare_spec(new))  # different settings retire the spares
        for name in changes.removed:
            self.models.pop(name)
            self.metrics.forget(name)
            self.residency.forget(name)
            self._spawn(self.manager.remove(name), f"remove {name}")
        for name in changes.changed:
            self._change(self.models[name], new.models[name])
        for name in changes.added:
            self._add(new.models[name])
        self._reindex()
        self.start_preloads(changes.added)
        log.info("config applied: added=%s changed=%s removed=%s", changes.added, changes.changed, changes.removed)
        for warning in start_warnings(new, changes.added + changes.changed):
            log.warning("%s", warning)
        return changes

    def _change(self, model: Model, spec: ModelSpec) -> None:
        if (spec.max_concurrency, spec.max_queue) != (model.spec.max_concurrency, model.spec.max_queue):
            model.limiter = Limiter(spec.name, spec.max_concurrency, spec.max_queue)
        # A new task is stop-first: the routes are checked against the new spec from now on, and the old process
        # (rolling: serving until the new one is ready) would answer the new task's requests with a 404.
        retasked = spec.task != model.spec.task
        model.spec = spec
        new_backend_spec = self.process_spec(model)
        if new_backend_spec == model.backend.spec:
            return  # router settings only: applied above
        if new_backend_spec.process_view == model.backend.spec.process_view:
            log.info("%s: supervisor settings changed; applied to the running process", spec.name)
            self._spawn(model.backend.update(new_backend_spec), f"update {spec.name}")
        else:
            how = "after its requests finish (a new task)" if retasked else \
                "rolling where memory allows, else after its requests finish"
            log.info("%s changed: restarting (%s)", spec.name, how)
            self._spawn(self.residency.change(model, new_backend_spec, stop_first=retasked), f"update {spec.name}")

    def process_spec(self, model: Model) -> BackendSpec:
        """The process spec the config gives ``model`` now (its backend's may be older: a rolling change whose new
        process failed leaves the old one serving with the old spec)."""
        return backend_spec(model.spec, self.config.router, self.config.path)

    # -- room: which limits a model's start must fit (procman's make_room carries them out) ---------

    def scopes(self, name: str) -> list[Scope]:
        model = self.models.get(name)
        if model is None or model.spec.url is not None:  # a remote backend holds no memory here
            return []
        local = [m for m in self.models.values() if m.spec.url is None]
        scopes = []
        if self.config.router.max_loaded_models:
            everyone = frozenset(m.spec.name for m in local)
            scopes.append(Scope("all models", self.config.router.max_loaded_models, everyone))
        group = model.spec.group
        if group is not None and self.config.groups[group].max_loaded:
            members = frozenset(m.spec.name for m in local if m.spec.group == group)
            scopes.append(Scope(f"group {group!r}", self.config.groups[group].max_loaded, members))
        return scopes

    # -- what procman tells ---------------------------------------------------------------------

    def _transition(self, news: Transition) -> None:
        self.metrics.loaded.labels(news.name).set(1 if news.new in LOADED else 0)
        for state in State:
            self.metrics.state.labels(news.name, state.name.lower()).set(1 if state is news.new else 0)

    def _started(self, news: Started) -> None:
        self.metrics.starts.labels(news.name, news.reason, "ok" if news.ok else "failed").inc()
        if news.ok:
            self.metrics.cold_start.labels(news.name).observe(news.duration_s)

    def _restarted(self, news: Restarted) -> None:
        self.metrics.restarts.labels(news.name, news.reason).inc()

    def _stopped(self, news: Stopped) -> None:
        self.metrics.stops.labels(news.name, news.reason).inc()
