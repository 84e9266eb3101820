"""The model server's stderr log handler: the lines of one event-loop step written together.

Every request writes its access line (:class:`modelserver.app.RequestLog`) on the event loop. Written one
by one, each is a ``write`` to the pipe the router reads: at 16 clients x 1 text, 16 writes a batch, ~45 us
of the loop's CPU a request measured with the line and without it. :class:`LoopLines` keeps the access
lines (INFO and DEBUG of ``modelserver.access``) logged on the loop's thread and writes them in one go at
the end of that loop step (a ``call_soon``). Every other line is written at once, after what is kept, so
the order holds: uvicorn's, the model's, a warning, a record of another thread (the loader, a worker),
a record with no loop running. Lines kept when the process ends are written by ``logging.shutdown()``
(the interpreter's exit, and :func:`modelserver.cli._exit_fatal` before ``os._exit``), or by the next
line written at once (uvicorn's "Shutting down" before a signal's exit). What a SIGKILL can lose is the
access lines of the loop step it interrupts.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TextIO

__all__ = ["LoopLines"]


class LoopLines(logging.StreamHandler):  # type: ignore[type-arg]
    """A :class:`logging.StreamHandler` whose access lines logged on a running loop wait for the end of the step."""

    #: The loggers whose INFO and DEBUG lines may wait for the end of the loop step.
    KEPT = frozenset({"modelserver.access"})

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self._kept: list[str] = []
        self._due: asyncio.AbstractEventLoop | None = None  # the loop a flush is scheduled on

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + self.terminator
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
            self.handleError(record)
            return
        self._kept.append(line)
        loop = _running_loop() if record.levelno < logging.WARNING and record.name in self.KEPT else None
        if loop is None:
            self.flush()
        elif self._due is not loop:
            self._due = loop
            loop.call_soon(self.flush)

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]  # created by Handler.__init__
            self._due = None
            if not self._kept:
                return
            text, self._kept = "".join(self._kept), []
            try:
                self.stream.write(text)
                self.stream.flush()
            except (OSError, ValueError):  # stderr closed or gone: the lines have nowhere to go
                pass


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
