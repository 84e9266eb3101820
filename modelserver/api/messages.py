"""``/v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API (tasks llm and vlm).

The body is read as Anthropic defines it (:class:`MessagesRequest`), translated into the
chat route's request (:func:`chat_request`) and served by the chat machinery: the chat
template, the tool parser, constrained decoding for a forced ``tool_choice``, stop strings,
token counts and the context check. Only the answer's shape is Anthropic's
(:class:`MessageShape`: a ``message`` body, or the ``message_start`` ... ``message_stop``
event stream), and so are errors (``{"type": "error", "error": {"type", "message"}}``).

The request and its translation are :mod:`modelserver.api.anthropic_in`; this module serves
it and shapes the answer: ``stop_reason`` ``end_turn`` / ``max_tokens`` / ``stop_sequence`` /
``tool_use`` (a turn that calls a tool opens with its ``tool_use`` block, never with an empty
text block), ``usage`` with ``cache_read_input_tokens``, and the stream's events.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelserver.api import chat
from modelserver.api.anthropic_in import CountTokensRequest, MessagesRequest, chat_request, unknown_fields
from modelserver.api.common import (
    ClientGone,
    SSEResponse,
    engine_as,
    engine_errors,
    note,
    read_body,
    runtime,
    spec,
    until_disconnect,
)
from modelserver.api.vlm import plan_generation
from modelserver.engines.base import PromptCounting, TextGenerator, cached_tokens
from modelserver.errors import ModelServerError, anthropic_error_body, anthropic_error_response
from modelserver.ids import random_hex
from modelserver.tools import ToolCall, ToolStreamSplitter, drop_cut_call, parse_tool_calls

__all__ = ["MessageShape", "routes", "stop_reason"]


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    payload = json.dumps({"type": kind, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {payload}\n\n".encode()


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id.replace("call_", "toolu_", 1), "name": call.name,
            "input": json.loads(call.arguments)}


def stop_reason(run: chat.Run, called: bool) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence``: max_tokens wins over a call (as the chat route's ``length``)."""
    if run.finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if run.stop_sequence is not None:
        return "stop_sequence", run.stop_sequence
    return "end_turn", None


class MessageShape:
    """A ``message`` body, or the events of a streamed one, for one request."""

    def __init__(self, model: str) -> None:
        self.id = "msg_" + random_hex(24)
        self.model = model
        self.index = 0  # the next content block's
        self.text_open = False

    def message(self, content: list[dict[str, Any]], reason: tuple[str | None, str | None],
                usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason[0], "stop_sequence": reason[1], "usage": usage}

    def start(self, usage: dict[str, int]) -> list[bytes]:
        message = self.message([], (None, None), usage)
        return [_sse("message_start", {"message": message}), _sse("ping", {})]

    def text(self, text: str) -> list[bytes]:
        events = []
        if not self.text_open:
            block = {"index": self.index, "content_block": {"type": "text", "text": ""}}
            events.append(_sse("content_block_start", block))
            self.text_open = True
        return events + [_sse("content_block_delta", {"index": self.index,
                                                      "delta": {"type": "text_delta", "text": text}})]

    def call(self, call: ToolCall) -> list[bytes]:
        events, block = self.close_text(), _tool_use(call)
        arguments, block["input"] = call.arguments, {}
        events.append(_sse("content_block_start", {"index": self.index, "content_block": block}))
        delta = {"type": "input_json_delta", "partial_json": arguments}
        events.append(_sse("content_block_delta", {"index": self.index, "delta": delta}))
        events.append(_sse("content_block_stop", {"index": self.index}))
        self.index += 1
        return events

    def close_text(self) -> list[bytes]:
        if not self.text_open:
            return []
        self.text_open = False
        self.index += 1
        return [_sse("content_block_stop", {"index": self.index - 1})]

    def end(self, reason: tuple[str, str | None], usage: dict[str, int]) -> list[bytes]:
        events = self.text("") if self.index == 0 and not self.text_open else []  # never an empty content list
        events += self.close_text()
        delta = {"stop_reason": reason[0], "stop_sequence": reason[1]}
        return events + [_sse("message_delta", {"delta": delta, "usage": usage}), _sse("message_stop", {})]


