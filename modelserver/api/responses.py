"""``POST /v1/responses`` and ``POST /v1/responses/input_tokens`` (tasks llm and vlm), streamed or not.

The request becomes a chat (:mod:`modelserver.api.responses_input`) and runs on the chat
machinery (:mod:`modelserver.api.chat`: stop strings, tool parsing, constrained decoding,
token counts); the answer becomes Responses output items: a ``message`` with one
``output_text`` part, ``function_call`` items, and ``custom_tool_call`` items for the calls of
``custom`` tools (their one string ``input``). :class:`Output` builds the items and, for a
stream, the events the official SDK's ``client.responses.stream()`` checks, in order::

    response.created, response.in_progress,
    [response.output_item.added, response.content_part.added, response.output_text.delta ...,
     response.output_text.done, response.content_part.done, response.output_item.done]     a message
    [response.output_item.added, response.function_call_arguments.delta / .done (or
     response.custom_tool_call_input.delta / .done), response.output_item.done]             each call
    response.completed | response.incomplete (max_output_tokens) | response.failed (engine error)

each with ``sequence_number`` from 0, and ``output_index`` / ``item_id`` / ``content_index``
where the spec has them. The response ``id`` is the router's (header ``x-ovrouter-response-id``,
so a stream it resumes on a fresh process keeps its ids; item ids derive from it) or a new one.
State (``store``, ``previous_response_id``) lives in the router; a request that reaches a model
server with ``previous_response_id`` is a 400.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelserver.api import chat as chat_api
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
from modelserver.api.responses_input import ResponsesRequest, Translation, translate
from modelserver.api.vlm import plan_generation
from modelserver.engines.base import PromptCounting, TextGenerator, cached_tokens
from modelserver.errors import ModelServerError, UnsupportedParameter
from modelserver.ids import random_hex
from modelserver.tools import ToolCall, ToolStreamSplitter, drop_cut_call, parse_tool_calls

__all__ = ["Output", "response_usage", "routes"]

log = logging.getLogger(__name__)

#: The router's id for this response (it keeps the stored conversation and resumes streams under it).
ID_HEADER = "x-ovrouter-response-id"
PREVIOUS_HEADER = "x-ovrouter-previous-response-id"
_ID = re.compile(r"^resp_[A-Za-z0-9]{1,64}$")


def response_usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


class Output:
    """The response object and its output items as they are built; each step returns its stream events."""

    def __init__(self, response_id: str, model: str, body: ResponsesRequest, custom: frozenset[str],
                 prefix: str = "", previous: str | None = None) -> None:
        self.id = response_id
        self.items: list[dict[str, Any]] = []
        self._custom = custom
        self._suffix = response_id.removeprefix("resp_")
        self._message: dict[str, Any] | None = None
        self._prefix = prefix  # a resumed answer's text so far: the message starts with it
        self._seq = 0
        self.envelope: dict[str, Any] = {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {}, "model": model,
            "output": [], "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": previous,
            "reasoning": {"effort": None, "summary": None}, "store": body.store, "temperature": body.temperature,
            "text": body.text or {"format": {"type": "text"}}, "tool_choice": body.tool_choice or "auto",
            "tools": [{**tool, "strict": tool.get("strict", True)} if tool.get("type") == "function" else tool
                      for tool in body.tools or []],  # the spec requires strict (OpenAI's default: true)
            "top_p": body.top_p, "truncation": body.truncation or "disabled",
        }  # usage comes with the end (the spec's usage is an object: left out, not null, until then)
        if body.user is not None:
            self.envelope["user"] = body.user

    def event(self, kind: str, **fields: Any) -> bytes:
        data = json.dumps({"type": kind, "sequence_number": self._seq, **fields}, ensure_ascii=False,
                          separators=(",", ":"))
        self._seq += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def snapshot(self, status: str | None = None) -> dict[str, Any]:
        if status is not None:
            self.envelope["status"] = status
        return {**self.envelope, "output": list(self.items)}

    def opening(self) -> list[bytes]:
        return [self.event("response.created", response=self.snapshot()),
                self.event("response.in_progress", response=self.snapshot())]

    def text(self, delta: str) -> list[bytes]:
        events: list[bytes] = []
        if self._message is None:
            events += self._open_message()
        if not delta:
            return events
        assert self._message is not None
        self._message["content"][0]["text"] += delta
        index = len(self.items) - 1
        return [*events, self.event("response.output_text.delta", item_id=self._message["id"], output_index=index,
                                    content_index=0, delta=delta, logprobs=[])]

    def _open_message(self) -> list[bytes]:
        index = len(self.items)
        item: dict[str, Any] = {"id": f"msg_{self._suffix}_{index}", "type": "message", "status": "in_progress",
                                "role": "assistant", "content": []}
        self.items.append(item)
        self._message = item
        events = [self.event("response.output_item.added", output_index=index, item=_copy(item))]
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                 content_index=0, part=_copy(part)))
        part["text"], self._prefix = self._prefix, ""
        item["content"].append(part)
        return events

    def close_message(self, status: str = "completed") -> list[bytes]:
        item, self._message = self._message, None
        if item is None:
            return []
        index, part = self.items.index(item), item["content"][0]
        item["status"] = status
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [self.event("response.output_text.done", **ids, text=part["text"], logprobs=[]),
                self.event("response.content_part.done", **ids, part=_copy(part)),
                self.event("response.output_item.done", output_index=index, item=_copy(item))]

    def call(self, call: ToolCall) -> list[bytes]:
        """One whole call as its item; a message open before it is closed first."""
        events = self.close_message()
        index = len(self.items)
        if call.name in self._custom:
            item = {"id": f"ctc_{self._suffix}_{index}", "type": "custom_tool_call", "status": "completed",
                    "call_id": call.id, "name": call.name, "input": _custom_input(call.arguments)}
            self.items.append(item)
            ids = {"item_id": item["id"], "output_index": index}
            return [*events, self.event("response.output_item.added", output_index=index, item={**item, "input": ""}),
                    self.event("response.custom_tool_call_input.delta", **ids, delta=item["input"]),
                    self.event("response.custom_tool_call_input.done", **ids, input=item["input"]),
                    self.event("response.output_item.done", output_index=index, item=_copy(item))]
        item = {"id": f"fc_{self._suffix}_{index}", "type": "function_call", "status": "completed",
                "call_id": call.id, "name": call.name, "arguments": call.arguments}
        self.items.append(item)
        ids = {"item_id": item["id"], "output_index": index}
        added = {**item, "arguments": "", "status": "in_progress"}
        return [*events, self.event("response.output_item.added", output_index=index, item=added),
                self.event("response.function_call_arguments.delta", **ids, delta=call.arguments),
                self.event("response.function_call_arguments.done", **ids, name=call.name, arguments=call.arguments),
                self.event("response.output_item.done", output_index=index, item=_copy(item))]

    def finish(self, finish: str, counts: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The terminal event's type and response: completed, or incomplete when max_output_tokens cut it."""
        self.envelope["usage"] = counts
        if finish == "length":
            self.envelope["incomplete_details"] = {"reason": "max_output_tokens"}
            return "response.incomplete", self.snapshot("incomplete")
        return "response.completed", self.snapshot("completed")

    def failed(self, exc: ModelServerError) -> bytes:
        self.envelope["error"] = {"code": exc.code, "message": exc.message}
        return self.event("response.failed", response=self.snapshot("failed"))


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))  # type: ignore[no-any-return]


