"""Dynamic batching: concurrent requests to one model gathered into one call on its worker.

::

    request --submit--> pending ──(worker idle and: as many requests as were under way when
                                   the last batch ended, or max_batch inputs, or batch_wait_ms
                                   held)──> run(requests) on the model's SerialWorker
                                   ──> each request's own answer

Requests that arrive while a batch runs wait for it to end and then go together, so under
load the batch size follows the concurrency by itself. An idle model then holds its requests
for company until as many are waiting as were under way when the last batch ended (the
clients it just answered come back): at most ``batch_wait_ms`` after a request came or,
right after a batch, ``batch_wait_ms`` or a quarter of that batch's call, whichever is
longer, after it ended. Without that hold, N closed-loop clients settle into two alternating
half batches (the requests that came during a batch leave as it ends, before the ones it
answered are back), and on a busy machine their return trip takes longer than a fixed few
milliseconds: answering and parsing 16 requests costs a fair part of what computing them
does. Serial traffic (one client, or a few far apart) is not held at all: the last batch
ended with one request under way.

``run`` answers each request on its own: a result, or the exception that request fails with
(a 400 for its input, say) while the others get theirs. A batch whose call raises is run
again request by request, so an error reaches only the request that caused it.

Everything here runs on the event loop (no locks); the blocking call runs on the worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from modelserver.engines.media_base import SerialWorker

__all__ = ["Abandoned", "BatchOptions", "Batcher", "Inputs", "calls", "split"]

Req = TypeVar("Req")
Res = TypeVar("Res")

DEFAULT_WAIT_MS = 2.0
DEFAULT_MAX_BATCH = 32


class Inputs(list[str]):
    """A request's texts, marked ``gone`` (on the loop) once its request was cancelled: its client left. The worker
    reads the mark between the pipeline calls of a large request and skips those that only gone requests need."""

    gone = False


class Abandoned(Exception):
    """The answer of a request whose work was skipped because its client had left (nobody reads it)."""


def gone(inputs: Sequence[str]) -> bool:
    return getattr(inputs, "gone", False) is True


@dataclass(frozen=True, slots=True)
class BatchOptions:
    """``batch_wait_ms``: longest an idle model holds a request for others; ``max_batch``: inputs per call."""

    wait_ms: float = DEFAULT_WAIT_MS
    max_batch: int = DEFAULT_MAX_BATCH


@dataclass(slots=True, eq=False)
class _Pending(Generic[Req, Res]):
    request: Req
    size: int
    future: asyncio.Future[Res]
    since: float = field(default_factory=time.monotonic)


class Batcher(Generic[Req, Res]):
    """``await submit(request, size)`` -> ``run``'s answer for ``request``, computed in one call with others.

    ``run`` maps a list of requests to one answer per request, in order (a result, or an
    exception for that request alone); it is called on ``worker``. ``size`` is the request's
    number of inputs, which ``max_batch`` counts.
    """

    def __init__(self, worker: SerialWorker, run: Callable[[list[Req]], Sequence[Res | BaseException]],
                 options: BatchOptions) -> None:
        self._worker = worker
        self._run = run
        self._wait_s = max(0.0, options.wait_ms) / 1000
        self._max = max(1, options.max_batch)
        self._pending: list[_Pending[Req, Res]] = []
        self._busy_since: float | None = None  # when the running batch was dispatched; None: idle
        self._timer: asyncio.TimerHandle | None = None
        self._expected = 1  # requests under way when the last batch ended: the company to wait for
        self._return_by = 0.0  # until when an idle model waits for the clients its last batch answered
        self.batches = 0
        self.largest = 0

    def stats(self) -> dict[str, Any]:
        return {"batches": self.batches, "largest_batch": self.largest}

    async def submit(self, request: Req, size: int = 1) -> Res:
        future: asyncio.Future[Res] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(request, size, future))
        self._consider()
        return await future

    def _inputs(self) -> int:
        return sum(p.size for p in self._pending)

    def _consider(self) -> None:
        """Dispatch now when due, else make sure a timer will look again when the oldest request is due.

        Due (the model idle): the expected company is waiting, or ``max_batch`` inputs are, or the
        oldest request waited ``batch_wait_ms`` and the return trip of the last batch's clients is over.
        """
        self._pending = [p for p in self._pending if not p.future.done()]  # cancelled while waiting
        if self._busy_since is not None or not self._pending:
            return
        now, due = time.monotonic(), max(self._pending[0].since + self._wait_s, self._return_by)
        if len(self._pending) >= self._expected or self._inputs() >= self._max or now >= due:
            self._dispatch()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(due - now, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._consider()

    def _take(self) -> list[_Pending[Req, Res]]:
        """The oldest requests up to ``max_batch`` inputs (always at least one, however large)."""
        taken: list[_Pending[Req, Res]] = []
        count = 0
        while self._pending and (not taken or count + self._pending[0].size <= self._max):
            request = self._pending.pop(0)
            taken.append(request)
            count += request.size
        return taken

    def _dispatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch = self._take()
        self._busy_since = time.monotonic()
        self.batches += 1
        self.largest = max(self.largest, sum(p.size for p in batch))
        requests = [p.request for p in batch]
        self._worker.call(lambda: self._call(requests), lambda answers: self._finish(batch, answers))

    def _call(self, requests: list[Req]) -> list[Res | BaseException]:
        """On the worker: one call for every request; if it raises, each request alone (the error reaches its owner)."""
        try:
            return self._answers(requests)
        except Exception as exc:
            if len(requests) == 1:
                return [exc]
        answers: list[Res | BaseException] = []
        for request in requests:
            try:
                answers += self._answers([request])
            except Exception as exc:
                answers.append(exc)
        return answers

    def _answers(self, requests: list[Req]) -> list[Res | BaseException]:
        answers = list(self._run(requests))
        if len(answers) != len(requests):
            raise RuntimeError(f"the batch returned {len(answers)} answers for {len(requests)} requests")
        return answers

    def _finish(self, batch: list[_Pending[Req, Res]], done: list[Res | BaseException] | BaseException) -> None:
        """On the loop: each request's answer (``done``: the answers, or what the worker itself failed with)."""
        call_s = time.monotonic() - (self._busy_since or 0.0)
        self._busy_since = None
        answers = [done] * len(batch) if isinstance(done, BaseException) else done
        for pending, answer in zip(batch, answers, strict=True):
            if pending.future.done():
                continue
            if isinstance(answer, BaseException):
                pending.future.set_exception(answer)
            else:
                pending.future.set_result(answer)
        self._pending = [p for p in self._pending if not p.future.done()]
        self._expected = len(batch) + len(self._pending)
        self._return_by = time.monotonic() + (max(self._wait_s, call_s / 4) if self._wait_s > 0 else 0.0)
        self._consider()


