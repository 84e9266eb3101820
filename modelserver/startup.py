"""Wall-clock marks of this process's start, for the cold-start breakdown (``/health`` shows them).

Stdlib only, so ``modelserver/__main__.py`` can mark the moment the interpreter is up before
anything heavy is imported. Marks are ``time.time()`` seconds (comparable across processes on
one machine): ``process`` (the kernel's start time of this pid, Linux only), ``interpreter``
(``__main__`` running; for a spare that took an assignment, ``process`` and ``interpreter`` are
the moment of the assignment and ``spare`` its own start), ``imports`` (``main()`` entered: the
server's modules imported),
``load_start`` / ``loaded`` (the engine's load, OpenVINO's import included; the engine's own
``load_s`` in ``/health`` is the pipeline construction within it), ``first_request`` (the
first request handed the loaded engine).

:class:`Readiness` announces on stdout the moment the process serves (the engine loaded *and*
the socket listening) when the supervisor asked for it with ``OVROUTER_READY_TOKEN``:
procman reads the line from the output pipe and stops waiting without polling ``/health``.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

__all__ = ["FAULT_DIR_ENV", "READY_ENV", "READY_PREFIX", "Readiness", "fault_log", "mark", "marks", "restart"]

#: A folder for the traceback of every thread on a fatal signal (SIGSEGV, SIGABRT...): the test suite sets it.
FAULT_DIR_ENV = "OVROUTER_FAULT_DIR"

#: procman.process.READY_ENV and READY_PREFIX: the same names (modelserver imports no procman).
READY_ENV = "OVROUTER_READY_TOKEN"
READY_PREFIX = "ovrouter-ready "

_MARKS: dict[str, float] = {}


class Readiness:
    """Prints ``READY_PREFIX + token`` once, when both ``loaded()`` and ``listening()`` were called (in either
    order, from any thread); without a token (no supervisor asked) it prints nothing."""

    def __init__(self, token: str | None) -> None:
        self._token = token
        self._waiting = {"loaded", "listening"}
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> Readiness:
        """The token the supervisor passed, taken out of the environment (children of this process do not see it)."""
        return cls(os.environ.pop(READY_ENV, None) or None)

    def loaded(self) -> None:
        self._done("loaded")

    def listening(self) -> None:
        self._done("listening")

    def _done(self, what: str) -> None:
        with self._lock:
            if not self._waiting:
                return
            self._waiting.discard(what)
            if self._waiting or self._token is None:
                return
            sys.stdout.write(f"{READY_PREFIX}{self._token}\n")
            sys.stdout.flush()


def mark(name: str) -> None:
    """Record ``name`` now, once (a later call keeps the first time)."""
    _MARKS.setdefault(name, time.time())


def restart() -> None:
    """A spare (``modelserver.spare``) took its assignment: its start counts from now, as a fresh process's
    would (``process`` and ``interpreter`` now; ``spare`` keeps when the spare itself started)."""
    started = _process_start()
    _MARKS.clear()
    now = time.time()
    _MARKS.update({"process": now, "interpreter": now, "assigned": now})
    if started is not None:
        _MARKS["spare"] = started


def marks() -> dict[str, float]:
    found = dict(_MARKS)
    started = _process_start()
    if started is not None and "process" not in found:
        found["process"] = started
    return found


def _process_start() -> float | None:
    """This process's start in epoch seconds: ``/proc`` gives it in clock ticks since boot (Linux)."""
    try:
        with open(f"/proc/{os.getpid()}/stat", encoding="ascii") as stat:
            ticks = int(stat.read().rpartition(")")[2].split()[19])
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))


def fault_log() -> None:
    """With ``OVROUTER_FAULT_DIR`` set, a crash of this process leaves the Python traceback of every thread in
    ``<dir>/modelserver-<pid>.txt`` (``PYTHONFAULTHANDLER`` alone sends it to stderr: the router's log buffer)."""
    folder = os.environ.get(FAULT_DIR_ENV)
    if folder:
        os.makedirs(folder, exist_ok=True)
        faulthandler.enable(open(os.path.join(folder, f"modelserver-{os.getpid()}.txt"), "w"), all_threads=True)
