"""Which idle models to stop so that one more fits: a pure function of who is loaded.

A *scope* is a set of backends sharing a limit (``max_loaded_models`` over all of them, a
group's ``max_loaded``). :func:`victims` answers, for a backend about to start: which idle
backends to stop (least recently used first), and whether it must wait (memory counts as
free only once a process has exited; a busy backend is never stopped to make room).
:meth:`procman.manager.ProcessManager.make_room` carries the answer out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Member", "Room", "Scope", "victims"]


@dataclass(frozen=True, slots=True)
class Scope:
    """Backends (``members``, by name) of which at most ``limit`` may be loaded at once; 0 = no limit."""

    label: str  # in messages: "all models", "group 'gpu0'"
    limit: int
    members: frozenset[str]


@dataclass(frozen=True, slots=True)
class Member:
    """A backend that holds memory (or the room reserved for its start)."""

    name: str
    idle: bool  # READY with nothing in flight: may be stopped to make room
    last_used: float  # for least-recently-used order
    going: bool = False  # a stop was asked for; its memory is free once it exited
    pinned: bool = False  # never stopped to make room (``pin: true``)


@dataclass(frozen=True, slots=True)
class Room:
    stop: tuple[str, ...]  # idle backends to stop now, least recently used first
    fits: bool  # the target may start now
    busy: Scope | None = None  # a scope where busy backends leave no room (the start must wait)


def victims(target: str, loaded: Sequence[Member], scopes: Sequence[Scope]) -> Room:
    """What it takes for ``target`` to fit every scope it is in, given the ``loaded`` backends."""
    stop: list[str] = []
    fits = True
    busy: Scope | None = None
    for scope in scopes:
        if scope.limit <= 0 or target not in scope.members:
            continue
        members = [b for b in loaded if b.name in scope.members and b.name != target]
        if len(members) + 1 <= scope.limit:
            continue
        fits = False
        staying = [b for b in members if not b.going and b.name not in stop]
        need = len(staying) + 1 - scope.limit
        idle = sorted((b for b in staying if b.idle and not b.pinned), key=lambda b: b.last_used)[: max(need, 0)]
        stop.extend(b.name for b in idle)
        if need > len(idle) and busy is None:
            busy = scope
    return Room(tuple(stop), fits, busy)