def _usage(run: chat.Run) -> dict[str, int]:
    """Anthropic's split: ``input_tokens`` are the prompt tokens *not* read from the cache, so that
    ``input_tokens + cache_read_input_tokens`` is the prompt (what count_tokens answers, and what
    the SDKs and LangChain's ``usage_metadata`` add up)."""
    cached = cached_tokens(run.stream)
    return {"input_tokens": max(run.stream.prompt_tokens - cached, 0), "output_tokens": run.stream.completion_tokens,
            "cache_read_input_tokens": cached}


async def _body(run: chat.Run, shape: MessageShape, parser: str | None) -> dict[str, Any]:
    text = "".join([delta async for delta in run.deltas()])
    calls: tuple[ToolCall, ...] = ()
    if parser is not None:
        parsed = parse_tool_calls(parser, drop_cut_call(parser, text) if run.finish == "length" else text)
        text, calls = parsed.content or "", parsed.calls
    content = [{"type": "text", "text": text}] if text or not calls else []
    content += [_tool_use(call) for call in calls]
    return shape.message(content, stop_reason(run, bool(calls)), _usage(run))


async def _events(run: chat.Run, shape: MessageShape, parser: str | None, request: Request) -> AsyncIterator[bytes]:
    for event in shape.start({**_usage(run), "output_tokens": 0}):
        yield event
    calls = 0
    try:
        with engine_errors(runtime(request)):
            splitter = ToolStreamSplitter(parser) if parser is not None else None
            async for delta in run.deltas():
                for event in _released(shape, *(splitter.push(delta) if splitter else (delta, ()))):
                    yield event
            if splitter is not None:
                for event in _released(shape, *splitter.finish(cut=run.finish == "length")):
                    yield event
                calls = splitter.calls_sent
    except ModelServerError as exc:
        note(request, error=exc.code)
        yield _sse("error", {"error": anthropic_error_body(exc)["error"]})
        return
    for event in shape.end(stop_reason(run, calls > 0), _usage(run)):
        yield event


def _released(shape: MessageShape, text: str, calls: tuple[ToolCall, ...]) -> list[bytes]:
    events = shape.text(text) if text else []
    for call in calls:
        events += shape.call(call)
    return events


async def _generation(request: Request, body: CountTokensRequest, max_tokens: int = 1) -> tuple[Any, str | None]:
    """The engine's request for ``body`` (a :class:`VisionRequest` on task vlm) and the tool parser to apply."""
    unknown_fields(body)
    chat_body = chat_request(body, spec(request).task == "vlm")
    sampling = replace(chat.sampling(chat_body, max_tokens), fit_to_context=True)  # 64000 is capped, not a 400
    return await plan_generation(request, chat_body, sampling)


async def _create(request: Request) -> Response:
    body = await read_body(request, MessagesRequest)
    generation, parser = await _generation(request, body, body.max_tokens)
    note(request, stream=body.stream, tools=len(generation.tools))
    shape = MessageShape(body.model or spec(request).name)
    (run,) = await chat.start_runs(request, engine_as(request, TextGenerator), [generation], body.stop_sequences or [])
    if body.stream:
        return SSEResponse(_events(run, shape, parser, request), lambda: chat.close_runs(request, [run]))
    try:
        with engine_errors(runtime(request)):
            message = await until_disconnect(request, _body(run, shape, parser))
    except ClientGone:
        return Response(status_code=499)
    finally:
        await chat.close_runs(request, [run])
    return JSONResponse(message)


async def _count(request: Request) -> Response:
    body = await read_body(request, CountTokensRequest)
    generation, _ = await _generation(request, body)
    with engine_errors(runtime(request)):
        count = engine_as(request, PromptCounting).prompt_tokens(generation)
    note(request, prompt_tokens=count)
    return JSONResponse({"input_tokens": count})


async def create_message(request: Request) -> Response:
    try:
        return await _create(request)
    except ModelServerError as exc:
        return anthropic_error_response(exc)


async def count_tokens(request: Request) -> Response:
    try:
        return await _count(request)
    except ModelServerError as exc:
        return anthropic_error_response(exc)


routes = [
    Route("/v1/messages", create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
