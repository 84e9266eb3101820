"""``/v1/chat/completions`` and ``/v1/completions`` (tasks llm and vlm), streamed or not.

Every answer is produced the same way: the engine streams text deltas, a :class:`Run`
applies the stop strings, and a shape (:class:`~modelserver.protocol.ChatShape` or
:class:`~modelserver.protocol.TextShape`) renders either one body or SSE chunks. A stream
waits for the engine's first event before it sends its headers, so an error at the start
(a bad prompt, a fatal engine error) still answers with a proper status and headers; an
error later in a stream is sent as a final ``data: {"error": ...}`` event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelserver.api.common import (
    ClientGone,
    SSEResponse,
    engine_as,
    engine_errors,
    note,
    read_body,
    runtime,
    spec,
    sse,
    until_disconnect,
)
from modelserver.engines.base import ChatTurn, GenerationRequest, SamplingParams, TextGenerator, TextStream
from modelserver.errors import ModelServerError, UnsupportedParameter, error_body
from modelserver.protocol import ChatCompletionRequest, ChatMessage, ChatShape, CompletionRequest, TextShape, usage
from modelserver.textstream import StopMatcher

__all__ = ["Run", "chat_turns", "routes"]

Shape = ChatShape | TextShape
Body = ChatCompletionRequest | CompletionRequest


def chat_turns(messages: list[ChatMessage]) -> tuple[ChatTurn, ...]:
    """Messages as plain text turns; 400 for what a text model cannot take (images, tool results)."""
    turns = []
    for i, message in enumerate(messages):
        if message.role == "tool":
            raise UnsupportedParameter(f"messages[{i}].role: tool messages are not supported", param="messages")
        role = "system" if message.role == "developer" else message.role
        turns.append(ChatTurn(role, _text_of(message, i)))
    return tuple(turns)


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
    return SamplingParams(
        max_tokens=body.requested_max_tokens() or default_max_tokens,
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

    async def start(self) -> None:
        """Wait for the engine's first event (a delta or the end), so errors at the start surface here."""
        try:
            self._first = await anext(self._raw)
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
            if text := self._matcher.push(delta):
                yield text
        if self._matcher.stopped:
            self.finish = "stop"
            await self.stream.aclose()
            return
        if tail := self._matcher.flush():
            yield tail
        self.finish = self.stream.finish_reason or "stop"

    def usage(self) -> dict[str, int]:
        return usage(self.stream.prompt_tokens, self.stream.completion_tokens)

    async def close(self, request: Request) -> None:
        await self.stream.aclose()
        note(request, prompt_tokens=self.stream.prompt_tokens, completion_tokens=self.stream.completion_tokens)
        note(request, finish=self.finish or "cancelled")


async def _respond(request: Request, body: Body, generation: GenerationRequest, shape: Shape) -> Response:
    generator = engine_as(request, TextGenerator)
    rt = runtime(request)
    with engine_errors(rt):
        run = Run(generator.generate(generation), body.stop_strings())
    note(request, stream=body.stream)
    try:
        with engine_errors(rt):
            await until_disconnect(request, run.start())
        if body.stream:
            return SSEResponse(_events(run, shape, body.include_usage(), request), lambda: run.close(request))
        with engine_errors(rt):
            text = await until_disconnect(request, _collect(run))
    except ClientGone:
        await run.close(request)
        return Response(status_code=499)
    except BaseException:
        await run.close(request)
        raise
    await run.close(request)
    return JSONResponse(shape.body(text, run.finish or "stop", run.usage()))


async def _collect(run: Run) -> str:
    return "".join([text async for text in run.deltas()])


async def _events(run: Run, shape: Shape, include_usage: bool, request: Request) -> AsyncIterator[bytes]:
    if (opening := shape.opening()) is not None:
        yield sse(opening)
    try:
        with engine_errors(runtime(request)):
            async for text in run.deltas():
                yield sse(shape.delta(text))
    except ModelServerError as exc:
        note(request, error=exc.code)
        yield sse(error_body(exc))
    else:
        yield sse(shape.closing(run.finish or "stop"))
        if include_usage:
            yield sse(shape.usage_chunk(run.usage()))
    yield b"data: [DONE]\n\n"


async def chat_completions(request: Request) -> Response:
    body = await read_body(request, ChatCompletionRequest)
    body.refuse_unsupported()
    generation = GenerationRequest(
        sampling=sampling(body, spec(request).default_max_tokens), messages=chat_turns(body.messages)
    )
    return await _respond(request, body, generation, ChatShape(spec(request).name))


async def completions(request: Request) -> Response:
    body = await read_body(request, CompletionRequest)
    body.refuse_unsupported()
    generation = GenerationRequest(sampling=sampling(body, spec(request).default_max_tokens), prompt=body.prompt_text())
    return await _respond(request, body, generation, TextShape(spec(request).name))


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
]
