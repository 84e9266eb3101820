"""The operator's view of a running router: live events, per-model figures, request activity.

One :class:`Console` per :class:`~router.service.RouterService`. It listens to procman
beside the registry (a subscriber of the ProcessManager's notices), publishes what
it hears on its :class:`~router.api.events.EventBus` (``state``, ``loading``, ``loaded``,
``restart``), owns the :class:`~router.api.activity.Activity` of proxied requests, and computes
the figures that ``/api/models``, ``/api/events``, ``/ui`` and ``ovrouter status`` show:
RSS of the process (``/proc``), uptime, restarts by reason, the reason of the last
start/stop/restart, the last load time, requests/min, TTFT p50, tokens/s, a sparkline,
and what the model server reported in its last ``/health`` answer (running generations, KV-cache
usage, scheduled requests, device memory) — the answer procman's health probes keep
(``Backend.last_health``); the console asks the model servers nothing itself.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
import threading
import time
from collections.abc import AsyncIterator
from types import FrameType
from typing import Any

from procman import Restarted, Started, State, Stopped, Transition
from procman.procfs import process_memory_bytes
from router.api.activity import Activity
from router.api.events import EventBus
from router.metrics import BACKEND_GAUGES, Metrics
from router.state.registry import Registry

__all__ = ["Console"]

EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)

LOADING_TICK_S = 1.0


class Console:
    def __init__(self, registry: Registry, metrics: Metrics, bus: EventBus) -> None:
        self.registry, self.metrics = registry, metrics
        self.bus: EventBus = bus
        self.last_reason: dict[str, str] = {}
        self.restarts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.activity = Activity(metrics, self.bus, self.last_load_s)
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._closing: asyncio.Event | None = None
        manager = registry.manager
        manager.subscribe(Transition, self._transition)
        manager.subscribe(Started, self._started)
        manager.subscribe(Restarted, self._restarted)
        manager.subscribe(Stopped, self._stopped)

    # -- what procman tells ----------------------------------------------------------------------

    def _transition(self, news: Transition) -> None:
        self._publish_state(news.name, news.new, news.old, news.pid, news.last_error, news.started_at)
        if news.new is State.STARTING and news.name not in self._loading:
            self._loading[news.name] = asyncio.ensure_future(self._loading_ticks(news.name))
        elif news.new is not State.STARTING and (task := self._loading.pop(news.name, None)) is not None:
            task.cancel()

    def _started(self, news: Started) -> None:
        self.last_reason[news.name] = f"start:{news.reason}" if news.ok else f"failed start:{news.reason}"
        if news.ok:
            self.metrics.load_seconds.labels(news.name).set(news.duration_s)
        self.bus.publish("loaded", {"model": news.name, "ok": news.ok, "reason": news.reason,
                                    "duration_s": round(news.duration_s, 3), "last_error": news.last_error})

    def _restarted(self, news: Restarted) -> None:
        self.restarts[news.name][news.reason] += 1
        self.last_reason[news.name] = f"restart:{news.reason}"
        self.bus.publish("restart", {"model": news.name, "reason": news.reason})

    def _stopped(self, news: Stopped) -> None:
        model = self.registry.models.get(news.name)
        if model is None:
            return
        self.last_reason[news.name] = f"stop:{news.reason}"
        backend = model.backend
        self._publish_state(news.name, backend.state, None, backend.pid, backend.last_error, backend.started_at)

    def _publish_state(self, name: str, state: State, old: State | None, pid: int | None, last_error: str | None,
                       started_at: float | None) -> None:
        self.bus.publish("state", {
            "model": name, "state": state.value.lower(), "old": old.value.lower() if old else None,
            "pid": pid, "reason": self.last_reason.get(name), "last_error": last_error,
            "started_at": started_at, "at": time.time(),
        })

    async def _loading_ticks(self, name: str) -> None:
        """A ``loading`` event every second of a start of ``name``, until it is READY (or the start ends)."""
        model = self.registry.models.get(name)
        if model is None:
            return
        backend = model.backend
        ready = backend.ready()
        with contextlib.suppress(asyncio.CancelledError):
            while not ready.done() and (elapsed_s := backend.loading_for_s()) is not None:
                self.bus.publish("loading", {"model": name, "elapsed_s": round(elapsed_s, 1),
                                             "estimate_s": _round(backend.last_load_s)})
                await asyncio.wait({ready}, timeout=LOADING_TICK_S)
        ready.cancel()
        self._loading.pop(name, None)

    def last_load_s(self, name: str) -> float | None:
        """How long the last successful start of model ``name`` took (procman measured it)."""
        model = self.registry.models.get(name)
        return model.backend.last_load_s if model is not None else None

    def reported(self, name: str) -> dict[str, Any]:
        """The figures of model ``name``'s last ``/health`` answer (procman's probe kept it) the console shows."""
        model = self.registry.models.get(name)
        health = model.backend.last_health if model is not None and model.spec.launches_modelserver else None
        body = health.body if health is not None and health.body is not None else {}
        return {k: v for k, v in body.items() if k in BACKEND_GAUGES or k == "pipeline"}

    # -- long-lived streams end when the server shuts down ------------------------------------

    async def until_closing(self, source: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """``source`` until the server begins to shut down (then it ends, and the client sees the end).

        uvicorn's graceful shutdown waits for responses in progress; an open dashboard's event
        stream or log follow would otherwise hold every Ctrl-C for ``shutdown_timeout_s``."""
        closing = self._closing_event()
        waiter = asyncio.ensure_future(closing.wait())
        item: asyncio.Future[bytes] | None = None
        try:
            while not closing.is_set():
                item = asyncio.ensure_future(anext(source))
                await asyncio.wait({item, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if not item.done():
                    return
                try:
                    chunk = item.result()
                except StopAsyncIteration:
                    return
                item = None
                yield chunk
        finally:
            waiter.cancel()
            if item is not None and not item.done():
                item.cancel()
                await asyncio.wait({item})  # the source must be idle before it is closed
            await source.aclose()  # type: ignore[attr-defined]

    def close_streams(self) -> None:
        """End every stream of :meth:`until_closing` (the server is shutting down)."""
        self._closing_event().set()

    def _closing_event(self) -> asyncio.Event:
        if self._closing is None:
            self._closing = asyncio.Event()
            self._chain_exit_signals(asyncio.get_running_loop())
        return self._closing

    def _chain_exit_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        """Hear uvicorn's SIGINT/SIGTERM too: chained in front of its handler (it restores its own at exit)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in EXIT_SIGNALS:
            previous = signal.getsignal(sig)
            if type(getattr(previous, "__self__", None)).__module__.split(".")[0] != "uvicorn":
                continue  # only uvicorn's own handler (not a test runner's, not the default)

            def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is gone
                    loop.call_soon_threadsafe(self.close_streams)
                previous(signum, frame)

            signal.signal(sig, handler)

    # -- figures ----------------------------------------------------------------------------------

    def figures(self, name: str, row: dict[str, Any]) -> dict[str, Any]:
        """What the dashboard shows of one model beyond the models table's row."""
        now = time.time()
        pid = row.get("pid")
        rss = process_memory_bytes(pid) if pid else None
        started = row.get("started_at")
        stats = self.activity.stats.get(name)
        figures: dict[str, Any] = {
            "rss_bytes": rss,
            "uptime_s": round(now - started, 1) if started and str(row.get("state")).lower() == "ready" else None,
            "restarts_by_reason": dict(self.restarts.get(name, {})),
            "last_reason": self.last_reason.get(name),
            "last_load_s": _round(self.last_load_s(name)),
            "reported": self.reported(name),
        }
        figures.update(stats.figures(now) if stats else {"requests_per_min": 0, "ttft_p50_s": None,
                                                          "tokens_per_s": None, "errors_5m": 0, "sparkline": []})
        return figures

    def enrich(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for row in rows:
            row.update(self.figures(row["name"], row))
        return rows

    def refresh(self) -> None:
        """Memory gauges from /proc and the figures of each model server's last /health answer (no I/O to them)."""
        metrics = self.metrics
        for name, model in self.registry.models.items():
            rss = process_memory_bytes(model.backend.pid) if model.backend.state is not State.STOPPED else None
            metrics.rss.labels(name).set(rss or 0)
            reported = self.reported(name)
            for key, gauge in metrics.backend.items():
                value = reported.get(key)
                if isinstance(value, int | float):
                    gauge.labels(name).set(value)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
