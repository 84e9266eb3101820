"""Task ``llm`` on OpenVINO: one ``ContinuousBatchingPipeline``, one pump thread.

The pump thread is the only code that touches the pipeline. Request handlers hand it a
ticket (token ids + GenerationConfig) and read events back on their own asyncio queue;
the pump admits new tickets with ``add_request()``, runs ``step()`` while anything is in
flight, reads every handle after each step and cancels the handles whose client went
away. Concurrent requests therefore share each step (continuous batching) instead of
queuing behind a lock. ``step()`` holds the GIL while it runs, so the event loop gets its
turn between steps; the per-step work left to it (a short decode, one SSE write per
stream) is small next to a step.

A ``step()`` that raises leaves the pipeline unusable: openvino_genai's scheduler stays "in
its scheduling phase", and every later step fails with ``Check 'get_num_scheduled_tokens()
== 0' failed`` (seen in a chaos soak: one ``std::future_error`` mid-step, then every request
of that process a 500 while its ``/health`` answered 200, until the router was stopped). So
the pump answers the requests in flight, and every later one, with a
:class:`~modelserver.errors.FatalEngineError` and never steps again: the process answers
and exits, and the router replaces it and retries or resumes its requests. The exception is
the scheduler's refusal of one request (:data:`REQUEST_REFUSALS`: a prompt longer than
``max_num_batched_tokens`` without dynamic split-fuse), after which the pipeline serves on:
the requests in flight get it as an ordinary engine error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import openvino_genai as ov_genai

from modelserver.engines import llm_first
from modelserver.engines.base import FinishReason, GenerationRequest, SamplingParams
from modelserver.engines.context import PromptCounter, configured_context
from modelserver.engines.ov_options import (
    ModelSource,
    finish_conversion,
    one_line,
    ov_properties,
    prepare_source,
    remembered,
    scheduler_config,
)
from modelserver.engines.task_check import check_generative
from modelserver.engines.task_options import task_options
from modelserver.engines.tokens import TokenizerIds
from modelserver.errors import EngineError, FatalEngineError, LoadError, RequestError
from modelserver.modelfiles import context_length
from modelserver.prefixcache import PrefixTracker, block_size_for, scheduler_for
from modelserver.spec import ModelSpec
from modelserver.structured import ov_structured_output
from modelserver.textstream import IncrementalDetokenizer
from modelserver.tools import detect_parser, mistral_call_ids, plain_history, template_takes_tools

__all__ = ["OpenVINOTextGenerator", "Pump", "load", "render_chat"]

log = logging.getLogger(__name__)

#: What the pump hands a stream after a step: the new token ids, the text they made final, and the finish.
Event = tuple[list[int], str, FinishReason | None] | BaseException
#: ``options`` of task llm (and vlm): ``context_length`` lowers the model's own; ``first_answer`` (llm on CPU,
#: default true): first answers from the cached stateful pipeline while this one compiles (:mod:`.llm_first`).
OPTIONS: dict[str, type | tuple[type, ...]] = {"context_length": int, "first_answer": bool}
_FINISH = {"STOP": "stop", "LENGTH": "length", "TOOL_CALL": "stop"}


@dataclass(slots=True, eq=False)
class Ticket:
    """One request on its way through the pump; ``deliver`` is thread-safe."""

    request_id: int
    input_ids: Any
    config: Any
    deliver: Callable[[Event], None]
    handle: Any = None
    tokens: int = 0
    finish: FinishReason | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    logprobs: list[float] | None = None  # each generated token's, when the request asked for them
    #: the ids' text, decoded on the pump thread (see :meth:`Pump._publish`)
    detokenizer: IncrementalDetokenizer = field(kw_only=True)


#: The request ids of every generator in this process. A model that starts on the stateful pipeline (llm_first) has
#: two generators and hands the requests still waiting at the switch to the continuous-batching one: with a count
#: each, a handed-over request and a new one shared an id, and ``add_request`` with an id in flight breaks the
#: pipeline for good (``std::future_error: No associated state``, then every step: ``Check
#: 'get_num_scheduled_tokens() == 0' failed``), found by bench/chaosmix.py 0.6 s after a switch, twice.
REQUEST_IDS = itertools.count(1)


def pipeline_figures(metrics: Any) -> dict[str, Any]:
    """What /health reports of the continuous-batching pipeline (the router relabels it as metrics)."""
    if metrics is None:
        return {}
    return {"scheduled_requests": int(metrics.scheduled_requests), "cache_usage": float(metrics.cache_usage) / 100,
            "cache_bytes": int(metrics.cache_size_in_bytes)}


#: Step failures that refuse a request and leave the pipeline usable (the next request is served).
REQUEST_REFUSALS = ("longer than max number of tokens in batch",)


class Pump:
    """The one thread that calls the pipeline: ``add_request``, ``step``, ``read``, ``cancel``."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self._inbox: queue.SimpleQueue[Ticket] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._active: dict[int, Ticket] = {}
        self._stopping = False
        self._failed: FatalEngineError | None = None  # a step raised: the pipeline is never stepped again
        self._refused = False  # a step refused a request: step again only for a new one, never in a failing loop
        self.completed = 0
        self.cancelled = 0
        self.metrics: Any = None  # the pipeline's PipelineMetrics after the last step (read by /health)
        self.advanced_at = time.monotonic()  # when the pump last had nothing to do or finished a step
        self._thread = threading.Thread(target=self._run, name="ov-pump", daemon=True)

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def stuck_s(self) -> float:
        """How long requests have waited with no step finished (0 while idle): a wedged step grows it."""
        if not self._active and self._inbox.empty():
            return 0.0
        return max(time.monotonic() - self.advanced_at, 0.0)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """:meth:`halt`, then wait for the thread to end (``timeout_s`` at most)."""
        self.halt()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def halt(self) -> None:
        """Never touch the pipeline again (a fatal device error); the step under way, if any, ends first."""
        self._stopping = True
        self._wake.set()

    def submit(self, ticket: Ticket) -> None:
        self._inbox.put(ticket)
        self._wake.set()

    def cancel(self, ticket: Ticket) -> None:
        ticket.cancelled.set()
        self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._iterate()
            except Exception as exc:  # the pipeline failed: every request in flight fails with it, and any later
                if any(refusal in str(exc) for refusal in REQUEST_REFUSALS):
                    self._refused = True
                else:
                    self._failed = FatalEngineError(
                        f"engine failed beyond repair: the pipeline's step failed ({one_line(exc)}); "
                        "a failed step leaves the pipeline unusable, so the process is replaced")
                self._fail_all(exc)

    def _iterate(self) -> None:
        self._admit()
        self._drop_cancelled()
        if not self._active and (self._failed is not None or self._refused
                                 or not self._pipe.has_non_finished_requests()):
            self.advanced_at = time.monotonic()
            self._wake.wait()
            self._wake.clear()
            self.advanced_at = time.monotonic()
            return
        self._pipe.step()
        self._refused = False
        self.advanced_at = time.monotonic()
        self.metrics = self._pipe.get_metrics()
        self._publish()

    def _admit(self) -> None:
        while True:
            try:
                ticket = self._inbox.get_nowait()
            except queue.Empty:
                return
            if ticket.cancelled.is_set():
                continue
            if self._failed is not None:
                ticket.deliver(self._failed)
                continue
            try:
                ticket.handle = self._pipe.add_request(ticket.request_id, ticket.input_ids, ticket.config)
            except Exception as exc:
                ticket.deliver(exc)
                continue
            self._active[ticket.request_id] = ticket

    def _drop_cancelled(self) -> None:
        for ticket in [t for t in self._active.values() if t.cancelled.is_set()]:
            ticket.handle.cancel()
            del self._active[ticket.request_id]
            self.cancelled += 1
            log.info("request %d cancelled after %d tokens", ticket.request_id, ticket.tokens)

    def _publish(self) -> None:
        """Each stream's new tokens and their text, decoded here rather than on the event loop.

        ``step()`` holds the GIL, and a decode releases it (the tokenizer runs in OpenVINO): on
        the event loop each decode then waited for the step under way to end, so with N streams
        the loop got through about one stream's token per step and fell behind. Here the decodes
        run between steps, and while each runs the loop has the GIL for its SSE writes.
        """
        for ticket in list(self._active.values()):
            ids = self._read(ticket)
            status = ticket.handle.get_status()
            if status == ov_genai.GenerationStatus.RUNNING:
                if ids:
                    ticket.deliver((ids, ticket.detokenizer.push(ids), None))
                continue
            del self._active[ticket.request_id]
            if status == ov_genai.GenerationStatus.FINISHED:
                self.completed += 1
                text = ticket.detokenizer.push(ids) + ticket.detokenizer.flush()
                ticket.deliver((ids, text, ticket.finish or "stop"))
            elif status == ov_genai.GenerationStatus.IGNORED:
                ticket.deliver(EngineError("the request did not fit in the KV cache (raise scheduler.cache_size)"))
            else:
                ticket.deliver(EngineError(f"the generation ended with status {status.name}"))

    def _read(self, ticket: Ticket) -> list[int]:
        ids: list[int] = []
        if not ticket.handle.can_read():
            return ids
        for output in ticket.handle.read().values():
            ids.extend(output.generated_ids)
            if ticket.logprobs is not None:
                ticket.logprobs.extend(output.generated_log_probs)
            ticket.finish = _FINISH.get(output.finish_reason.name, ticket.finish)  # type: ignore[assignment]
        ticket.tokens += len(ids)
        return ids

    def _fail_all(self, exc: Exception) -> None:
        log.error("pipeline step failed with %d requests in flight: %s", len(self._active), one_line(exc))
        for ticket in self._active.values():
            ticket.deliver(self._failed or exc)
            with contextlib.suppress(Exception):
                ticket.handle.cancel()
        self._active.clear()


