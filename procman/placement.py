"""Whether one more backend fits a device's memory budget, and whom to stop for it: a pure function.

A :class:`Holder` is a backend that holds memory on a device now: READY, STARTING (room
granted, loading or compiling), or being stopped (its memory counts until the process has
*exited*). :func:`place` answers, for a backend about to start on ``device`` with
``size_bytes``:

- ``fits``: it may start now;
- ``stop``: idle backends to stop first, least recently used first; never a busy one, a
  pinned one, or one loaded less than its ``min_residency_s`` ago;
- ``wait``: why it must wait (``compiling``: another backend of that device is starting,
  at most one compiles per device at a time; ``queued``: an earlier start waits for this
  device and goes first; ``stopping``: victims are exiting; ``busy`` / ``young``: not
  enough may be stopped now), and ``retry_at``, when a young backend becomes evictable;
- ``never``: it cannot fit even with everything stoppable gone (larger than the budget,
  or than what pinned backends leave): a message naming the budget and the sizes.

Counts (``max_loaded_models``, groups) are :func:`procman.room.victims`' business; the
manager applies both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["Claim", "Holder", "Placement", "Wait", "format_bytes", "place", "waiting_words"]

Wait = Literal["compiling", "queued", "stopping", "busy", "young"]


@dataclass(frozen=True, slots=True)
class Claim:
    """What one backend takes from a device's budget, and how it may be stopped (from the router's config and sizes)."""

    device: str | None = None  # None: counts nowhere
    size_bytes: int = 0
    pinned: bool = False
    min_residency_s: float = 0.0


NO_CLAIM = Claim()


@dataclass(frozen=True, slots=True)
class Holder:
    """A backend holding memory on ``device`` (or the room granted for its start)."""

    name: str
    device: str | None  # the budget device; None counts nowhere (a remote backend)
    size_bytes: int
    idle: bool = False  # READY with nothing in flight
    last_used: float = 0.0  # least-recently-used order
    pinned: bool = False  # never stopped to make room
    evictable_at: float = 0.0  # clock time its min_residency_s ends
    starting: bool = False  # loading/compiling now
    going: bool = False  # being stopped; its memory counts until it exited


@dataclass(frozen=True, slots=True)
class Placement:
    fits: bool
    stop: tuple[str, ...] = ()
    wait: Wait | None = None
    retry_at: float | None = None  # when waiting for a young backend: the earliest it may be stopped
    never: str | None = None


FITS = Placement(True)


def format_bytes(value: float) -> str:
    """``1610612736`` -> ``"1.5 GiB"``."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(value) >= size:
            return f"{value / size:.1f} {unit}".replace(".0 ", " ")
    return f"{int(value)} B"


def place(
    target: str,
    device: str | None,
    size_bytes: int,
    holders: Sequence[Holder],
    budgets: Mapping[str, int],
    now: float,
    *,
    queued_ahead: bool = False,
    serialize: bool = True,
) -> Placement:
    """What it takes for ``target`` (``size_bytes`` on ``device``) to start; see the module doc."""
    budget = budgets.get(device) if device is not None else None
    if budget is None:
        return FITS
    here = [h for h in holders if h.device == device and h.name != target]
    pinned = [h for h in here if h.pinned and not h.going]
    never = _never(target, device, size_bytes, budget, pinned)  # type: ignore[arg-type]
    if never is not None:
        return Placement(False, never=never)
    if queued_ahead:
        return Placement(False, wait="queued")
    if serialize and any(h.starting and not h.going for h in here):
        return Placement(False, wait="compiling")
    used = sum(h.size_bytes for h in here)
    if used + size_bytes <= budget:
        return FITS
    staying = [h for h in here if not h.going]
    need = sum(h.size_bytes for h in staying) + size_bytes - budget
    if need <= 0:
        return Placement(False, wait="stopping")
    return _evict(staying, need, now)


def _never(target: str, device: str, size: int, budget: int, pinned: Sequence[Holder]) -> str | None:
    held = sum(h.size_bytes for h in pinned)
    if size + held <= budget:
        return None
    sizes = f"{target} needs {format_bytes(size)}"
    if pinned:
        sizes += " and pinned " + ", ".join(f"{h.name} ({format_bytes(h.size_bytes)})" for h in pinned)
        sizes += f" hold {format_bytes(held)}"
    return f"cannot start {target}: {sizes}, more than memory_budget {device}: {format_bytes(budget)}"


def _evict(staying: Sequence[Holder], need: int, now: float) -> Placement:
    stoppable = [h for h in staying if h.idle and not h.pinned and not h.starting]
    ripe = sorted((h for h in stoppable if h.evictable_at <= now), key=lambda h: h.last_used)
    chosen: list[str] = []
    freed = 0
    for holder in ripe:
        if freed >= need:
            break
        chosen.append(holder.name)
        freed += holder.size_bytes
    if freed >= need:
        return Placement(False, stop=tuple(chosen), wait="stopping")
    young = [h.evictable_at for h in stoppable if h.evictable_at > now]
    if young and freed + sum(h.size_bytes for h in stoppable if h.evictable_at > now) >= need:
        return Placement(False, wait="young", retry_at=min(young))
    return Placement(False, wait="busy", retry_at=min(young) if young else None)


#: What each wait means, for the line a waiting model shows (``/api/models``, ``ovrouter status``, the console).
WAIT_WORDS: dict[Wait, str] = {
    "compiling": "another start on this device goes first",
    "queued": "an earlier start waits first",
    "stopping": "idle models are stopping to make room",
    "busy": "the others are busy",
    "young": "the idle ones are within min_residency_s",
}


def waiting_words(target: str, device: str, size_bytes: int, budget: int, holders: Sequence[Holder],
                  wait: Wait | None) -> str:
    """``waiting for memory: needs 300 MiB, 900 MiB of 1 GiB CPU in use by m2 (busy), m3 (idle); ...``."""
    here = sorted((h for h in holders if h.device == device and h.name != target), key=lambda h: h.name)
    used = sum(h.size_bytes for h in here)
    by = ", ".join(f"{h.name} ({_holding(h)})" for h in here) or "nothing"
    why = f"; {WAIT_WORDS[wait]}" if wait is not None else ""
    return (f"waiting for memory: needs {format_bytes(size_bytes)}, {format_bytes(used)} of {format_bytes(budget)} "
            f"{device} in use by {by}{why}")


def _holding(holder: Holder) -> str:
    if holder.going:
        return "stopping"
    if holder.starting:
        return "starting"
    return "idle" if holder.idle else "busy"
