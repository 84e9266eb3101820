"""What procman tells its observers: frozen values built at the moment something happened.

Observers subscribe by type (``manager.subscribe(Transition, fn)``) and get one value per
occurrence; a value names its backend and carries read-only figures of that moment, never
the live :class:`~procman.backend.Backend`. A subscriber that raises is logged, and the
others still hear the news (:class:`Notices`).

This module imports nothing of the project but :mod:`procman.states`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from procman.states import State

__all__ = ["Evicted", "Notice", "Notices", "Restarted", "Rolled", "Started", "Stopped", "Transition"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Transition:
    """Backend ``name`` went from ``old`` to ``new``; the figures are the ones it had right then.

    ``reason``: why the last start, stop or restart was made; ``generation`` names the process.
    """

    name: str
    old: State
    new: State
    pid: int | None
    reason: str | None
    generation: int
    last_error: str | None = None
    started_at: float | None = None  # wall clock of the current process's spawn
    retry_after_s: float | None = None  # in BACKOFF: seconds until a start may be tried again


@dataclass(frozen=True, slots=True)
class Started:
    """A start attempt ended; ``reason``: cold, crash, fatal, hang, reload, manual; ``ok`` or not."""

    name: str
    reason: str
    ok: bool
    duration_s: float
    generation: int = 0
    pid: int | None = None
    last_error: str | None = None  # the start's error, when it failed


@dataclass(frozen=True, slots=True)
class Restarted:
    """A running backend is being replaced (crash, hang, fatal, manual)."""

    name: str
    reason: str
    generation: int = 0
    pid: int | None = None
    node: str | None = None  # the node it ran on (an engine with nodes)
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class Stopped:
    """A backend was stopped on purpose (idle, unload, reload, shutdown, evict...); ``generation`` names the
    process that stopped."""

    name: str
    reason: str
    generation: int = 0


@dataclass(frozen=True, slots=True)
class Evicted:
    """The manager stops backend ``name`` to make room for ``target`` (``memory`` or ``max_loaded``)."""

    name: str
    target: str
    reason: str


@dataclass(frozen=True, slots=True)
class Rolled:
    """A step of a rolling replacement of ``name``: ``starting`` (a new process beside ``old_pid``),
    ``switched`` (requests now go to ``pid``; ``old_pid`` drains and stops), ``failed`` (``error``; the old
    process keeps serving) or ``interrupted`` (the old process stopped serving meanwhile: the new one is
    stopped, a changed spec kept for the next start)."""

    name: str
    phase: str
    reason: str
    old_pid: int | None = None
    pid: int | None = None
    error: str | None = None


Notice = Transition | Started | Restarted | Stopped | Evicted | Rolled
N = TypeVar("N", Transition, Started, Restarted, Stopped, Evicted, Rolled)


class Notices:
    """Subscribers by notice type; :meth:`publish` calls each of a notice's subscribers once, in order."""

    def __init__(self) -> None:
        self._subscribers: dict[type[Any], list[Callable[[Any], None]]] = {}

    def subscribe(self, kind: type[N], fn: Callable[[N], None]) -> None:
        self._subscribers.setdefault(kind, []).append(fn)

    def unsubscribe(self, kind: type[N], fn: Callable[[N], None]) -> None:
        subscribers = self._subscribers.get(kind, [])
        if fn in subscribers:
            subscribers.remove(fn)

    def publish(self, notice: Notice) -> None:
        for fn in list(self._subscribers.get(type(notice), ())):
            try:
                fn(notice)
            except Exception:
                log.exception("a subscriber of %s failed", type(notice).__name__)
