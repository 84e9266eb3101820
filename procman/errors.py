"""What procman raises. The router maps these to HTTP statuses in one place.

::

    ProcmanError
     ├ InvalidTransition        a state change the ALLOWED table forbids (a bug, never a client's fault)
     └ BackendUnavailable       ensure_ready could not give an address (reason, retry_after_s)
        ├ StartFailed           the process exited while starting (exit_code, log_tail)
        │  └ StartTimeout       the health path did not answer 200 within startup_timeout_s
        ├ StartInterrupted      a stop, unload, reload or shutdown (by) cut the awaited start short
        ├ InBackoff             recent failures; fails fast, retry_after_s = the remaining delay
        └ BackendClosed         the backend was removed or the manager is shutting down
"""

from __future__ import annotations

__all__ = [
    "BackendClosed",
    "BackendUnavailable",
    "InBackoff",
    "InvalidTransition",
    "ProcmanError",
    "StartFailed",
    "StartInterrupted",
    "StartTimeout",
]


class ProcmanError(Exception):
    """Base of everything procman raises."""


class InvalidTransition(ProcmanError, RuntimeError):
    """A transition that ``ALLOWED`` does not list was attempted."""


class BackendUnavailable(ProcmanError):
    """No ready backend to talk to; ``reason`` says why in words a user can act on."""

    def __init__(self, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return self.reason


class StartFailed(BackendUnavailable):
    """The process exited (or could not be run) while starting; the reason holds the log tail."""

    def __init__(
        self,
        reason: str,
        exit_code: int | None = None,
        log_tail: list[str] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(reason, retry_after_s)
        self.exit_code = exit_code
        self.log_tail = list(log_tail or [])


class StartTimeout(StartFailed):
    """The process stayed up but never answered 200 on its health path in time."""


class StartInterrupted(BackendUnavailable):
    """A stop, unload, reload or shutdown (``by``) interrupted the start this caller waited for."""

    def __init__(self, reason: str, by: str) -> None:
        super().__init__(reason)
        self.by = by


class InBackoff(BackendUnavailable):
    """The backend failed recently; ``retry_after_s`` is how long until the next try."""


class BackendClosed(BackendUnavailable):
    """The backend was removed (config reload) or the manager is shutting down."""
