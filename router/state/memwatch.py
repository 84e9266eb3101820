"""Measuring the loaded models: their ``/health`` memory report into the :class:`~router.state.sizes.SizeStore`.

Every :data:`SAMPLE_INTERVAL_S`, and at once when a model becomes READY (:meth:`MemoryWatch.wake`),
the ``memory`` object of each READY model server's last ``/health`` answer is recorded (see
:mod:`modelserver.memory`). The router asks nothing itself: procman's own health probes keep that
answer (``Backend.last_health``; every ``health_interval_s`` while READY, and once at READY), so a
model server sees one ``/health`` poll, not one per observer. A ``command:`` backend reports
nothing of the kind: its peak RSS is read from ``/proc/<pid>/status`` (``VmHWM``, Linux; its own
process, not children it spawned) unless it declares ``memory_mb``. A remote ``url:`` backend is never measured.

:func:`budgets_now` turns ``router.memory_budget`` into bytes per device with what is known
now (physical memory, the GPU totals the model servers reported).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

from modelserver.spec import ModelSpec
from procman import Backend, State
from procman.procfs import process_memory_bytes
from router.state.budget import budget_device, physical_memory_bytes, resolve_budget
from router.state.sizes import SizeStore

__all__ = ["SAMPLE_INTERVAL_S", "MemoryWatch", "budgets_now", "peak_rss_of"]

log = logging.getLogger(__name__)

#: Seconds between two readings of the loaded models' last health answers (no I/O: procman's probes did that).
SAMPLE_INTERVAL_S = 1.0

Loaded = Callable[[], Iterable[tuple[ModelSpec, Backend]]]


def peak_rss_of(pid: int | None) -> int | None:
    """``VmHWM`` of ``pid`` (bytes), None off Linux or once it is gone."""
    return process_memory_bytes(pid, "VmHWM")


def budgets_now(setting: Any, specs: Iterable[ModelSpec], store: SizeStore) -> dict[str, int]:
    """``router.memory_budget`` in bytes per device, from what is known now (see :mod:`router.state.budget`)."""
    devices = {budget_device(s.device) for s in specs if s.url is None}

    def total(device: str) -> int | None:
        return physical_memory_bytes() if device == "CPU" else store.device_total(device)

    return resolve_budget(setting, devices, total)


class MemoryWatch:
    """One task that measures READY backends; ``wake()`` asks for a measurement now."""

    def __init__(self, store: SizeStore, loaded: Loaded, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.store = store
        self._loaded = loaded
        self.interval_s = interval_s
        self._wake = asyncio.Event()
        self.reports: dict[str, dict[str, Any]] = {}  # the last memory object of each model

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self.sample()
            with contextlib.suppress(TimeoutError):  # asyncio.timeout: Python 3.11's wait_for loses a cancel
                async with asyncio.timeout(self.interval_s):  # that comes as the wake does, and shutdown hangs
                    await self._wake.wait()
            self._wake.clear()

    async def sample(self) -> None:
        """Measure every READY backend once, from what it last told procman's probes."""
        for spec, backend in self._loaded():
            if backend.state is State.READY and spec.url is None:
                self._measure(spec, backend)

    def _measure(self, spec: ModelSpec, backend: Backend) -> None:
        pid = backend.pid
        if spec.command is not None:
            if spec.memory_mb is None and (peak := peak_rss_of(pid)):
                self._record(spec.name, pid, {"device": spec.device, "counted_bytes": peak, "peak_rss_bytes": peak})
            return
        health = backend.last_health
        memory = health.body.get("memory") if health is not None and health.ok and health.body else None
        if isinstance(memory, dict):
            self._record(spec.name, pid, memory)

    def _record(self, name: str, pid: int | None, memory: dict[str, Any]) -> None:
        self.reports[name] = memory
        if self.store.record(name, pid, memory):
            log.debug("%s pid=%s measured: %s bytes on %s", name, pid, memory.get("counted_bytes"),
                      memory.get("device"))

    def forget(self, name: str) -> None:
        self.reports.pop(name, None)
