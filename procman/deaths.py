"""How a READY process died and whose fault it was: one ``Death`` type and one blame policy, pure.

procman records a :class:`Death` for every failure of a READY process (an exit, failed health
probes, a restart for a crash, hang or fatal error): ``Backend.death(generation)`` hands it to
the router, whose verdict (retry, resume, or name the poison: :mod:`router.path.blame`) is built on
the same type and the same predicates. The policy, in one place:

- *external*: a crash by a signal the process did not raise itself (``kill -9``, the OOM killer,
  SIGTERM, SIGINT, SIGHUP, SIGQUIT), or a hang of a process found stopped by SIGSTOP — someone
  else's doing;
- *innocent*: plausibly not the doing of a request in flight: external, a device failure
  (``fatal``, a ``stall``), or not exactly one request in flight (none, or several that share it);
- *blamed*: not innocent — one request alone crashed or hung its process (a poison request). A
  blamed death counts no failure toward the backoff (``decide()`` reads ``Exited.blamed`` and
  ``Hung.blamed``, built here), and ``Forgive`` later blames deaths the router found a poison in;
- *counted* toward the backoff (:func:`counted`): every death but a blamed one and a hang of a
  process found stopped by a signal (``Hung.outside``, ``Restart.outside``). A stop from outside is
  no failure of the model and it is not crash-looping; a ``kill -9`` still counts (it cannot be told
  from the OOM killer, which is the model's doing).

No I/O, no clock, no project imports beyond the event types.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from procman.events import Event, Exited, Hung, Restart, Want
from procman.spec import BackendSpec
from procman.states import State

__all__ = [
    "EXTERNAL_SIGNALS",
    "REPORTS",
    "Cause",
    "Death",
    "exit_cause",
    "external",
    "external_signal",
    "fault_words",
    "counted",
    "forgivable",
    "heard_first",
    "innocent",
    "of_exit",
    "of_hang",
    "recorded",
]

Cause = Literal["crash", "fatal", "hang", "stall"]

#: Signals a process does not raise by failing itself: someone (a user, the OOM killer) killed it.
EXTERNAL_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
#: The events that may report a death (:func:`recorded`).
REPORTS: frozenset[type] = frozenset({Exited, Hung, Restart})
#: The restart reasons that are a death of the READY process (a manual restart is none).
_FAILURES: dict[str, Cause] = {"crash": "crash", "hang": "hang", "fatal": "fatal"}


@dataclass(frozen=True, slots=True)
class Death:
    """How one process ended: ``cause``, its exit code (negative: the signal; None when the supervisor
    killed it or nobody knows), the requests in flight then, and whether one alone is to blame."""

    cause: Cause
    code: int | None = None
    in_flight: int = 1
    blamed: bool = False


def external_signal(code: int | None) -> bool:
    """Whether exit ``code`` means the process was killed from outside (by a signal it did not raise itself)."""
    return code is not None and code < 0 and -code in EXTERNAL_SIGNALS


def external(death: Death) -> bool:
    """Killed from outside (a signal it did not raise itself) rather than failing by itself; a hang, when the
    process was found stopped by SIGSTOP (``code`` ``-SIGSTOP``: silenced from outside, not by a request)."""
    if death.cause == "hang":
        return death.code == -signal.SIGSTOP
    return death.cause == "crash" and external_signal(death.code)


def innocent(death: Death) -> bool:
    """The death was plausibly not the doing of a request in flight in it."""
    return external(death) or death.cause in ("fatal", "stall") or death.in_flight != 1


def counted(death: Death) -> bool:
    """Whether the death counted as a failure toward the backoff: not blamed on a poison request, and not a hang
    of a process found stopped by a signal (someone else's doing, as ``decide()`` reads ``outside``)."""
    return not death.blamed and not (death.cause == "hang" and external(death))


def _judged(death: Death) -> Death:
    return dataclasses.replace(death, blamed=not innocent(death))


def exit_cause(code: int | None, tail: Iterable[str], fatal_patterns: Iterable[str]) -> Literal["fatal", "crash"]:
    """Why a process died on its own: ``fatal`` when it exited non-zero (or by a signal) and one of
    its last lines holds one of ``fatal_patterns`` (ignoring case), else ``crash``."""
    if code == 0:
        return "crash"
    lowered = [line.lower() for line in tail]
    patterns = [p.lower() for p in fatal_patterns if p]
    return "fatal" if any(p in line for line in lowered for p in patterns) else "crash"


def of_exit(code: int | None, tail: Iterable[str], fatal_patterns: Iterable[str], in_flight: int) -> Death:
    """A READY process that exited by itself with ``code`` after printing ``tail``, ``in_flight`` requests in it."""
    return _judged(Death(exit_cause(code, tail, fatal_patterns), code, in_flight))


def of_hang(in_flight: int, stopped: bool = False) -> Death:
    """A READY process that failed its health probes with ``in_flight`` requests in it (killed: no exit code;
    ``stopped``: it was found stopped by a signal, so its code says ``-SIGSTOP``)."""
    return _judged(Death("hang", -signal.SIGSTOP if stopped else None, in_flight))


def recorded(state: State, event: Event, generation: int, in_flight: int, code: int | None) -> Death | None:
    """The death ``event`` reports of the READY process of ``generation`` (``in_flight`` requests, exit ``code``),
    before ``decide()`` takes it; None when it reports none (another process, another state, not a failure)."""
    if state is not State.READY:
        return None
    match event:
        case Exited() if event.generation == generation:
            return Death(event.cause, code, in_flight, event.blamed)
        case Hung() if event.generation == generation:
            return of_hang(in_flight, event.outside)
        case Restart() if event.reason in _FAILURES and event.generation in (None, generation):
            stopped = -signal.SIGSTOP if event.outside else None
            return Death(_FAILURES[event.reason], stopped, in_flight, event.blamed)
    return None


def forgivable(deaths: Mapping[int, Death], generations: Iterable[int]) -> list[int]:
    """Of ``generations`` (whose deaths the router found a poison request in), those whose death was counted
    as a failure and so comes off the count: known and :func:`counted`."""
    return [g for g in sorted(set(generations)) if (d := deaths.get(g)) is not None and counted(d)]


def fault_words(reason: str, spec: BackendSpec) -> str:
    """Why the supervisor killed a READY process, for ``last_error`` (``hang``: the failed probes)."""
    if reason == "hang":
        timeout = f"{spec.health_timeout_s:g}s timeout"
        return f"{spec.health_path} failed {spec.health_failures} probes in a row ({timeout})"
    if reason == "fatal":
        return "the backend reported an unrecoverable (fatal) error"
    return reason


def heard_first(state: State, event: Event, exited: bool) -> bool:
    """Whether the READY process's exit (``exited``: it is gone, maybe not yet reported) is decided before
    ``event``: a caller that wants the process must never get a lease on a dead one."""
    return exited and state is State.READY and type(event) is Want
