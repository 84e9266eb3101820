"""Wall-clock marks of this process's start, for the cold-start breakdown (``/health`` shows them).

Stdlib only, so ``modelserver/__main__.py`` can mark the moment the interpreter is up before
anything heavy is imported. Marks are ``time.time()`` seconds (comparable across processes on
one machine): ``process`` (the kernel's start time of this pid, Linux only), ``interpreter``
(``__main__`` running), ``imports`` (``main()`` entered: the server's modules imported),
``load_start`` / ``loaded`` (the engine's load, OpenVINO's import included; the engine's own
``load_s`` in ``/health`` is the pipeline construction within it), ``first_request`` (the
first request handed the loaded engine).
"""

from __future__ import annotations

import os
import time

__all__ = ["mark", "marks"]

_MARKS: dict[str, float] = {}


def mark(name: str) -> None:
    """Record ``name`` now, once (a later call keeps the first time)."""
    _MARKS.setdefault(name, time.time())


def marks() -> dict[str, float]:
    found = dict(_MARKS)
    started = _process_start()
    if started is not None:
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