def calls(tokens: Sequence[int], budget: int) -> list[range]:
    """``tokens`` (each input's count, in order) cut into consecutive pipeline calls whose inputs, padded to the
    call's longest, hold at most ``budget`` tokens (a call holds one input at least, however long).

    One call's memory grows with its padded tokens, and the CPU plugin keeps it: 2048 inputs of ~240 tokens in
    one call left minilm's server at 8.4 GB resident, in calls of 32 at 0.4 GB. Short inputs still go in one
    call: each call costs ~3 ms more (64 short texts in two calls of 32 took ~20% longer than in one).
    """
    pieces: list[range] = []
    start, longest = 0, 0
    for at, count in enumerate(tokens):
        wider = max(longest, count)
        if at > start and (at - start + 1) * wider > budget:
            pieces.append(range(start, at))
            start, wider = at, count
        longest = wider
    if start < len(tokens):
        pieces.append(range(start, len(tokens)))
    return pieces


def split(flat: Sequence[Res], sizes: Sequence[int]) -> list[list[Res]]:
    """``flat`` cut into consecutive pieces of ``sizes``."""
    if len(flat) != sum(sizes):
        raise RuntimeError(f"the pipeline returned {len(flat)} answers for {sum(sizes)} inputs")
    pieces, start = [], 0
    for size in sizes:
        pieces.append(list(flat[start : start + size]))
        start += size
    return pieces
