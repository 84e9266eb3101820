"""The llm engine's first answers from the cached stateful pipeline, then the switch to continuous batching
(modelserver/engines/llm_first.py), on a real OpenVINO pipeline (the tiny Qwen2 IR in models/): requests
before, during and after the switch are all answered with the same max_tokens/finish semantics, one asking
for logprobs waits for the continuous-batching pipeline, and the stateful pipeline is let go after it."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import openvino_genai as ov_genai
import pytest

from modelserver.engines import llm, llm_first
from modelserver.engines.base import ChatTurn, GenerationRequest, SamplingParams
from modelserver.spec import build_model_spec
from modelserver.textstream import IncrementalDetokenizer

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]

QWEN = Path(__file__).resolve().parent.parent / "models" / "qwen2-tools-tiny-ov"


def ask(text: str, max_tokens: int, **fields: Any) -> GenerationRequest:
    return GenerationRequest(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                             messages=(ChatTurn("user", text),), **fields)


async def answer(engine: Any, request: GenerationRequest) -> tuple[str, Any]:
    stream = engine.generate(request)
    text = "".join([delta async for delta in stream])
    return text, stream


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(llm_first, "BUILD_AFTER_S", 120.0)  # the build begins after the first answer, not before
    spec = build_model_spec("qwen", {"task": "llm", "path": str(QWEN), "cache_dir": str(tmp_path / "cache")},
                            base_dir=tmp_path)
    loaded = llm.load(spec)
    yield loaded
    loaded._builder.join(120)  # a process must not exit mid-compile (the model server os._exit()s instead)
    loaded.close()


async def test_first_answers_come_from_the_stateful_pipeline_then_it_switches_and_lets_go(engine: Any) -> None:
    assert isinstance(engine, llm_first.Bridge) and engine.stats()["pipeline"] == "stateful"
    assert "LLMPipeline" in engine.describe()["engine"]
    first_pump = engine._first._pump
    text, stream = await answer(engine, ask("Count to ten.", 5))
    assert stream.completion_tokens == 5 and stream.finish_reason == "length" and text
    # the build starts now; requests keep coming while it runs and across the switch
    results: list[tuple[str, Any]] = []
    logprobs = asyncio.ensure_future(answer(engine, ask("Name a colour.", 4, logprobs=True)))
    for round_ in range(200):
        batch = await asyncio.gather(*(answer(engine, ask(f"Say {i}.", 3 + i % 3)) for i in range(3)))
        results += batch
        if engine.stats()["pipeline"] == "continuous_batching" and round_ >= 1:
            break
    assert engine.stats()["pipeline"] == "continuous_batching", "the continuous-batching pipeline never came"
    for i, (_, done) in enumerate(results):
        assert done.completion_tokens == 3 + i % 3 and done.finish_reason == "length"
    text, stream = await logprobs  # held for the continuous-batching pipeline: it reports each token's
    assert stream.completion_tokens == 4 and len(stream.token_logprobs()) == 4
    after = await asyncio.gather(*(answer(engine, ask("Count.", 6)) for _ in range(4)))
    assert all(done.completion_tokens == 6 and done.finish_reason == "length" for _, done in after)
    assert "ContinuousBatchingPipeline" in engine.describe()["engine"]
    # the stateful pipeline is let go: its pump ended and dropped it, the bridge holds neither generator
    assert engine._first is None and engine._deferred is None
    assert not first_pump.alive and first_pump._pipe is None


async def test_a_request_that_ends_at_eos_says_stop_as_the_other_pipeline_would(engine: Any) -> None:
    request = GenerationRequest(SamplingParams(max_tokens=200, temperature=0.0), messages=(ChatTurn("user", "Hi"),))
    _, stream = await answer(engine, request)
    assert stream.finish_reason in ("stop", "length")
    assert (stream.finish_reason == "length") == (stream.completion_tokens == 200)


async def test_a_cancelled_stream_frees_the_stateful_pump_for_the_next(engine: Any) -> None:
    stream = engine.generate(ask("Write a long story.", 500))
    async for _ in stream:
        break
    await stream.aclose()
    _, done = await answer(engine, ask("Say yes.", 3))
    assert done.completion_tokens == 3 and engine._current()._pump.cancelled + engine.stats()["cancelled"] >= 1


class BlockingPipe:
    """A stand-in for the stateful pipeline: each generate() streams two tokens once ``go`` is set."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.started = threading.Event()
        self.calls = 0

    def generate(self, input_ids: Any, config: Any, streamer: Any) -> None:
        self.calls += 1
        self.started.set()
        self.go.wait(30)
        for token in (5, 6):
            streamer.write(token)


class Collector:
    def __init__(self) -> None:
        self.submitted: list[Any] = []

    def submit(self, ticket: Any) -> None:
        self.submitted.append(ticket)

    def cancel(self, ticket: Any) -> None:
        ticket.cancelled.set()


def ticket(n: int, events: list[Any]) -> Any:
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = 2
    return llm.Ticket(n, None, config, events.append, detokenizer=IncrementalDetokenizer(lambda ids: "x" * len(ids)))


def test_at_the_switch_the_waiting_requests_go_to_continuous_batching_and_the_one_under_way_finishes() -> None:
    pipe, target, events = BlockingPipe(), Collector(), []
    pump = llm_first.SerialPump(pipe)
    pump.start()
    tickets = [ticket(n, events) for n in range(3)]
    for each in tickets:
        pump.submit(each)
    assert pipe.started.wait(30)  # the first is generating
    pump.finish(target)
    pipe.go.set()
    pump._thread.join(30)
    assert not pump.alive and pump._pipe is None and pipe.calls == 1
    assert target.submitted == tickets[1:]  # in order, not generated here
    assert events[-1] == ([], "", "length") and tickets[0].tokens == 2 and pump.answered.is_set()


async def test_a_burst_at_the_start_is_answered_whole_across_the_switch(engine: Any) -> None:
    burst = await asyncio.gather(*(answer(engine, ask(f"Tell me about {i}.", 24)) for i in range(10)))
    assert all(done.completion_tokens == 24 and done.finish_reason == "length" and text for text, done in burst)
    engine._builder.join(120)
    assert engine.stats()["pipeline"] == "continuous_batching"


async def test_request_ids_stay_unique_across_the_switch(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each generator counted its own ids from 1, so a request handed over at the switch (or any later one) and a
    new one to the continuous-batching pipeline could share one, and an id added twice breaks that pipeline for
    good (std::future_error, then every step fails; bench/chaosmix.py). One count per process."""
    ids: list[int] = []
    for pump in (llm.Pump, llm_first.SerialPump, llm_first.DeferredPump):
        submit = pump.submit
        monkeypatch.setattr(pump, "submit", lambda self, ticket, submit=submit: (ids.append(ticket.request_id),
                                                                                  submit(self, ticket))[1])
    before = await asyncio.gather(*(answer(engine, ask(f"Say {i}.", 2)) for i in range(3)))
    await asyncio.to_thread(engine._builder.join, 120)
    assert engine.stats()["pipeline"] == "continuous_batching"
    after = await asyncio.gather(*(answer(engine, ask(f"Count {i}.", 3)) for i in range(3)))
    assert all(done.completion_tokens == 2 for _, done in before) and all(d.completion_tokens == 3 for _, d in after)
    assert len(ids) >= 6 and len(set(ids)) == len(ids), ids
