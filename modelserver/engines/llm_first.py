"""First answers from the cached stateful pipeline while the continuous-batching pipeline compiles.

On CPU, openvino 2026.4 cannot import the compiled blob of the ``ContinuousBatchingPipeline``
(its PagedAttention model), so every start of an ``llm`` compiles it (~2 s of a 2-core
machine for SmolLM2). The stateful ``LLMPipeline`` (``ATTENTION_BACKEND: SDPA``) imports its
blob from ``CACHE_DIR`` in a quarter of that. So a start on CPU with a ``cache_dir`` builds
the stateful pipeline first and is ready with it; it serves requests one at a time
(:class:`SerialPump`: ``generate()`` with a streamer, the same ``GenerationConfig``, token
ids, finish reasons and ``max_tokens`` as the continuous-batching pump) while the
continuous-batching pipeline is built in a thread of its own — once the first request has
been answered (or :data:`BUILD_AFTER_S` after the start when none came), so its compile does
not compete with that first answer. Then :class:`Bridge` switches: new requests go to the
continuous-batching pipeline, so do the ones still waiting for the stateful one, which
finishes the generation under way and is dropped (its memory goes with it). Requests that
ask for what only the continuous-batching pump reports (``logprobs``) or constrains
(structured output) wait for it instead.

``options: {first_answer: false}`` turns it off; a converting load (a ``.gguf`` being saved
as IR) and any device but CPU never use it.
"""

from __future__ import annotations

import copy
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import openvino_genai as ov_genai

from modelserver import settle
from modelserver.engines.base import GenerationRequest
from modelserver.engines.ov_options import ModelSource, one_line
from modelserver.errors import EngineError, LoadError
from modelserver.spec import ModelSpec

__all__ = ["BUILD_AFTER_S", "Bridge", "DeferredPump", "SerialPump", "load", "wanted"]

log = logging.getLogger(__name__)

#: The continuous-batching pipeline is built once the first answer is out, or this long after the start if no
#: request came by then; a first request still running then is waited for up to ``BUILD_AT_LATEST_S`` in all.
BUILD_AFTER_S = 1.5
BUILD_AT_LATEST_S = 30.0
#: The stateful pipeline's properties (beside the model's own ``ov_config`` and ``CACHE_DIR``).
STATEFUL = {"ATTENTION_BACKEND": "SDPA"}

#: ``OpenVINOTextGenerator(spec, pipe, source, properties, load_s, context, pump=..., label=...)``.
MakeGenerator = Callable[..., Any]


def wanted(spec: ModelSpec, source: ModelSource, option: bool | None) -> bool:
    """Whether this load starts with the stateful pipeline: on CPU, with a ``cache_dir``, from an IR folder
    with its own tokenizer, not converting, and not turned off."""
    return (option is not False and spec.device.upper() == "CPU" and bool(spec.cache_dir)
            and source.convert_into is None and source.tokenizer_path is None and source.path.is_dir())


