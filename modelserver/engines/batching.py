"""Dynamic batching: concurrent requests to one model gathered into one pipeline call.

::

    request --submit--> pending ──(worker idle and: max_batch inputs, or the oldest waited
                                   batch_wait_ms, or the traffic is serial)──> one call on the
                                   model's SerialWorker ──> each request's slice of the answer

Requests that arrive while a batch runs wait for it to end and then go together, so under
load the batch size follows the concurrency by itself; ``batch_wait_ms`` only decides how
long an idle model holds a request for company. A request that arrives alone while the
previous batch was alone too (serial traffic: one client, or a few far apart) is not held
at all. A batch whose call fails is run again request by request, so an error reaches only
the request that caused it.

Everything here runs on the event loop (no locks); the blocking call runs on the worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from modelserver.engines.media_base import SerialWorker

__all__ = ["BatchOptions", "Batcher"]

In = TypeVar("In")
Out = TypeVar("Out")

DEFAULT_WAIT_MS = 2.0
DEFAULT_MAX_BATCH = 32


@dataclass(frozen=True, slots=True)
class BatchOptions:
    """``batch_wait_ms``: longest an idle model holds a request for others; ``max_batch``: inputs per call."""

    wait_ms: float = DEFAULT_WAIT_MS
    max_batch: int = DEFAULT_MAX_BATCH


@dataclass(slots=True, eq=False)
class _Pending(Generic[In, Out]):
    items: list[In]
    future: asyncio.Future[list[Out]]
    since: float = field(default_factory=time.monotonic)


class Batcher(Generic[In, Out]):
    """``await submit(items)`` -> ``run(items)``'s answers for these items, computed in a batch with others.

    ``run`` maps a list of inputs to one answer per input, in order; it is called on ``worker``.
    """

    def __init__(self, worker: SerialWorker, run: Callable[[list[In]], Sequence[Out]], options: BatchOptions) -> None:
        self._worker = worker
        self._run = run
        self._wait_s = max(0.0, options.wait_ms) / 1000
        self._max = max(1, options.max_batch)
        self._pending: list[_Pending[In, Out]] = []
        self._busy = False
        self._timer: asyncio.TimerHandle | None = None
        self._last_alone = True  # the previous batch held a single request
        self.batches = 0
        self.largest = 0

    def stats(self) -> dict[str, Any]:
        return {"batches": self.batches, "largest_batch": self.largest}

    async def submit(self, items: Sequence[In]) -> list[Out]:
        future: asyncio.Future[list[Out]] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(list(items), future))
        self._consider()
        return await future

    def _inputs(self) -> int:
        return sum(len(p.items) for p in self._pending)

    def _consider(self, batch_ended: bool = False) -> None:
        """Dispatch now when due, else make sure a timer will look again when the oldest request is due.

        Due: the model is idle and the requests waited out a batch (``batch_ended``), or the traffic
        is serial, or the oldest waited ``batch_wait_ms``, or ``max_batch`` inputs are waiting.
        """
        self._pending = [p for p in self._pending if not p.future.done()]  # cancelled while waiting
        if self._busy or not self._pending:
            return
        serial = self._last_alone and len(self._pending) == 1
        waited = time.monotonic() - self._pending[0].since
        if batch_ended or serial or waited >= self._wait_s or self._inputs() >= self._max:
            self._dispatch()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._wait_s - waited, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._consider()

    def _take(self) -> list[_Pending[In, Out]]:
        """The oldest requests up to ``max_batch`` inputs (always at least one, however large)."""
        taken: list[_Pending[In, Out]] = []
        count = 0
        while self._pending and (not taken or count + len(self._pending[0].items) <= self._max):
            request = self._pending.pop(0)
            taken.append(request)
            count += len(request.items)
        return taken

    def _dispatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch = self._take()
        self._busy = True
        self._last_alone = len(batch) == 1
        self.batches += 1
        self.largest = max(self.largest, sum(len(p.items) for p in batch))
        task = asyncio.ensure_future(self._worker.run(self._call, [list(p.items) for p in batch]))
        task.add_done_callback(lambda done: self._finish(batch, done))

    def _call(self, groups: list[list[In]]) -> list[list[Out] | BaseException]:
        """On the worker: one call for every group; on failure, each group alone (the error reaches its owner)."""
        try:
            return _split(list(self._run([item for group in groups for item in group])), groups)
        except Exception as exc:
            if len(groups) == 1:
                return [exc]
        answers: list[list[Out] | BaseException] = []
        for group in groups:
            try:
                answers.append(list(self._run(group)))
            except Exception as exc:
                answers.append(exc)
        return answers

    def _finish(self, batch: list[_Pending[In, Out]], done: asyncio.Future[list[list[Out] | BaseException]]) -> None:
        self._busy = False
        if done.cancelled() or done.exception() is not None:  # the worker itself failed (shut down)
            error = done.exception() if not done.cancelled() else asyncio.CancelledError()
            answers: list[list[Out] | BaseException] = [error or RuntimeError("batch lost")] * len(batch)
        else:
            answers = done.result()
        for request, answer in zip(batch, answers, strict=True):
            if request.future.done():
                continue
            if isinstance(answer, BaseException):
                request.future.set_exception(answer)
            else:
                request.future.set_result(answer)
        self._consider(batch_ended=True)


def _split(flat: list[Out], groups: list[list[In]]) -> list[list[Out] | BaseException]:
    if len(flat) != sum(len(group) for group in groups):
        raise RuntimeError(f"the pipeline returned {len(flat)} answers for {sum(map(len, groups))} inputs")
    answers: list[list[Out] | BaseException] = []
    start = 0
    for group in groups:
        answers.append(flat[start : start + len(group)])
        start += len(group)
    return answers
