"""Each model's suspect lane: the retries of requests caught together in a death run one at a time,
and new requests wait while suspects are served, so a poison request's retry runs alone.

Who waits for whom (the whole of it, so no cycle can form): a suspect waits for the suspect before it
to give the lane back; an ordinary request waits for the suspects to be through. Nobody waits while
holding a lease (both waits come before ``backend.request()``), and a holder gives the lane back as soon
as its answer begins, or after ``hold_s`` at most, so every wait ends. Pure asyncio, no project imports.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

__all__ = ["SuspectLane", "Turn"]


class SuspectLane:
    """``async with lane.suspect(hold_s) as turn:`` one suspect at a time (``turn()`` gives the lane back
    early, ``turn.held`` says whether it still has it); ``await lane.ordinary(bound_s)``: wait (at most
    ``bound_s``) until no suspect waits or runs."""

    __slots__ = ("_clear", "_lock", "_pending")

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._pending = 0  # suspects waiting for the lane or holding it
        self._clear = asyncio.Event()
        self._clear.set()

    @property
    def pending(self) -> int:
        return self._pending

    async def ordinary(self, bound_s: float) -> None:
        """A new request waits while suspects are served (their retries then run alone), ``bound_s`` at most."""
        if self._pending:
            # Suspects still queued after the bound: go on beside them rather than wait longer. asyncio.timeout,
            # not wait_for: Python 3.11's wait_for loses a cancel that comes as the event is set (see memwatch.py).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(bound_s):
                    await self._clear.wait()

    @asynccontextmanager
    async def suspect(self, hold_s: float) -> AsyncIterator[Turn]:
        self._pending += 1
        self._clear.clear()
        turn = Turn(self._lock)
        timer: asyncio.TimerHandle | None = None
        try:
            await self._lock.acquire()
            turn.held = True
            timer = asyncio.get_running_loop().call_later(hold_s, turn)
            yield turn
        finally:
            if timer is not None:
                timer.cancel()
            turn()
            self._pending -= 1
            if not self._pending:
                self._clear.set()


class Turn:
    """A suspect's turn in the lane: ``held`` while it has the lane; calling it gives the lane back (once)."""

    __slots__ = ("_lock", "held")

    def __init__(self, lock: asyncio.Lock) -> None:
        self._lock = lock
        self.held = False

    def __call__(self) -> None:
        if self.held:
            self.held = False
            self._lock.release()
