"""Dynamic batching (modelserver/engines/batching.py) with a stand-in pipeline on a real SerialWorker."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from modelserver.engines.batching import Batcher, BatchOptions, calls
from modelserver.engines.media_base import SerialWorker

HOLD_S = 60.0  # a wait no test may sit out: reaching the answer at all proves a request was not held


class Pipeline:
    """Records each call's inputs; ``gate`` (when set) keeps a call running until the test opens it.

    A request is a list of texts, its answer their upper case; "bad" fails the whole call,
    "refused" only its own request (an answer that is an exception).
    """

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def __call__(self, requests: list[list[str]]) -> list[list[str] | BaseException]:
        self.calls.append([item for request in requests for item in request])
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        if any(item == "bad" for item in self.calls[-1]):
            raise ValueError("bad input")
        return [ValueError("refused") if "refused" in request else [item.upper() for item in request]
                for request in requests]


async def submit(batcher: Batcher[list[str], list[str]], items: list[str]) -> list[str]:
    return await batcher.submit(items, len(items))


@pytest.fixture
def worker() -> Iterator[SerialWorker]:
    pool = SerialWorker("test-batch")
    yield pool
    pool.close()


async def _busy(pipeline: Pipeline, batcher: Batcher[list[str], list[str]]) -> asyncio.Task[list[str]]:
    """Start a first request and return once the pipeline is inside its call, held by the gate."""
    pipeline.gate = threading.Event()
    first = asyncio.ensure_future(submit(batcher, ["first"]))
    assert await asyncio.to_thread(pipeline.entered.wait, 10)
    return first


async def test_a_lone_request_is_not_held_for_company(worker: SerialWorker) -> None:
    pipeline = Pipeline()
    batcher = Batcher(worker, pipeline, BatchOptions(wait_ms=HOLD_S * 1000))
    assert await asyncio.wait_for(submit(batcher, ["a", "b"]), 10) == ["A", "B"]
    assert await asyncio.wait_for(submit(batcher, ["c"]), 10) == ["C"]
    assert pipeline.calls == [["a", "b"], ["c"]]


async def test_requests_that_meet_while_a_batch_runs_go_together(worker: SerialWorker) -> None:
    pipeline = Pipeline()
    batcher = Batcher(worker, pipeline, BatchOptions(wait_ms=0))
    first = await _busy(pipeline, batcher)
    rest = [asyncio.ensure_future(submit(batcher, [text])) for text in ("x", "y", "z")]
    await asyncio.sleep(0)  # let them queue
    pipeline.gate.set()  # type: ignore[union-attr]
    assert await first == ["FIRST"]
    assert [await r for r in rest] == [["X"], ["Y"], ["Z"]]
    assert pipeline.calls == [["first"], ["x", "y", "z"]]
    assert batcher.stats() == {"batches": 2, "largest_batch": 3}


async def test_max_batch_splits_what_waited(worker: SerialWorker) -> None:
    pipeline = Pipeline()
    batcher = Batcher(worker, pipeline, BatchOptions(wait_ms=0, max_batch=2))
    first = await _busy(pipeline, batcher)
    rest = [asyncio.ensure_future(submit(batcher, items)) for items in (["a"], ["b"], ["c", "d", "e"])]
    await asyncio.sleep(0)
    pipeline.gate.set()  # type: ignore[union-attr]
    await first
    assert [await r for r in rest] == [["A"], ["B"], ["C", "D", "E"]]
    assert pipeline.calls == [["first"], ["a", "b"], ["c", "d", "e"]]  # one request larger than max_batch goes alone


async def test_an_idle_model_holds_requests_until_those_it_answered_are_back(worker: SerialWorker) -> None:
    pipeline = Pipeline()
    batcher = Batcher(worker, pipeline, BatchOptions(wait_ms=HOLD_S * 1000))
    first = await _busy(pipeline, batcher)  # alone: not held
    pair = asyncio.gather(submit(batcher, ["x"]), submit(batcher, ["y"]))
    await asyncio.sleep(0)
    pipeline.gate.set()  # type: ignore[union-attr]
    assert await first == ["FIRST"]  # three requests were under way as it ended: x and y wait for a third
    await asyncio.sleep(0.05)
    assert not pair.done() and pipeline.calls == [["first"]]
    assert await asyncio.wait_for(submit(batcher, ["p"]), 10) == ["P"]  # first's client is back
    assert list(await pair) == [["X"], ["Y"]]
    assert pipeline.calls == [["first"], ["x", "y", "p"]]


async def test_max_batch_inputs_end_the_hold(worker: SerialWorker) -> None:
    pipeline = Pipeline()
    batcher = Batcher(worker, pipeline, BatchOptions(wait_ms=HOLD_S * 1000, max_batch=3))
    first = await _busy(pipeline, batcher)
    held = [asyncio.ensure_future(submit(batcher, [text])) for text in ("a", "b", "c", "d")]
    await asyncio.sleep(0)
    pipeline.gate.set()  # type: ignore[union-attr]
    await first  # five were under way, but three inputs fill a batch
    assert [await r for r in held[:3]] == [["A"], ["B"], ["C"]]
    more = [asyncio.ensure_future(submit(batcher, ["e"]))]
    await asyncio.sleep(0.05)
    assert not held[3].done()  # d and e wait for the clients of a, b and c...
    more.append(asyncio.ensure_future(submit(batcher, ["f"])))
    assert await asyncio.wait_for(held[3], 10) == ["D"]  # ...until a third input fills the batch
    assert [await r for r in more] == [["E"], ["F"]]
    assert pipeline.calls == [["first"], ["a", "b", "c"], ["d", "e", "f"]]


@pytest.mark.parametrize(
    ("bad", "calls"),
    [
        ("bad", [["ok", "bad"], ["ok"], ["bad"]]),  # the call raised: each request again alone
        ("refused", [["ok", "refused"]]),  # the call answered that request with an exception: nothing run again
    ],
)
async def test_an_error_reaches_only_the_request_that_caused_it(worker: SerialWorker, bad: str,
                                                                calls: list[list[str]]) -> None:
    pipeline = Pipeline()
    batcher = Batcher(worker, pipeline, BatchOptions(wait_ms=0))
    first = await _busy(pipeline, batcher)
    good, failing = asyncio.ensure_future(submit(batcher, ["ok"])), asyncio.ensure_future(submit(batcher, [bad]))
    await asyncio.sleep(0)
    pipeline.gate.set()  # type: ignore[union-attr]
    await first
    assert await good == ["OK"]
    with pytest.raises(ValueError, match=bad):
        await failing
    assert pipeline.calls[1:] == calls


async def test_a_request_cancelled_while_waiting_is_left_out(worker: SerialWorker) -> None:
    pipeline = Pipeline()
    batcher = Batcher(worker, pipeline, BatchOptions(wait_ms=0))
    first = await _busy(pipeline, batcher)
    gone, kept = asyncio.ensure_future(submit(batcher, ["gone"])), asyncio.ensure_future(submit(batcher, ["kept"]))
    await asyncio.sleep(0)
    gone.cancel()
    pipeline.gate.set()  # type: ignore[union-attr]
    await first
    assert await kept == ["KEPT"]
    assert pipeline.calls == [["first"], ["kept"]]



@pytest.mark.parametrize(("tokens", "budget", "pieces"), [
    ([3, 3, 3, 3], 6, [(0, 2), (2, 4)]),
    ([1, 1, 1, 10, 1], 10, [(0, 3), (3, 4), (4, 5)]),  # padded to the call's longest
    ([20], 5, [(0, 1)]),  # one input a call at least, however long
    ([2] * 6, 100, [(0, 6)]),
    ([], 5, []),
])
def test_calls_hold_at_most_the_budget_of_padded_tokens(tokens: list[int], budget: int,
                                                        pieces: list[tuple[int, int]]) -> None:
    assert [(piece.start, piece.stop) for piece in calls(tokens, budget)] == pieces