class Stateful:
    """The ``LLMPipeline`` under the two names the generator reads of a continuous-batching pipeline."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe

    def get_tokenizer(self) -> Any:
        return self.pipe.get_tokenizer()

    def get_config(self) -> Any:
        return self.pipe.get_generation_config()

    def generate(self, *args: Any) -> Any:
        return self.pipe.generate(*args)


class _TicketStreamer(ov_genai.StreamerBase):  # type: ignore[misc]
    """Hands each token to its ticket as the continuous-batching pump would; cancels when the client went."""

    def __init__(self, ticket: Any, pump: SerialPump) -> None:
        super().__init__()
        self._ticket = ticket
        self._pump = pump
        self.last: int | None = None

    def write(self, token: int | list[int]) -> Any:
        ids = [int(t) for t in token] if isinstance(token, list) else [int(token)]
        if ids:
            self.last = ids[-1]
            self._ticket.tokens += len(ids)
            self._ticket.deliver((ids, self._ticket.detokenizer.push(ids), None))
        self._pump.advanced_at = time.monotonic()
        if self._ticket.cancelled.is_set():
            return ov_genai.StreamingStatus.CANCEL
        return ov_genai.StreamingStatus.RUNNING

    def end(self) -> None:
        pass


class SerialPump:
    """The stateful pipeline's pump: the same interface as :class:`modelserver.engines.llm.Pump`, one request
    at a time in arrival order (one thread calls the pipeline). :meth:`finish` ends it after the
    generation under way, hands the requests still waiting to another pump, and drops the pipeline."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._current: Any = None
        self._halted = False
        self.completed = 0
        self.cancelled = 0
        self.metrics: Any = None  # no scheduler figures
        self.answered = threading.Event()  # set once a request was answered
        self.advanced_at = time.monotonic()
        self._queued = 0
        self._target: Any = None  # after the switch: where the requests still waiting go
        self._thread = threading.Thread(target=self._run, name="ov-first-pump", daemon=True)

    @property
    def running(self) -> int:
        return self._queued

    @property
    def stuck_s(self) -> float:
        if not self._queued:
            return 0.0
        return max(time.monotonic() - self.advanced_at, 0.0)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def submit(self, ticket: Any) -> None:
        self._queued += 1
        self._inbox.put(ticket)

    def cancel(self, ticket: Any) -> None:
        ticket.cancelled.set()
        if self._target is not None:  # it may have been handed over
            self._target.cancel(ticket)

    def finish(self, target: Any) -> None:
        """The generation under way ends here; the requests still waiting go to ``target`` (the continuous-batching
        pump), in order; then the pump stops and lets go of the pipeline (nothing is submitted after this)."""
        self._target = target
        self._inbox.put(None)

    def stop(self, timeout_s: float = 5.0) -> None:
        """:meth:`halt`, then wait for the thread to end (``timeout_s`` at most; never from the thread itself)."""
        self.halt()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def halt(self) -> None:
        """Never touch the pipeline again (a fatal device error): the requests still waiting get an error."""
        self._halted = True
        self._inbox.put(None)

    def _run(self) -> None:
        while (ticket := self._inbox.get()) is not None:
            try:
                if self._halted:
                    ticket.deliver(EngineError("the model server is stopping"))
                elif self._target is not None:
                    self._target.submit(ticket)
                elif ticket.cancelled.is_set():
                    self.cancelled += 1
                else:
                    self._generate(ticket)
            finally:
                self._queued -= 1
                self.advanced_at = time.monotonic()
        self._pipe = None  # the pipeline goes once the last reference (the generator's) is dropped

    def _generate(self, ticket: Any) -> None:
        streamer = _TicketStreamer(ticket, self)
        try:
            self._pipe.generate(ticket.input_ids, ticket.config, streamer)
        except Exception as exc:
            log.error("the stateful pipeline failed: %s", one_line(exc))
            ticket.deliver(exc)
            return
        if ticket.cancelled.is_set():
            self.cancelled += 1
            log.info("request %d cancelled after %d tokens", ticket.request_id, ticket.tokens)
            return
        self.completed += 1
        ticket.deliver(([], ticket.detokenizer.flush(), _finish(ticket.config, ticket.tokens, streamer.last)))
        self.answered.set()


def _finish(config: Any, tokens: int, last: int | None) -> str:
    """``stop`` at an end-of-sequence or stop token, ``length`` at ``max_new_tokens`` (as the other pump says)."""
    stops = {int(config.eos_token_id), *(int(t) for t in config.stop_token_ids)}
    if last is not None and not config.ignore_eos and last in stops:
        return "stop"
    return "length" if tokens >= config.max_new_tokens else "stop"


class DeferredPump:
    """Holds the tickets of requests that need the continuous-batching pipeline until it is built."""

    def __init__(self, pipe: Any = None) -> None:
        self._lock = threading.Lock()
        self._held: list[Any] = []
        self._target: Any = None
        self._error: BaseException | None = None
        self.completed = self.cancelled = 0
        self.metrics: Any = None
        self.running = 0
        self.stuck_s = 0.0

    def start(self) -> None:
        pass

    def stop(self, timeout_s: float = 5.0) -> None:
        self.fail(EngineError("the model server is stopping"))

    def halt(self) -> None:
        self.stop()

    def submit(self, ticket: Any) -> None:
        with self._lock:
            target, error = self._target, self._error
            if target is None and error is None:
                self._held.append(ticket)
                return
        if target is not None:
            target.submit(ticket)
        elif error is not None:
            ticket.deliver(error)

    def cancel(self, ticket: Any) -> None:
        ticket.cancelled.set()
        if self._target is not None:
            self._target.cancel(ticket)

    def forward(self, target: Any) -> None:
        """The continuous-batching pump is running: every held ticket (and any later one) goes there."""
        with self._lock:
            self._target, held, self._held = target, self._held, []
        for ticket in held:
            target.submit(ticket)

    def fail(self, error: BaseException) -> None:
        with self._lock:
            self._error, held, self._held = error, self._held, []
        for ticket in held:
            ticket.deliver(error)


