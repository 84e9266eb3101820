"""What can happen to a backend (events) and what it does about it (effects): plain frozen data.

:func:`procman.machine.decide` maps one onto the other; :class:`procman.backend.Backend`
posts the events (callers' commands, its helpers' reports) and carries the effects out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "Abort", "Admit", "Arm", "Blame", "Close", "Disarm", "Done", "DrainTimeout", "Effect", "Event", "Exited",
    "FailParked", "FollowUp", "Forgive", "GiveUp", "Hung", "IdleTick", "Notify", "Park", "Reap", "Reaped", "Refuse",
    "Restart", "RetryDue", "Retune", "Spawn", "Started", "Stop", "Swap", "Switched", "Terminate", "Timer", "Update",
    "Wake", "Want", "Watch",
]

Timer = Literal["idle", "retry", "drain"]


# -- events -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Want:
    """A caller wants a READY process (``count``: and a request counted in flight)."""

    count: bool = False


@dataclass(frozen=True, slots=True)
class Done:
    """A counted request ended."""


@dataclass(frozen=True, slots=True)
class Stop:
    reason: str = "stop"
    drain: bool = True


@dataclass(frozen=True, slots=True)
class Close:
    """Stop for good (remove, shutdown)."""

    drain: bool = True


@dataclass(frozen=True, slots=True)
class Restart:
    """Replace the process; with ``generation``, only if that one is still the READY one.

    ``blamed``: a request in flight caused the failure (a poison request): no failure is counted.
    ``outside``: a ``hang`` of a process found stopped by a signal (SIGSTOP, SIGTSTP: someone else's doing, set by
    the backend when the event's turn comes): no failure is counted either.
    """

    reason: str = "manual"
    generation: int | None = None
    blamed: bool = False
    outside: bool = False


@dataclass(frozen=True, slots=True)
class Forgive:
    """The deaths of ``generations`` were a poison request's doing; ``count`` of them had been counted
    as failures (the backend fills it in when the event's turn comes, after those deaths were handled)."""

    generations: tuple[int, ...] = ()
    count: int = 0


@dataclass(frozen=True, slots=True)
class Update:
    """A new spec that needs a new process (the backend holds it until the old process is gone)."""


@dataclass(frozen=True, slots=True)
class Retune:
    """New supervision settings, applied to the running process."""


@dataclass(frozen=True, slots=True)
class Started:
    """A start ended: ``ok``, ``failed`` (error), ``refused`` (no room, nothing spawned), ``aborted``, or
    ``stopped``: its process was found stopped by a signal (SIGSTOP, SIGTSTP) before it was ready — from outside,
    as ``Hung.outside``: it is killed and started again at once, and no failure is counted."""

    outcome: Literal["ok", "failed", "refused", "aborted", "stopped"]
    has_process: bool = False  # aborted, stopped: a live process is left to terminate
    payload: Any = field(default=None, compare=False)  # the Running or the error, for the owner


@dataclass(frozen=True, slots=True)
class Exited:
    """The READY process of ``generation`` exited on its own: a ``crash``, or ``fatal`` when its last
    lines name a device failure. ``blamed``: the request it was serving alone is the likely cause.
    ``lost``: its node went away (an engine with nodes), no fault of the process: no failure is counted."""

    generation: int
    cause: Literal["crash", "fatal"] = "crash"
    blamed: bool = False
    lost: bool = False


@dataclass(frozen=True, slots=True)
class Hung:
    """The READY process of ``generation`` failed ``health_failures`` probes in a row (``blamed``: with
    one request in flight, the likely cause; ``outside``: it was found stopped by a signal, SIGSTOP or SIGTSTP —
    silenced from outside, no failure of its own: none is counted)."""

    generation: int
    blamed: bool = False
    outside: bool = False


@dataclass(frozen=True, slots=True)
class Reaped:
    """The process a Terminate was for is gone and its address released."""


@dataclass(frozen=True, slots=True)
class RetryDue:
    """The backoff timer fired."""


@dataclass(frozen=True, slots=True)
class IdleTick:
    """The idle timer fired."""


@dataclass(frozen=True, slots=True)
class DrainTimeout:
    """``drain_timeout_s`` passed with requests still in flight."""


@dataclass(frozen=True, slots=True)
class KeepAlive:
    """A client asked how long the process stays loaded once idle (Ollama's ``keep_alive``): ``keep_s`` 0
    stops it as soon as nothing is in flight, ``inf`` keeps it (and pins it) until the model's next change,
    anything else keeps it at least that long (the longer of ``keep_s`` and ``idle_timeout_s``); None: back to
    ``idle_timeout_s``."""

    keep_s: float | None


@dataclass(frozen=True, slots=True)
class Switched:
    """A rolling replacement's new process (READY beside the current one: procman/rolling.py) takes over; the
    requests in flight stay with the old process, which drains apart. ``restart``: the same spec again (a
    manual restart, told as one), else a reload."""

    reason: str = "reload"
    restart: bool = False


Event = (
    Want | Done | Stop | Close | Restart | Update | Retune | Started | Exited | Hung | Reaped | RetryDue | IdleTick
    | DrainTimeout | Forgive | KeepAlive | Switched
)


# -- effects ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admit:
    """Answer the caller of this event with a lease on the READY process."""


@dataclass(frozen=True, slots=True)
class Park:
    """Keep the caller of this event until the start under way ends."""


@dataclass(frozen=True, slots=True)
class Refuse:
    """Fail the caller of this event: ``backoff`` (InBackoff) or ``closed`` (BackendClosed)."""

    why: Literal["backoff", "closed"]
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class Wake:
    """Ask again for every parked caller (a process is READY)."""


@dataclass(frozen=True, slots=True)
class FailParked:
    """Fail every parked caller: the start's error, an interruption (``by``), backoff, closed."""

    why: Literal["failed", "interrupted", "backoff", "closed"]
    by: str = ""
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class Spawn:
    """Start a process (after making room when ``reserve``: a start from no process at all)."""

    reason: str
    reserve: bool = True


@dataclass(frozen=True, slots=True)
class Abort:
    """Interrupt the start under way (it ends with Started('aborted'))."""

    by: str


@dataclass(frozen=True, slots=True)
class Terminate:
    """Stop watching and end the process: SIGTERM, bounded wait, SIGKILL (``graceful``) or SIGKILL at once."""

    graceful: bool = True


@dataclass(frozen=True, slots=True)
class Reap:
    """The process already exited: kill what it left in its group, release its address (no wait)."""


@dataclass(frozen=True, slots=True)
class Watch:
    """Watch the READY process (its exit, its health) with the current settings."""


@dataclass(frozen=True, slots=True)
class Arm:
    """(Re)start a timer; it posts IdleTick, RetryDue or DrainTimeout after ``delay_s``."""

    timer: Timer
    delay_s: float


@dataclass(frozen=True, slots=True)
class Disarm:
    timer: Timer


@dataclass(frozen=True, slots=True)
class Notify:
    """Tell the listeners: a start ended (``ok``), a running process is replaced, a stop is done."""

    what: Literal["start", "restart", "stop"]
    reason: str
    ok: bool = True


@dataclass(frozen=True, slots=True)
class Blame:
    """Record ``last_error`` for a failure of the running process (crash, hang, fatal) or a start."""

    reason: str


@dataclass(frozen=True, slots=True)
class Swap:
    """Take the new spec an Update brought."""


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Log that automatic relaunches stop here (``max_retries`` failures)."""


@dataclass(frozen=True, slots=True)
class FollowUp:
    """Decide on ``event`` right away, as if it had just arrived (one decision, two edges)."""

    event: Event


Effect = (
    Admit | Park | Refuse | Wake | FailParked | Spawn | Abort | Terminate | Reap | Watch | Arm | Disarm | Notify
    | Blame | Swap | GiveUp | FollowUp
)
