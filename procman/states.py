"""The states of a supervised backend and the only transitions allowed between them.

This module must not depend on any other module of the project: it is the vocabulary
that everything else (the backend, the router's metrics, the tests) shares.
"""

from __future__ import annotations

import enum

__all__ = ["ALLOWED", "LOADED", "State"]


class State(enum.Enum):
    """Where a backend is in its life. The value is what snapshots and the API show."""

    STOPPED = "stopped"  # no process; the next request cold-starts one
    STARTING = "starting"  # a process was spawned and /health has not answered 200 yet
    READY = "ready"  # /health answered 200; requests are served
    STOPPING = "stopping"  # SIGTERM sent to the process group, waiting for it to go
    BACKOFF = "backoff"  # a start failed or the process died; waiting out a delay


ALLOWED: dict[State, frozenset[State]] = {
    State.STOPPED: frozenset(
        {
            State.STARTING,  # STOPPED -> STARTING: cold start (ensure_ready), reload of a loaded model
        }
    ),
    State.STARTING: frozenset(
        {
            State.READY,  # STARTING -> READY: the health path answered 200
            State.BACKOFF,  # STARTING -> BACKOFF: exited while starting, start timeout, no free address
            State.STOPPING,  # STARTING -> STOPPING: stop/unload/reload/shutdown interrupted the start
            State.STOPPED,  # STARTING -> STOPPED: refused (no room) or stopped before anything was spawned
        }
    ),
    State.READY: frozenset(
        {
            State.STOPPING,  # READY -> STOPPING: idle, unload, reload, shutdown, or the kill of a restart
            State.BACKOFF,  # READY -> BACKOFF: the process exited on its own (crash); relaunch after the delay
        }
    ),
    State.STOPPING: frozenset(
        {
            State.STOPPED,  # STOPPING -> STOPPED: the process group is reaped
            State.STARTING,  # STOPPING -> STARTING: manual restart, the old process is reaped, launch again
            State.BACKOFF,  # STOPPING -> BACKOFF: a hung or fatally failed process was killed; counts as a failure
        }
    ),
    State.BACKOFF: frozenset(
        {
            State.STARTING,  # BACKOFF -> STARTING: the delay is over (automatic relaunch or on-demand ensure_ready)
            State.STOPPED,  # BACKOFF -> STOPPED: stop/unload/remove while waiting; the pending relaunch is cancelled
        }
    ),
}

#: States in which a backend's process (or the room reserved for it) holds memory.
LOADED = frozenset({State.STARTING, State.READY, State.STOPPING})