class Bridge:
    """The ``TextGenerator`` of a model that starts on the stateful pipeline; see the module doc."""

    def __init__(self, first: Any, deferred: Any, build: Callable[[], Any]) -> None:
        self._first: Any = first
        self._deferred: Any = deferred  # a generator over the same tokenizer whose pump is a DeferredPump
        self._full: Any = None
        self._build_full = build
        self._lock = threading.Lock()
        self._closed = False
        self.switched_after_s: float | None = None
        self.tool_parser = first.tool_parser
        self.reports_logprobs = True
        self._started = time.monotonic()
        self._builder = threading.Thread(target=self._build, name="cb-build", daemon=True)
        self._builder.start()

    @property
    def building(self) -> bool:
        """The continuous-batching pipeline is being built (a process stopping now skips its teardown)."""
        return self._builder.is_alive()

    def _current(self) -> Any:
        return self._full or self._first

    def __getattr__(self, name: str) -> Any:  # tokens, context_length, ...: the same for either pipeline
        return getattr(self._current(), name)

    def generate(self, request: GenerationRequest) -> Any:
        with self._lock:  # a request is submitted to the stateful pump only before the switch
            if self._full is None:
                if request.logprobs or request.constraint is not None:
                    return self._deferred.generate(request)
                return self._first.generate(request)
            full = self._full
        return full.generate(request)

    def prompt_tokens(self, request: GenerationRequest) -> int:
        return int(self._current().prompt_tokens(request))

    def chat_prompt(self, request: GenerationRequest, add_generation_prompt: bool = True) -> str:
        return str(self._current().chat_prompt(request, add_generation_prompt))

    def describe(self) -> dict[str, Any]:
        described = dict(self._current().describe())
        described["first_answer"] = "continuous batching" if self._full is not None else "stateful, then switching"
        return described

    def stats(self) -> dict[str, Any]:
        stats = dict(self._current().stats())
        stats["pipeline"] = "continuous_batching" if self._full is not None else "stateful"
        if self.switched_after_s is not None:
            stats["switched_after_s"] = round(self.switched_after_s, 2)
        return stats

    def close(self) -> None:
        self._closed = True
        for generator in (self._first, self._deferred, self._full):
            if generator is not None:
                generator.close()

    def halt(self) -> None:
        self._closed = True
        for generator in (self._first, self._deferred, self._full):
            if generator is not None:
                generator.halt()

    def _build(self) -> None:
        first = self._first
        answered = first._pump.answered  # the first answer out first: on a 2-core box the compile would slow it
        if not answered.wait(BUILD_AFTER_S) and first._pump.running:
            answered.wait(BUILD_AT_LATEST_S - BUILD_AFTER_S)
        if self._closed:
            return
        settle.release_file_pages()  # the stateful blob's pages (~110 MiB; ~25 are read again): a lower build peak
        try:
            full = self._build_full()
        except Exception as exc:  # keep answering from the stateful pipeline; what waits for this fails
            reason = exc.args[0] if isinstance(exc, LoadError) and exc.args else one_line(exc)
            log.error("the continuous-batching pipeline failed to build; staying on the stateful one: %s", reason)
            self._deferred._pump.fail(EngineError(f"the continuous-batching pipeline failed to load: {reason}"))
            return
        if self._closed:
            full.close()
            return
        with self._lock:
            self._full = full
        self._deferred._pump.forward(full._pump)
        self.switched_after_s = time.monotonic() - self._started
        first._pump.finish(full._pump)  # ends its generation under way; what waits goes to continuous batching
        first._pump._thread.join()
        with self._lock:
            self._first = self._deferred = None
        del first
        gc.collect()
        # the weights' copy of the second pipeline is made (see _warm_up); the first pipeline's memory goes back
        settle.release_and_trim()
        log.info("switched to the continuous-batching pipeline %.2fs after the start; the stateful one is freed",
                 self.switched_after_s)


def _warm_up(pipe: Any) -> None:
    """One token through the continuous-batching pipeline before it takes requests: its first inference
    copies the weights into the CPU plugin's layout (what :mod:`modelserver.settle` then lets go of the
    file's pages for), so no request waits for that."""
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = 1
    pipe.generate(["Hello"], [config])


def load(spec: ModelSpec, source: ModelSource, properties: dict[str, Any], context: int | None, started: float,
         make: MakeGenerator, build_pipeline: Callable[[ModelSpec, ModelSource, dict[str, Any], int | None], Any],
         ) -> Bridge:
    """The stateful pipeline now (its compiled blob cached in ``cache_dir``), the continuous-batching one behind."""
    stateful = {**properties, **STATEFUL, "CACHE_DIR": properties.get("CACHE_DIR", spec.cache_dir)}
    try:
        pipe = ov_genai.LLMPipeline(str(source.path), spec.device, **stateful)
    except Exception as exc:
        raise LoadError(one_line(exc)) from None
    load_s = time.monotonic() - started
    first = make(spec, Stateful(pipe), source, stateful, load_s, context, pump=SerialPump,
                 label="openvino LLMPipeline (stateful; continuous batching being built)")
    first._prefix.enabled = False  # it keeps no KV cache between requests: nothing is served from one
    deferred = copy.copy(first)  # the same tokenizer and counters (~0.1 s to build again), another pump
    deferred._pump = DeferredPump()
    del pipe

    def build() -> Any:
        begun = time.monotonic()
        full = build_pipeline(spec, source, properties, context)
        _warm_up(full)
        return make(spec, full, source, properties, time.monotonic() - begun, context)

    return Bridge(first, deferred, build)