def _deliverer(loop: asyncio.AbstractEventLoop, events: asyncio.Queue[Event]) -> Callable[[Event], None]:
    def deliver(event: Event) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    return deliver


class LLMStream:
    """The async side of one ticket: token ids in, UTF-8-safe text deltas out."""

    def __init__(self, pump: Pump, ticket: Ticket, events: asyncio.Queue[Event], decode: Callable[..., str],
                 prefix: PrefixTracker | None = None) -> None:
        self.prompt_tokens = int(ticket.input_ids.shape[1])
        self.completion_tokens = 0
        self._prompt_ids: list[int] = [int(i) for i in ticket.input_ids.data[0]] if prefix is not None else []
        self._prefix = prefix
        #: prompt tokens the pipeline's prefix cache serves (an estimate: :class:`PrefixTracker`)
        self.cached_tokens = prefix.count(self._prompt_ids) if prefix is not None else 0
        self._generated: list[int] = []
        self.finish_reason: FinishReason | None = None
        self._pump = pump
        self._ticket = ticket
        self._events = events
        self._decode = decode
        self._ids: list[int] = []
        self._gen = self._deltas()

    def __aiter__(self) -> AsyncIterator[str]:
        return self._gen

    async def _deltas(self) -> AsyncIterator[str]:
        try:
            while self.finish_reason is None:
                event = await self._events.get()
                if isinstance(event, BaseException):
                    raise event
                ids, text, finish = event
                self.completion_tokens += len(ids)
                if self._ticket.logprobs is not None:
                    self._ids.extend(ids)
                if self._prefix is not None:
                    self._generated.extend(ids)
                if finish is not None:
                    self.finish_reason = finish
                    if self._prefix is not None:  # its blocks stay in the cache for the next turn
                        self._prefix.remember(self._prompt_ids + self._generated)
                if text:
                    yield text
        finally:
            if self.finish_reason is None:
                self._pump.cancel(self._ticket)

    async def aclose(self) -> None:
        if self.finish_reason is None:
            self._pump.cancel(self._ticket)
        await self._gen.aclose()  # type: ignore[attr-defined]

    def token_logprobs(self) -> list[tuple[str, float]]:
        """Each generated token's text and log probability (requests with ``logprobs``)."""
        return list(zip([self._decode([i]) for i in self._ids], self._ticket.logprobs or (), strict=False))


