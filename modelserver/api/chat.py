"""``/v1/chat/completions`` and ``/v1/completions`` (tasks llm and vlm), streamed or not.

Every answer is produced the same way: the engine streams text deltas, a :class:`Run`
applies the stop strings, and a shape (:class:`~modelserver.protocol.ChatShape` or
:class:`~modelserver.protocol.TextShape`) renders either one body or SSE chunks. A stream
waits for the engine's first event before it sends its headers, so an error at the start
(a bad prompt, a fatal engine error) still answers with a proper status and headers; an
error later in a stream is sent as a final ``data: {"error": ...}`` event.

With ``tools`` the text goes through the model's tool parser (:mod:`modelserver.tools`):
calls become ``message.tool_calls`` / ``delta.tool_calls`` and ``finish_reason``
``tool_calls``. A forced ``tool_choice`` and ``response_format`` / ``guided_*`` become a
constraint (:mod:`modelserver.structured`) the engine decodes under. ``n`` > 1 runs ``n``
generations side by side (each its own seed) and numbers their choices.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator, Coroutine, Iterable
from dataclasses import replace
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelserver import heartbeat
from modelserver.api.common import (
    ClientGone,
    SSEResponse,
    engine_as,
    engine_errors,
    fingerprint,
    note,
    read_body,
    runtime,
    spec,
    sse,
    until_disconnect,
)
from modelserver.api.toolplan import chat_plan
from modelserver.engines.base import (
    ChatTurn,
    GenerationRequest,
    SamplingParams,
    TextGenerator,
    TextStream,
    cached_tokens,
)
from modelserver.errors import ModelServerError, RequestError, UnsupportedParameter, error_body
from modelserver.protocol import (
    SEED_RANGE,
    ChatCompletionRequest,
    ChatMessage,
    ChatShape,
    Choice,
    CompletionRequest,
    TextShape,
    ToolCallIn,
    usage,
)
from modelserver.textstream import StopMatcher
from modelserver.tools import ToolCall, ToolStreamSplitter, drop_cut_call, parse_tool_calls

__all__ = ["Run", "chat_turns", "close_runs", "collect", "routes", "sampling", "shape_for", "start_runs",
           "template_call", "tool_finish"]

T = TypeVar("T")
Shape = ChatShape | TextShape
Body = ChatCompletionRequest | CompletionRequest


def chat_turns(messages: list[ChatMessage]) -> tuple[ChatTurn, ...]:
    """Messages as text turns (tool calls and results kept); 400 for what a text model cannot take."""
    turns = []
    for i, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        calls = tuple(template_call(call, i, j) for j, call in enumerate(message.tool_calls or ()))
        name = message.name if role == "tool" else None
        turns.append(ChatTurn(role, _text_of(message, i), calls, message.tool_call_id, name))
    return tuple(turns)


def template_call(call: ToolCallIn, index: int, j: int) -> dict[str, Any]:
    """A history call as chat templates expect it: ``arguments`` a mapping, not a JSON string."""
    arguments: Any = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            raise RequestError(
                f"messages[{index}].tool_calls[{j}].function.arguments: not valid JSON; send the arguments "
                "object as a JSON string",
                param="messages",
            ) from None
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id or f"call_{index}_{j}", "type": "function", "function": function}


def _text_of(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for j, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise UnsupportedParameter(
                f"messages[{index}].content[{j}]: content part of type {part.type!r} is not supported "
                "by a text model; send parts of type 'text' with a 'text' string",
                param="messages",
            )
        texts.append(part.text)
    return "\n".join(texts)


def sampling(body: Body, default_max_tokens: int) -> SamplingParams:
    """The request's sampling; without ``max_tokens`` the limit fits what the context leaves, and so
    does a continued final message (a stream the router resumes: its answer so far now sits in the prompt)."""
    requested = body.requested_max_tokens()
    return SamplingParams(
        max_tokens=requested or default_max_tokens,
        fit_to_context=requested is None or getattr(body, "continue_final_message", False),
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
    )


class Run:
    """One generation as the client sees it: stop strings applied; counts final at the end."""

    def __init__(self, stream: TextStream, stops: list[str]) -> None:
        self.stream = stream
        self.finish: str | None = None
        self._matcher = StopMatcher(stops)
        self._first: str | None = None
        self._raw: AsyncIterator[str] = aiter(stream)
        self.pieces = 0  # what the engine produced so far: the request's progress (modelserver/heartbeat.py)

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the answer, if one did."""
        return self._matcher.matched

    async def start(self) -> None:
        """Wait for the engine's first event (a delta or the end), so errors at the start surface here."""
        try:
            self._first = await anext(self._raw)
            self.pieces += 1
        except StopAsyncIteration:
            self._first = None
            self.finish = self.stream.finish_reason or "stop"

    async def deltas(self) -> AsyncIterator[str]:
        if self.finish is not None:
            return
        if self._first is not None:
            first, self._first = self._first, None
            if text := self._matcher.push(first):
                yield text
        while not self._matcher.stopped:
            try:
                delta = await anext(self._raw)
            except StopAsyncIteration:
                break
            self.pieces += 1
            if text := self._matcher.push(delta):
                yield text
        if self._matcher.stopped:
            self.finish = "stop"
            await self.stream.aclose()
            return
        if tail := self._matcher.flush():
            yield tail
        self.finish = self.stream.finish_reason or "stop"


