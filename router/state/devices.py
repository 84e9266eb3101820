"""Device health: a device whose models keep failing fatally is marked unhealthy.

A fatal error (``X-Backend-Fatal``, or a process whose last lines match ``fatal_patterns``)
says a device context is beyond repair; one such error is the model's problem, and its
process is replaced. The same kind of error in ``threshold`` *different* models on one
device within ``window_s`` says the device (its driver) is: every further start there
would fail or wedge. So the device is marked unhealthy — no more cold starts on it, a 503
naming it ("a driver reload or reboot may be required"), shown in ``/api/status`` — until
someone fixes it and calls ``POST /api/devices/{device}/reset``. Processes already running
on it keep running (a model that still works is not taken away). A model on the CPU (``AUTO``
included: :func:`~router.state.budget.budget_device`) is never counted: the CPU has no driver
context one process can wedge for the others, and the mark refused every CPU model's start (in a
chaos soak, the ``[[fatal]]`` markers of two fake models and one failed SmolLM2 step took the
whole router down: 15,389 requests answered 503 in four minutes).

:class:`DeviceHealth` is pure bookkeeping with an injected clock; :class:`DeviceGuard` ties
it to the registry: a subscriber of procman's ``Restarted`` notices that records fatal restarts,
and a ``before_start`` hook (run before procman makes room) that refuses a start on an unhealthy device. On a cluster
(``router.engine.kind: ray``) a device is counted per node (``<node>/GPU.0``), and placement
avoids the nodes where a model's device is marked instead of refusing the start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from procman import BackendUnavailable, Restarted
from router.state.budget import budget_device

if TYPE_CHECKING:
    from procman import Backend
    from router.state.registry import Registry

__all__ = ["DEFAULT_WINDOW_S", "DeviceGuard", "DeviceHealth", "Unhealthy"]

log = logging.getLogger(__name__)

DEFAULT_WINDOW_S = 600.0


@dataclass(frozen=True, slots=True)
class Unhealthy:
    """Why a device is marked unhealthy: the models whose fatal errors did it, and when."""

    device: str
    since: float  # wall clock
    models: tuple[str, ...]
    last_error: str

    def message(self) -> str:
        """One line for clients: what happened and what fixes it."""
        return (
            f"device {self.device} is unhealthy: fatal errors in {len(self.models)} models "
            f"({', '.join(self.models)}) within minutes; a driver reload or reboot may be required, "
            f"then POST /api/devices/{self.device}/reset"
        )

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "healthy": False, "since": self.since, "models": list(self.models),
                "last_error": self.last_error, "message": self.message()}


@dataclass(slots=True)
class DeviceHealth:
    """Counts fatal errors per device; ``threshold`` 0 turns the marking off."""

    threshold: int = 3
    window_s: float = DEFAULT_WINDOW_S
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    _faults: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    _unhealthy: dict[str, Unhealthy] = field(default_factory=dict)
    _names: dict[str, str] = field(default_factory=dict)  # the spelling first seen, for messages

    def record_fatal(self, device: str, model: str, error: str = "") -> Unhealthy | None:
        """A fatal error of ``model`` on ``device``; returns the mark when this one made the device unhealthy."""
        key = device.upper()
        if self.threshold <= 0 or key in self._unhealthy:
            return None
        self._names.setdefault(key, device)
        now = self.clock()
        recent = [(at, name) for at, name in self._faults.get(key, []) if now - at <= self.window_s]
        recent = [(at, name) for at, name in recent if name != model] + [(now, model)]
        self._faults[key] = recent
        if len(recent) < self.threshold:
            return None
        name = self._names.setdefault(key, device)
        mark = Unhealthy(name, self.wall(), tuple(model for _, model in recent), error)
        self._unhealthy[key] = mark
        return mark

    def unhealthy(self, device: str) -> Unhealthy | None:
        """The mark of ``device`` (compared without case: ``gpu.0`` is ``GPU.0``), or None when healthy."""
        return self._unhealthy.get(device.upper())

    def unhealthy_nodes(self, device: str) -> frozenset[str]:
        """The nodes (of an engine with nodes) whose ``device`` is marked: marks keyed ``<node>/<device>``."""
        nodes = set()
        for mark in self._unhealthy.values():
            node, slash, marked = mark.device.partition("/")
            if slash and marked.upper() == device.upper():
                nodes.add(node)
        return frozenset(nodes)

    def reset(self, device: str) -> bool:
        """Clear the mark and the count of ``device``; False when it was not marked."""
        key = device.upper()
        self._faults.pop(key, None)
        return self._unhealthy.pop(key, None) is not None

    def snapshot(self, devices: list[str]) -> list[dict[str, Any]]:
        """Every device in ``devices`` (and every marked one), with its state and recent fatal errors."""
        now = self.clock()
        names = {d.upper(): d for d in devices} | {key: mark.device for key, mark in self._unhealthy.items()}
        rows = []
        for key, device in sorted(names.items()):
            mark = self._unhealthy.get(key)
            if mark is not None:
                rows.append(mark.as_dict())
                continue
            recent = [name for at, name in self._faults.get(key, []) if now - at <= self.window_s]
            rows.append({"device": device, "healthy": True, "recent_fatal_models": recent})
        return rows


class DeviceGuard:
    """Device health wired into the registry's process manager (see the module's docstring)."""

    def __init__(self, registry: Registry, threshold: int) -> None:
        self.registry = registry
        self.health = DeviceHealth(threshold=threshold)
        manager = registry.manager
        manager.add_before_start(self.before_start)
        manager.avoid = self.unhealthy_nodes  # on a cluster: a device is marked per node, and placement avoids it
        manager.subscribe(Restarted, self._restarted)

    def _device(self, name: str) -> str | None:
        model = self.registry.models.get(name)
        if model is None or model.spec.url is not None or model.spec.command is not None:
            return None  # only the model servers this router runs on a device count
        return model.spec.device

    def _restarted(self, news: Restarted) -> None:
        device = self._device(news.name)
        if news.reason != "fatal" or device is None or budget_device(device) == "CPU":
            return  # a CPU has no driver context that one process can wedge for the others: never marked
        where = f"{news.node}/{device}" if news.node else device  # on a cluster the device name is on every node
        mark = self.health.record_fatal(where, news.name, news.last_error or "")
        if mark is not None:
            log.error("%s", mark.message())

    def refusal(self, name: str) -> str | None:
        """Why a start of model ``name`` is refused now (its device is unhealthy), else None."""
        device = self._device(name)
        mark = self.health.unhealthy(device) if device is not None else None
        return mark.message() if mark is not None else None

    def unhealthy_nodes(self, name: str) -> frozenset[str]:
        """The nodes where model ``name``'s device is marked unhealthy (placement puts it elsewhere)."""
        device = self._device(name)
        return self.health.unhealthy_nodes(device) if device is not None else frozenset()

    async def before_start(self, backend: Backend) -> None:
        refused = self.refusal(backend.name)
        if refused is not None:
            raise BackendUnavailable(refused)

    def snapshot(self) -> list[dict[str, Any]]:
        devices = sorted({d for name in self.registry.models if (d := self._device(name)) is not None})
        return self.health.snapshot(devices)