def _custom_input(arguments: str) -> str:
    """A custom tool's ``input`` string out of the function arguments the model wrote."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    found = value.get("input") if isinstance(value, dict) else None
    return found if isinstance(found, str) else arguments


def _response_id(request: Request) -> str:
    given = request.headers.get(ID_HEADER, "")
    return given if _ID.match(given) else "resp_" + random_hex()


async def _plan(request: Request) -> tuple[ResponsesRequest, Translation, Any, str | None]:
    """The request, its chat translation, the generation to run and the tool parser (None: no tools)."""
    body = await read_body(request, ResponsesRequest)
    translation = translate(body)
    if translation.ignored:
        log.info("responses: ignored %s", ", ".join(translation.ignored[:16]))
    chat = translation.chat
    chat.refuse_unsupported(1)
    generation, parser = await plan_generation(request, chat)
    note(request, tools=len(generation.tools), constrained=generation.constraint is not None)
    return body, translation, generation, parser


async def create_response(request: Request) -> Response:
    body, translation, generation, parser = await _plan(request)
    generator = engine_as(request, TextGenerator)
    note(request, stream=body.stream)
    chat = translation.chat
    prefix = str(chat.messages[-1].content or "") if chat.continue_final_message else ""
    previous = request.headers.get(PREVIOUS_HEADER)
    output = Output(_response_id(request), spec(request).name, body, translation.custom_tools, prefix, previous)
    runs = await chat_api.start_runs(request, generator, [generation], chat.stop_strings())
    if body.stream:
        return SSEResponse(_events(request, runs[0], output, parser), lambda: chat_api.close_runs(request, runs))
    try:
        with engine_errors(runtime(request)):
            await _collect(request, runs[0], output, parser)
    except ClientGone:
        return Response(status_code=499)
    finally:
        await chat_api.close_runs(request, runs)
    return JSONResponse(output.finish(runs[0].finish or "stop", _usage(runs[0]))[1])


def _usage(run: chat_api.Run) -> dict[str, Any]:
    stream = run.stream
    return response_usage(stream.prompt_tokens, stream.completion_tokens, cached_tokens(stream))


async def _collect(request: Request, run: chat_api.Run, output: Output, parser: str | None) -> None:
    async def gather() -> str:
        return "".join([delta async for delta in run.deltas()])

    text = await until_disconnect(request, gather())
    if parser is None:
        output.text(text)
        output.close_message("incomplete" if run.finish == "length" else "completed")
        return
    parsed = parse_tool_calls(parser, drop_cut_call(parser, text) if run.finish == "length" else text)
    if parsed.content:
        output.text(parsed.content)
        output.close_message("incomplete" if run.finish == "length" else "completed")
    for call in parsed.calls:
        output.call(call)


async def _events(request: Request, run: chat_api.Run, output: Output, parser: str | None) -> AsyncIterator[bytes]:
    for event in output.opening():
        yield event
    try:
        with engine_errors(runtime(request)):
            async for event in _item_events(run, output, parser):
                yield event
    except ModelServerError as exc:
        note(request, error=exc.code)
        yield output.failed(exc)
        return
    kind, response = output.finish(run.finish or "stop", _usage(run))
    yield output.event(kind, response=response)


async def _item_events(run: chat_api.Run, output: Output, parser: str | None) -> AsyncIterator[bytes]:
    if parser is None:
        async for delta in run.deltas():
            for event in output.text(delta):
                yield event
        for event in output.text("") + output.close_message("incomplete" if run.finish == "length" else "completed"):
            yield event
        return
    splitter = ToolStreamSplitter(parser)
    async for delta in run.deltas():
        for event in _split(output, *splitter.push(delta)):
            yield event
    status = "incomplete" if run.finish == "length" else "completed"
    for event in _split(output, *splitter.finish(cut=run.finish == "length")) + output.close_message(status):
        yield event


def _split(output: Output, text: str, calls: tuple[ToolCall, ...]) -> list[bytes]:
    events = output.text(text) if text else []
    for call in calls:
        events += output.call(call)
    return events


async def input_tokens(request: Request) -> Response:
    """``{"object": "response.input_tokens", "input_tokens": N}``: what the same body would be charged."""
    _, _, generation, _ = await _plan(request)
    generator = engine_as(request, TextGenerator)
    if not isinstance(generator, PromptCounting):
        raise UnsupportedParameter("input_tokens: this engine cannot count a prompt without running it",
                                   param="input")
    with engine_errors(runtime(request)):
        count = generator.prompt_tokens(generation)
    return JSONResponse({"object": "response.input_tokens", "input_tokens": count})


routes = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/input_tokens", input_tokens, methods=["POST"]),
]