class OpenVINOTextGenerator:
    """A loaded ContinuousBatchingPipeline behind the :class:`~modelserver.engines.base.TextGenerator` protocol."""

    def __init__(self, spec: ModelSpec, pipe: Any, source: ModelSource, properties: dict[str, Any], load_s: float,
                 context: int | None = None, pump: Callable[[Any], Any] | None = None,
                 label: str = "openvino ContinuousBatchingPipeline"):
        self._spec = spec
        self._properties = properties
        self._pipe = pipe
        self._tokenizer = pipe.get_tokenizer()
        self._template_tools = template_takes_tools(self._tokenizer.chat_template)
        self.tool_parser = spec.tool_parser or detect_parser(self._tokenizer.chat_template)
        self._defaults = pipe.get_config()
        self._source = source
        self._load_s = load_s
        self._ids = REQUEST_IDS  # one count per process: see REQUEST_IDS
        self.reports_logprobs = True
        self._counter = PromptCounter(self._tokenizer, context, remembered(spec, source.tokenizer_path or source.path))
        self._scheduler = scheduler = scheduler_for(spec, source.original or source.path, context)
        self._prefix = PrefixTracker(block_size_for(spec.device), bool(scheduler.get("enable_prefix_caching")))
        self.context_length = self._counter.context_length
        self.tokens = TokenizerIds(self._tokenizer, self._counter.cap)
        self._pump = (pump or Pump)(pipe)  # llm_first: the stateful pipeline's one-at-a-time pump
        self._pump.start()
        self.label = label

    def describe(self) -> dict[str, Any]:
        return {
            "engine": self.label,
            "device": self._spec.device,
            "source": f"{self._source.path} ({self._source.kind})",
            "load_s": round(self._load_s, 2),
            "eos_token_id": self._defaults.eos_token_id,
            "context_length": self.context_length,
            "tokenizer_cap": self._counter.cap,
            "chat_template": bool(self._tokenizer.chat_template),
            "tool_parser": self.tool_parser,
            "template_takes_tools": self._template_tools,
            "scheduler": self._scheduler,
            "ov_config": self._properties,
        }

    def stats(self) -> dict[str, Any]:
        figures = {"running": self._pump.running, "completed": self._pump.completed, "cancelled": self._pump.cancelled,
                   "stuck_s": round(self._pump.stuck_s, 1)}
        return {**figures, **pipeline_figures(self._pump.metrics), **self._prefix.stats()}

    def close(self) -> None:
        self._pump.stop()

    def halt(self) -> None:
        """A fatal error: the pump stops calling the pipeline (the process exits next)."""
        self._pump.halt()

    def generate(self, request: GenerationRequest) -> LLMStream:
        """Tokenize once, check the context (a 400 before anything reaches the pipeline), then submit."""
        param = "messages" if request.messages is not None else "prompt"
        self._counter.refuse_huge(request_text(request), request.sampling, param)
        prompt, special = self._render(request)
        input_ids, _, max_new = self._counter.fit(prompt, special, request.sampling, param)
        config = generation_config(replace(request.sampling, max_tokens=max_new), self._defaults, request.constraint)
        ticket = Ticket(next(self._ids), input_ids, config, _noop, detokenizer=IncrementalDetokenizer(self._decode))
        if request.logprobs:
            ticket.config.logprobs = 1
            ticket.logprobs = []
        events: asyncio.Queue[Event] = asyncio.Queue()
        ticket.deliver = _deliverer(asyncio.get_running_loop(), events)
        self._pump.submit(ticket)
        return LLMStream(self._pump, ticket, events, self._decode, self._prefix if self._prefix.enabled else None)

    def prompt_tokens(self, request: GenerationRequest) -> int:
        """The prompt tokens ``request`` would be charged (its ``usage``), without generating anything."""
        prompt, special = self._render(request)
        return self._counter.total(prompt, special)

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))

    def _render(self, request: GenerationRequest) -> tuple[str, bool]:
        """The prompt text, and whether the tokenizer adds its special tokens (a raw completion's BOS)."""
        if request.messages is None:
            return request.prompt or "", True
        return self.chat_prompt(request), False

    def chat_prompt(self, request: GenerationRequest, add_generation_prompt: bool = True) -> str:
        """A chat's messages (and tools) through the model's chat template: the text the model reads."""
        return render_chat(self._tokenizer, request, self._template_tools, self.tool_parser, add_generation_prompt)


