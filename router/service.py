"""The running router: registry, upstream pool, metrics, and config reloads, owned by the lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import time
from collections.abc import Mapping
from typing import Any

from procman import BackendUnavailable, ProcessManager, State
from router.api.console import Console
from router.api.events import EventBus
from router.api.responses_store import ResponseStore
from router.config import Config, ConfigError, load_config
from router.edge.errors import Unauthorized
from router.edge.upstream import Upstream, UpstreamPool
from router.metrics import Metrics
from router.reload import watch_config
from router.state.devices import DeviceGuard
from router.state.registry import Registry

__all__ = ["RESTART_ONLY_SETTINGS", "Credential", "RouterService", "check_key", "credential", "credential_of"]

log = logging.getLogger(__name__)

#: router settings that only take effect when the router itself restarts.
RESTART_ONLY_SETTINGS = ("host", "port", "ollama_port", "transport", "state_dir", "port_range", "head_timeout_s",
                         "body_timeout_s", "keep_alive_timeout_s", "max_connections", "engine")


#: What a request presents as its key: its ``Authorization`` header and its ``x-api-key`` header (Anthropic's SDKs).
Credential = tuple[str | None, str | None]


def credential(authorization: str | None, api_key: str | None) -> Credential:
    """The key headers of a request, as :func:`check_key` takes them."""
    return authorization, api_key


def credential_of(headers: Mapping[str, str]) -> Credential:
    """:func:`credential` of a request's headers."""
    return credential(headers.get("authorization"), headers.get("x-api-key"))


def check_key(presented: Credential, keys: tuple[str, ...], what: str) -> None:
    """Open when ``keys`` is empty; else ``Authorization: Bearer <key>`` (any case of ``Bearer``) or
    ``x-api-key: <key>`` must hold one of ``keys``: either header matching is enough (a client may send a
    placeholder in the other). Every candidate is compared with every key in constant time."""
    if not keys:
        return
    authorization, api_key = presented
    scheme, _, token = (authorization or "").strip().partition(" ")
    candidates = [token.strip() if scheme.lower() == "bearer" else "", (api_key or "").strip()]
    matched = False
    for candidate in candidates:
        for key in keys:
            matched |= bool(candidate) & hmac.compare_digest(candidate.encode(), key.encode())
    if not matched:
        hint = "not accepted" if any(candidates) else "missing"
        raise Unauthorized(f"API key {hint}: send `Authorization: Bearer <key>` (or `x-api-key: <key>`) "
                           f"with a key from router.{what}")


