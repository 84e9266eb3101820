"""The pump thread and the async stream of the OpenVINO LLM engine, against a scripted pipeline (no model)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import openvino_genai as ov_genai
import pytest

from modelserver.engines.llm import Event, LLMStream, Pump, Ticket, _deliverer, continued_prompt
from modelserver.errors import EngineError, FatalEngineError, RequestError
from modelserver.textstream import IncrementalDetokenizer

RUNNING, FINISHED, IGNORED = (
    ov_genai.GenerationStatus.RUNNING,
    ov_genai.GenerationStatus.FINISHED,
    ov_genai.GenerationStatus.IGNORED,
)


@dataclass
class Output:
    generated_ids: list[int]
    finish_reason: Any = ov_genai.GenerationFinishReason.NONE


@dataclass
class ScriptedHandle:
    """Emits one scripted token per step; ends with ``finish`` (or IGNORED) after the last one.

    An ``endless`` handle repeats its tokens forever: only a cancel ends it, however fast the pump steps.
    """

    tokens: list[int]
    finish: Any = ov_genai.GenerationFinishReason.LENGTH
    ignored: bool = False
    endless: bool = False
    pending: list[int] = field(default_factory=list)
    status: Any = RUNNING
    cancelled: bool = False

    def advance(self) -> None:
        if self.status != RUNNING:
            return
        if self.ignored:
            self.status = IGNORED
            return
        token = self.tokens.pop(0)
        self.pending.append(token)
        if self.endless:
            self.tokens.append(token)
        if not self.tokens:
            self.status = FINISHED

    def can_read(self) -> bool:
        return bool(self.pending)

    def read(self) -> dict[int, Output]:
        ids, self.pending = self.pending, []
        return {0: Output(ids, self.finish if self.status == FINISHED else ov_genai.GenerationFinishReason.NONE)}

    def get_status(self) -> Any:
        return self.status

    def cancel(self) -> None:
        self.cancelled = True
        self.status = ov_genai.GenerationStatus.CANCEL


class ScriptedPipeline:
    def __init__(self) -> None:
        self.scripts: dict[int, ScriptedHandle] = {}
        self.handles: dict[int, ScriptedHandle] = {}
        self.fail_with: Exception | None = None
        self.steps = 0

    def add_request(self, request_id: int, input_ids: Any, config: Any) -> ScriptedHandle:
        handle = self.scripts[request_id]
        self.handles[request_id] = handle
        return handle

    def has_non_finished_requests(self) -> bool:
        return any(h.status == RUNNING for h in self.handles.values())

    def step(self) -> None:
        self.steps += 1
        if self.fail_with is not None:
            raise self.fail_with
        for handle in self.handles.values():
            handle.advance()

    def get_metrics(self) -> Any:  # PipelineMetrics after a step, as /health reads it
        running = sum(h.status == RUNNING for h in self.handles.values())
        return SimpleNamespace(scheduled_requests=running, cache_usage=0.0, cache_size_in_bytes=0)


class Ids:
    shape = (1, 3)


@pytest.fixture
def pipeline() -> Iterator[ScriptedPipeline]:
    yield ScriptedPipeline()


@pytest.fixture
def pump(pipeline: ScriptedPipeline) -> Iterator[Pump]:
    """A pump not started yet: a test submits what must be admitted together, then starts it."""
    pump = Pump(pipeline)
    yield pump
    pump.stop()


def start(pump: Pump, pipeline: ScriptedPipeline, request_id: int, handle: ScriptedHandle) -> LLMStream:
    pipeline.scripts[request_id] = handle
    events: asyncio.Queue[Event] = asyncio.Queue()
    decode = letters
    ticket = Ticket(request_id, Ids(), None, _deliverer(asyncio.get_running_loop(), events),
                    detokenizer=IncrementalDetokenizer(decode))
    pump.submit(ticket)
    return LLMStream(pump, ticket, events, decode=decode)


def letters(ids: Sequence[int]) -> str:
    return "".join(chr(96 + i) for i in ids)


async def until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Wait for what the pump thread does after it delivers an event (a loaded machine may preempt it there)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"not true after {timeout_s}s"
        await asyncio.sleep(0.01)


async def collect(stream: LLMStream) -> str:
    return "".join([text async for text in stream])


async def test_two_requests_are_stepped_together_and_finish_with_their_reasons(
    pump: Pump, pipeline: ScriptedPipeline
) -> None:
    a = start(pump, pipeline, 1, ScriptedHandle([1, 2, 3], finish=ov_genai.GenerationFinishReason.STOP))
    b = start(pump, pipeline, 2, ScriptedHandle([4, 5, 6, 7, 8]))
    pump.start()
    texts = await asyncio.gather(collect(a), collect(b))
    assert texts == ["abc", "defgh"]
    assert (a.finish_reason, a.completion_tokens, a.prompt_tokens) == ("stop", 3, 3)
    assert (b.finish_reason, b.completion_tokens) == ("length", 5)
    assert pipeline.steps == 5  # batched: five steps served both, not 3 + 5
    assert (pump.completed, pump.cancelled, pump.running) == (2, 0, 0)


async def test_the_pump_thread_decodes_and_the_stream_only_relays_the_text(
    pump: Pump, pipeline: ScriptedPipeline
) -> None:
    threads: set[str] = set()

    def decode(ids: Sequence[int]) -> str:
        threads.add(threading.current_thread().name)
        return letters(ids)

    pipeline.scripts[1] = ScriptedHandle([1, 2, 3, 4])
    events: asyncio.Queue[Event] = asyncio.Queue()
    ticket = Ticket(1, Ids(), None, _deliverer(asyncio.get_running_loop(), events),
                    detokenizer=IncrementalDetokenizer(decode))
    pump.submit(ticket)
    stream = LLMStream(pump, ticket, events, decode=decode)
    pump.start()
    assert await collect(stream) == "abcd"
    assert threads == {"ov-pump"}  # a decode releases the GIL: on the event loop it would wait for a step


async def test_closing_a_stream_cancels_its_handle(pump: Pump, pipeline: ScriptedPipeline) -> None:
    handle = ScriptedHandle(list(range(1, 27)), endless=True)  # a scripted pump steps in microseconds
    stream = start(pump, pipeline, 1, handle)
    pump.start()
    iterator = aiter(stream)
    assert await anext(iterator)
    await stream.aclose()
    await until(lambda: (pump.cancelled, pump.running) == (1, 0))  # the pump cancels the handle, then counts it
    assert handle.cancelled


async def test_a_failing_step_fails_every_request_in_flight_and_later_ones_as_fatal(
    pump: Pump, pipeline: ScriptedPipeline
) -> None:
    """A step that raised leaves openvino_genai's scheduler in its scheduling phase (every later step failed with
    ``Check 'get_num_scheduled_tokens() == 0' failed`` in a soak): the process must be replaced, not kept serving
    500s, so the error is fatal whatever its text, and the pipeline is never stepped again."""
    streams = [start(pump, pipeline, i, ScriptedHandle([1, 2, 3])) for i in (1, 2)]
    pipeline.fail_with = RuntimeError("std::future_error: No associated state\nat sequence_group.hpp:784")
    pump.start()
    for stream in streams:
        with pytest.raises(FatalEngineError, match="No associated state at sequence_group") as caught:
            await collect(stream)
        assert "\n" not in caught.value.message
    await until(lambda: pump.running == 0)  # the pump thread fails each ticket, then clears them all
    pipeline.fail_with = None
    with pytest.raises(FatalEngineError, match="step failed"):
        await collect(start(pump, pipeline, 3, ScriptedHandle([1, 2])))  # a new request: the same fatal error
    assert pipeline.steps == 1 and 3 not in pipeline.handles  # never stepped (nor given a request) again


async def test_a_step_refusing_a_request_fails_those_in_flight_and_the_pipeline_serves_on(
    pump: Pump, pipeline: ScriptedPipeline
) -> None:
    """The scheduler's refusal of a prompt above ``max_num_batched_tokens`` raises from ``step()`` but leaves the
    pipeline usable (the real one: test_modelserver_real.py): an ordinary engine error, and the next request is
    served; the pump does not step again in a loop while idle."""
    refused = start(pump, pipeline, 1, ScriptedHandle([1, 2]))
    pipeline.fail_with = RuntimeError("Check failed: prompt of 61 tokens is longer than max number of tokens in batch")
    pump.start()
    with pytest.raises(RuntimeError, match="longer than max number of tokens in batch"):
        await collect(refused)
    await until(lambda: pump.running == 0)
    pipeline.fail_with = None
    assert pipeline.steps == 1  # idle after the refusal: no step until a new request
    assert await collect(start(pump, pipeline, 2, ScriptedHandle([1, 2]))) == "ab"


async def test_an_ignored_request_is_an_engine_error(pump: Pump, pipeline: ScriptedPipeline) -> None:
    stream = start(pump, pipeline, 1, ScriptedHandle([1], ignored=True))
    pump.start()
    with pytest.raises(EngineError, match="KV cache"):
        await collect(stream)


async def test_a_request_cancelled_before_admission_never_reaches_the_pipeline(
    pump: Pump, pipeline: ScriptedPipeline
) -> None:
    cancelled = start(pump, pipeline, 1, ScriptedHandle([1, 2]))
    await cancelled.aclose()
    later = start(pump, pipeline, 2, ScriptedHandle([3]))
    pump.start()
    assert await collect(later) == "c"  # admitted after the cancelled one, in the same drain
    assert list(pipeline.handles) == [2]


async def test_a_halted_pump_never_calls_the_pipeline_again(pump: Pump, pipeline: ScriptedPipeline) -> None:
    first = start(pump, pipeline, 1, ScriptedHandle([1]))
    pump.start()
    assert await collect(first) == "a"
    pump.halt()
    await asyncio.to_thread(pump._thread.join, 60)
    steps = pipeline.steps
    start(pump, pipeline, 2, ScriptedHandle([2]))
    assert not pump._thread.is_alive() and pipeline.steps == steps and 2 not in pipeline.handles


def render(history: list[dict[str, Any]], add_generation_prompt: bool, tools: Any) -> str:
    """A template that strips each message and closes it with <end> (as most chat templates do)."""
    text = "".join(f"<{m['role']}>{m['content'].strip()}<end>" for m in history)
    return text + ("<assistant>" if add_generation_prompt else "")


@pytest.mark.parametrize(
    ("partial", "expected"),
    [
        ("The answer is", "<user>q<end><assistant>The answer is"),
        ("The answer is ", "<user>q<end><assistant>The answer is"),  # stripped by the template: cut at the text
        ("", "<user>q<end><assistant>"),  # nothing relayed yet: an ordinary generation prompt
    ],
)
def test_continued_prompt_leaves_the_final_message_open(partial: str, expected: str) -> None:
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": partial}]
    assert continued_prompt(render, history, None) == expected


def test_continued_prompt_refuses_a_template_that_loses_the_text() -> None:
    def lossy(history: list[dict[str, Any]], add_generation_prompt: bool, tools: Any) -> str:
        return "<assistant>…<end>"

    with pytest.raises(RequestError, match="continue_final_message"):
        continued_prompt(lossy, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "abc"}], None)