def render_chat(tokenizer: Any, request: Any, template_tools: bool, parser: str, add_generation_prompt: bool) -> str:
    """The chat template applied to ``request``'s messages; 400 when the template rejects them (LLM and VLM)."""
    history, tools = chat_history(request, template_tools, parser)
    try:
        if getattr(request, "continue_final", False):
            return continued_prompt(tokenizer.apply_chat_template, history, tools)
        return str(tokenizer.apply_chat_template(history, add_generation_prompt=add_generation_prompt, tools=tools))
    except RequestError:
        raise
    except Exception as exc:
        raise RequestError(f"the model's chat template rejected these messages: {one_line(exc)}") from None


def request_text(request: Any) -> str:
    """The text a chat (its messages' contents) or a completion (its prompt) brings, before any template."""
    if request.messages is None:
        return str(request.prompt or "")
    return "\n".join(turn.content for turn in request.messages)


def chat_history(request: Any, template_tools: bool, parser: str = "") -> tuple[list[dict[str, Any]], Any]:
    """The messages (and tools) to render: a template without tool support gets them written out as text."""
    history = [turn.as_template_message() for turn in request.messages or ()]
    tools = list(getattr(request, "tools", ()))
    if template_tools:
        return (mistral_call_ids(history) if parser == "mistral" else history), tools or None
    has_tool_turns = any(m["role"] == "tool" or m.get("tool_calls") for m in history)
    if tools or has_tool_turns:
        return plain_history(history, tools), None
    return history, None