class RouterService:
    """Everything one router owns. ``manager`` (procman) and ``upstream`` (the HTTP hop to the
    backends) are injectable: tests run the whole router in-process over fakes of both."""

    def __init__(
        self,
        config: Config,
        metrics: Metrics | None = None,
        *,
        manager: ProcessManager | None = None,
        upstream: Upstream | None = None,
    ) -> None:
        self.metrics = metrics or Metrics()
        self.registry = Registry(config, self.metrics, manager)
        self.devices = DeviceGuard(self.registry, config.router.device_failure_threshold)  # unhealthy devices
        self.events = EventBus()  # what /api/events, /ui and /models/sse stream (router.api.events)
        self.pool: Upstream = upstream or UpstreamPool()
        self.console = Console(self.registry, self.metrics, self.events)
        self.registry.residency.publish = self.events.publish  # evict and rolling events
        self.responses = ResponseStore(self._store_limits)  # finished Responses (router/api/responses.py)
        self.started_at = time.time()
        self.last_reload: dict[str, Any] = {"ok": True, "at": None, "source": "start", "errors": [], "diff": None}
        self._reload_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[Any]] = []
        self._hup = asyncio.Event()

    @property
    def config(self) -> Config:
        return self.registry.config

    def _store_limits(self) -> tuple[int, int, float]:
        settings = self.config.router
        return settings.responses_store_max, int(settings.responses_store_mb * 2**20), settings.responses_store_ttl_s

    async def start(self) -> None:
        self.registry.residency.start()
        self.registry.start_spares()
        self.registry.start_preloads()
        path = self.config.path
        if path is not None and self.config.router.watch:
            self._tasks.append(asyncio.create_task(watch_config(path, lambda: self.reload("watch")), name="watch"))
        if path is not None:
            with contextlib.suppress(NotImplementedError, RuntimeError):  # no signals off the main thread/Windows
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._hup.set)
            self._tasks.append(asyncio.create_task(self._on_hup(), name="sighup"))

    async def _on_hup(self) -> None:
        while True:
            await self._hup.wait()
            self._hup.clear()
            await self.reload("SIGHUP")

    async def stop(self) -> None:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.registry.shutdown()
        await self.pool.close()

    async def reload(self, source: str) -> dict[str, Any]:
        """Parse and validate the whole file; keep the old config when it is invalid."""
        path = self.config.path
        if path is None:
            return {"ok": False, "errors": ["this router was started without a config file"], "source": source}
        async with self._reload_lock:
            try:
                new = load_config(path)
            except ConfigError as exc:
                return self._reload_failed(source, exc)
            changes = await self.registry.apply(self._keep_restart_only(new))
            self.devices.health.threshold = new.router.device_failure_threshold
            self.metrics.config_valid.set(1)
            self.metrics.reloads.labels("ok").inc()
            summary = {"added": list(changes.added), "changed": list(changes.changed), "removed": list(changes.removed)}
            self.last_reload = {"ok": True, "at": time.time(), "source": source, "errors": [], "diff": summary}
            return self.last_reload

    def _reload_failed(self, source: str, exc: ConfigError) -> dict[str, Any]:
        log.error("config reload (%s) rejected, still serving the previous config:\n  %s", source,
                  "\n  ".join(exc.errors))
        self.metrics.config_valid.set(0)
        self.metrics.reloads.labels("invalid").inc()
        self.last_reload = {"ok": False, "at": time.time(), "source": source, "errors": exc.errors, "diff": None}
        return self.last_reload

    def _keep_restart_only(self, new: Config) -> Config:
        """Settings that need a router restart keep their running value (and say so)."""
        current = self.config.router
        kept = {k: getattr(current, k) for k in RESTART_ONLY_SETTINGS if getattr(new.router, k) != getattr(current, k)}
        if not kept:
            return new
        log.warning("router.%s changed: restart the router to apply it", ", router.".join(kept))
        return Config(router=new.router.model_copy(update=kept), models=new.models, groups=new.groups, path=new.path)

    def refusal(self, model: Any) -> BackendUnavailable | None:
        """Why a start of ``model`` would be refused a moment after STARTING — its device is unhealthy, or its
        device's ``memory_budget`` can never hold it — recorded as its ``last_error``; else None.

        Load requests ask first, so they answer the refusal instead of a success that turns into ``failed``."""
        if model.backend.spec.remote:
            return None
        reason = self.devices.refusal(model.spec.name) or self.registry.manager.place(model.spec.name).never
        if reason is None:
            return None
        model.backend.last_error = reason
        return BackendUnavailable(reason)

    def models_table(self) -> list[dict[str, Any]]:
        """One row per model; a start waiting for room shows ``state: waiting`` and ``waiting``: why."""
        rows = []
        waits = self.registry.manager.room_waits()
        for name, model in self.registry.models.items():
            row = dict(model.backend.snapshot())
            row["waiting"] = waits.get(name) if model.backend.state is State.STARTING else None
            if row["waiting"]:
                row["state"] = "waiting"
            row.update(
                name=name, task=model.spec.task, engine=model.spec.engine if model.spec.launches_modelserver else None,
                kind=_kind(model.spec), device=_device(row.get("node"), model.spec.device),
                aliases=list(model.spec.aliases),
                group=model.spec.group, queued=model.limiter.queued,
            )
            row.update(self.registry.residency.row(name))
            rows.append(row)
        return rows


def _device(node: Any, device: str) -> str:
    """``CPU``, or ``<node>/CPU`` for a process on a cluster's node (devices are per node there)."""
    return f"{node}/{device}" if node else device


def _kind(spec: Any) -> str:
    return "url" if spec.url else "command" if spec.command else "modelserver"