async def start_runs(request: Request, generator: TextGenerator, generations: list[GenerationRequest],
                 stops: list[str]) -> list[Run]:
    rt = runtime(request)
    runs: list[Run] = []
    heartbeat.follow(lambda: sum(run.pieces for run in runs))
    try:
        for generation in generations:
            with engine_errors(rt):
                runs.append(Run(generator.generate(generation), stops))
        with engine_errors(rt):
            await until_disconnect(request, _all(run.start() for run in runs))
    except BaseException as exc:
        await close_runs(request, runs, "error" if isinstance(exc, ModelServerError) else "cancelled")
        raise
    return runs


async def _all(works: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """The results of ``works``, run side by side when there are several (``n`` > 1); one is just awaited."""
    pending = list(works)
    if len(pending) == 1:
        return [await pending[0]]
    return list(await asyncio.gather(*pending))


async def close_runs(request: Request, runs: list[Run], unfinished: str = "cancelled") -> None:
    """Close every run and note the access log's counts; a run that did not finish is ``unfinished``
    (``error`` for a refused request, e.g. one over the context, ``cancelled`` for a client gone)."""
    for run in runs:
        await run.stream.aclose()
    note(request, prompt_tokens=runs[0].stream.prompt_tokens if runs else 0,
         completion_tokens=sum(run.stream.completion_tokens for run in runs))
    note(request, finish=",".join(run.finish or unfinished for run in runs) or unfinished)


def _usage(runs: list[Run], shape: Shape, n: int = 1) -> dict[str, Any]:
    """Counts of the answer: each prompt once (runs come ``n`` per prompt), every choice's completion;
    a chat's also the prompt tokens its prefix came from the cache for."""
    cached = cached_tokens(runs[0].stream) if isinstance(shape, ChatShape) else None
    prompt_tokens = sum(run.stream.prompt_tokens for run in runs[::n])
    return usage(prompt_tokens, sum(run.stream.completion_tokens for run in runs), cached)


def _copies(generation: GenerationRequest, n: int) -> list[GenerationRequest]:
    """``n`` generations of one request; with n > 1 each samples with its own seed (wrapping in the seed's range)."""
    if n == 1:
        return [generation]
    base = generation.sampling.seed if generation.sampling.seed is not None else random.randrange(2**31)
    seeds = [(base + i) % SEED_RANGE for i in range(n)]
    return [replace(generation, sampling=replace(generation.sampling, seed=seed)) for seed in seeds]


async def _respond(request: Request, body: Body, generations: list[GenerationRequest], shape: Shape,
                   parser: str | None = None, logprobs: bool = False) -> Response:
    """Answer ``n`` choices of each generation (one per prompt), numbered prompt by prompt as OpenAI does."""
    generator = engine_as(request, TextGenerator)
    note(request, stream=body.stream)
    copies = [copy for generation in generations for copy in _copies(generation, body.n)]
    runs = await start_runs(request, generator, copies, body.stop_strings())
    if body.stream:
        return SSEResponse(_events(runs, shape, parser, logprobs, request, body.n), lambda: close_runs(request, runs))
    try:
        with engine_errors(runtime(request)):
            choices = await until_disconnect(
                request, _all(collect(run, i, parser, logprobs) for i, run in enumerate(runs))
            )
    except ClientGone:
        return Response(status_code=499)
    finally:
        await close_runs(request, runs)
    return JSONResponse(shape.body(list(choices), _usage(runs, shape, body.n)))


def logprob_entries(stream: TextStream) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content``: each generated token with its log probability (no alternatives)."""
    pairs: list[tuple[str, float]] = stream.token_logprobs()  # type: ignore[attr-defined]
    return [
        {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")), "top_logprobs": []}
        for token, logprob in pairs
    ]


async def collect(run: Run, index: int, parser: str | None, logprobs: bool) -> Choice:
    text = "".join([delta async for delta in run.deltas()])
    finish = run.finish or "stop"
    entries = logprob_entries(run.stream) if logprobs else None
    if parser is None:
        return Choice(index, text, finish, logprobs=entries)
    parsed = parse_tool_calls(parser, drop_cut_call(parser, text) if finish == "length" else text)
    calls = [call.as_openai() for call in parsed.calls]
    return Choice(index, parsed.content, tool_finish(finish, bool(calls)), calls, entries)


def tool_finish(finish: str, called: bool) -> str:
    """``tool_calls`` when the answer holds calls, unless ``max_tokens`` cut it (then ``length``)."""
    return "tool_calls" if called and finish != "length" else finish


async def _choice_events(run: Run, index: int, shape: Shape, parser: str | None,
                         logprobs: bool) -> AsyncIterator[bytes]:
    if (opening := shape.opening(index)) is not None:
        yield sse(opening)
    calls_sent = 0
    if parser is None:
        async for text in run.deltas():
            yield sse(shape.delta(text, index))
    else:
        splitter = ToolStreamSplitter(parser)
        async for delta in run.deltas():
            for event in _split(shape, splitter, index, *splitter.push(delta)):
                yield event
        for event in _split(shape, splitter, index, *splitter.finish(cut=run.finish == "length")):
            yield event
        calls_sent = splitter.calls_sent
    finish = tool_finish(run.finish or "stop", calls_sent > 0)
    yield sse(shape.closing(finish, index, logprob_entries(run.stream) if logprobs else None))


def _split(shape: Shape, splitter: ToolStreamSplitter, index: int, text: str,
           calls: tuple[ToolCall, ...]) -> list[bytes]:
    """The chunks for what the splitter released: content, then each call (numbered across the stream)."""
    events = [sse(shape.delta(text, index))] if text else []
    first = splitter.calls_sent - len(calls)
    if calls:
        numbered = [{"index": first + k, **call.as_openai()} for k, call in enumerate(calls)]
        events.append(sse(shape.tool_calls(numbered, index)))
    return events


async def _merged(streams: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """The events of several choices as they come (``n`` > 1)."""
    queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[bytes]) -> None:
        try:
            async for event in stream:
                await queue.put(event)
        except BaseException as exc:  # handed to the consumer, which raises it
            await queue.put(exc)
        else:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        for _ in range(len(streams)):
            while (event := await queue.get()) is not None:
                if isinstance(event, BaseException):
                    raise event
                yield event
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


async def _events(runs: list[Run], shape: Shape, parser: str | None, logprobs: bool,
                  request: Request, n: int = 1) -> AsyncIterator[bytes]:
    streams = [_choice_events(run, i, shape, parser, logprobs) for i, run in enumerate(runs)]
    try:
        with engine_errors(runtime(request)):
            async for event in streams[0] if len(streams) == 1 else _merged(streams):
                yield event
    except ModelServerError as exc:
        note(request, error=exc.code)
        yield sse(error_body(exc))
    else:
        if shape.include_usage:
            yield sse(shape.usage_chunk(_usage(runs, shape, n)))
    yield b"data: [DONE]\n\n"


def shape_for(request: Request, kind: type[Shape], body: Body) -> Shape:
    return kind(spec(request).name, fingerprint(spec(request)), body.stream and body.include_usage())


async def chat_completions(request: Request) -> Response:
    body = await read_body(request, ChatCompletionRequest)
    body.refuse_unsupported(spec(request).max_n)
    generator = engine_as(request, TextGenerator)
    if body.logprobs and not getattr(generator, "reports_logprobs", False):
        raise UnsupportedParameter("logprobs: this engine does not report logprobs", param="logprobs")
    tools, constraint, parse = chat_plan(body, generator.tool_parser)
    generation = GenerationRequest(
        sampling=sampling(body, spec(request).default_max_tokens), messages=chat_turns(body.messages),
        tools=tools, constraint=constraint, logprobs=bool(body.logprobs), continue_final=body.continue_final_message,
    )
    if tools or constraint is not None:
        note(request, tools=len(tools), constrained=constraint is not None)
    parser = generator.tool_parser if parse else None
    return await _respond(request, body, [generation], shape_for(request, ChatShape, body), parser,
                          generation.logprobs)


async def completions(request: Request) -> Response:
    body = await read_body(request, CompletionRequest)
    body.refuse_unsupported(spec(request).max_n)
    params = sampling(body, spec(request).default_max_tokens)
    generations = [GenerationRequest(sampling=params, prompt=prompt) for prompt in body.prompts()]
    return await _respond(request, body, generations, shape_for(request, TextShape, body))


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
]