def continued_prompt(render: Callable[..., str], history: list[dict[str, Any]], tools: Any) -> str:
    """The chat rendered with its last (assistant) message left open, so the answer continues it.

    The template closes every message it renders; the text after the final message's content
    (its end-of-turn marker) is cut. An empty final message is a plain generation prompt.
    """
    partial = str(history[-1].get("content") or "")
    if not partial.strip():
        return render(history[:-1], add_generation_prompt=True, tools=tools)
    rendered = render(history, add_generation_prompt=False, tools=tools)
    core = partial.strip()
    at = rendered.rfind(core)
    if at < 0:
        raise RequestError(
            "continue_final_message: the chat template does not reproduce the final message's text",
            param="continue_final_message",
        )
    kept = partial.lstrip()  # the template may strip the message's edge whitespace, or keep it
    end = at + len(kept) if rendered[at : at + len(kept)] == kept else at + len(core)
    return rendered[:end]


def generation_config(sampling: SamplingParams, defaults: Any, constraint: Any = None) -> Any:
    """A request's ``GenerationConfig`` over the model's own defaults (LLM and VLM engines share it)."""
    config = ov_genai.GenerationConfig()
    config.eos_token_id = defaults.eos_token_id
    config.stop_token_ids = defaults.stop_token_ids
    config.max_new_tokens = sampling.max_tokens
    config.ignore_eos = sampling.ignore_eos
    _set_sampling(config, sampling, defaults)
    _set_penalties(config, sampling)
    if constraint is not None:
        config.structured_output_config = ov_structured_output(constraint)
    try:
        config.validate()
    except Exception as exc:
        raise RequestError(f"invalid generation parameters: {one_line(exc)}") from None
    return config


def _noop(event: Event) -> None:
    pass


def _set_sampling(config: Any, sampling: SamplingParams, defaults: Any) -> None:
    """temperature omitted: the model's own default; 0: greedy; > 0: multinomial sampling."""
    temperature = sampling.temperature
    if temperature is None:
        temperature = defaults.temperature if defaults.do_sample else 0.0
    config.do_sample = temperature > 0
    if not config.do_sample:
        return
    config.temperature = temperature
    config.top_p = sampling.top_p if sampling.top_p is not None else defaults.top_p
    if sampling.top_k is not None:
        config.top_k = sampling.top_k
    if sampling.seed is not None:
        config.rng_seed = sampling.seed


def _set_penalties(config: Any, sampling: SamplingParams) -> None:
    if sampling.presence_penalty is not None:
        config.presence_penalty = sampling.presence_penalty
    if sampling.frequency_penalty is not None:
        config.frequency_penalty = sampling.frequency_penalty
    if sampling.repetition_penalty is not None:
        config.repetition_penalty = sampling.repetition_penalty
    if sampling.min_tokens is not None:
        config.min_new_tokens = sampling.min_tokens


def _build_pipeline(spec: ModelSpec, source: ModelSource, properties: dict[str, Any], context: int | None) -> Any:
    properties = {**properties, **source.extra_properties()}
    scheduler = scheduler_config(scheduler_for(spec, source.original or source.path, context))
    if source.tokenizer_path is None:
        return ov_genai.ContinuousBatchingPipeline(str(source.path), scheduler, spec.device, properties)
    tokenizer = ov_genai.Tokenizer(str(source.tokenizer_path), **source.extra_properties())
    return ov_genai.ContinuousBatchingPipeline(str(source.path), tokenizer, scheduler, spec.device, **properties)


def load(spec: ModelSpec) -> OpenVINOTextGenerator:
    """Load ``spec`` onto its device; :class:`LoadError` with one readable line when it cannot."""
    started = time.monotonic()
    option = task_options(spec, OPTIONS).get("context_length")
    source = prepare_source(spec)
    check_generative(spec, source.path)
    context = configured_context(spec.name, context_length(source.original or source.path), option)
    properties = ov_properties(spec)
    if llm_first.wanted(spec, source, task_options(spec, OPTIONS).get("first_answer")):
        return llm_first.load(spec, source, properties, context, started,  # type: ignore[return-value]
                              OpenVINOTextGenerator, _build_pipeline)
    try:
        pipe = _build_pipeline(spec, source, properties, context)
    except LoadError:
        raise
    except Exception as exc:
        raise LoadError(one_line(exc)) from None
    finish_conversion(source)
    return OpenVINOTextGenerator(spec, pipe, source, properties, time.monotonic() - started, context)
