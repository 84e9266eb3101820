"""``/v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API (tasks llm and vlm).

The body is read as Anthropic defines it (:class:`MessagesRequest`), translated into the
chat route's request (:func:`chat_request`) and served by the chat machinery: the chat
template, the tool parser, constrained decoding for a forced ``tool_choice``, stop strings,
token counts and the context check. Only the answer's shape is Anthropic's
(:class:`MessageShape`: a ``message`` body, or the ``message_start`` ... ``message_stop``
event stream), and so are errors (``{"type": "error", "error": {"type", "message"}}``).

The translation:

- ``system`` (a string or text blocks; a block starting with ``x-anthropic-billing-header``,
  which Claude Code changes on every request, is dropped so the prompt's start stays the same)
  is the first system message. ``role: "system"`` messages inside ``messages`` (Claude Code
  sends them) join it while no other message came before; a later one is folded into the user
  turn before it, so no template meets a system message in the middle of a chat.
- user ``text`` and ``image`` (base64; task vlm) blocks are the user turn; each ``tool_result``
  (a string or text blocks; ``is_error`` prefixes ``Error:``) a tool message before it.
- assistant ``text`` is the content, ``tool_use`` its calls; ``thinking`` and
  ``redacted_thinking`` are dropped. A final assistant message is a prefill: the answer
  continues it (the router resumes a cut stream the same way).
- ``tools`` (``input_schema``) are functions; Anthropic's own tool types (``bash_...``,
  ``web_search_...``) are ignored. ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` are
  the chat route's ``auto`` / ``required`` / a named function / ``none`` (one call unless
  ``disable_parallel_tool_use`` is false).
- ``max_tokens`` is required, and capped at what the context leaves (never a 400 for 64000).
- Unknown fields (``thinking``, ``output_config``, ``context_management``, ``cache_control``,
  ...) are accepted and ignored; each top-level name is logged once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelserver.api import chat
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
from modelserver.api.toolplan import chat_plan
from modelserver.api.vlm import vision_turns
from modelserver.engines.base import GenerationRequest, PromptCounting, TextGenerator, cached_tokens
from modelserver.engines.media_base import VisionRequest
from modelserver.errors import ModelServerError, RequestError, anthropic_error_body, anthropic_error_response
from modelserver.protocol import MAX_STOP_CHARS, MAX_STOPS, MAX_TOKENS, ChatCompletionRequest, FunctionDef, Tool
from modelserver.tools import ToolCall, ToolStreamSplitter, drop_cut_call, parse_tool_calls

__all__ = ["BILLING_HEADER", "CountTokensRequest", "MessageShape", "MessagesRequest", "chat_request", "routes"]

log = logging.getLogger(__name__)

#: Claude Code's per-request system block (``x-anthropic-billing-header: cc_version=...; cch=<hash>``).
BILLING_HEADER = "x-anthropic-billing-header"
_LOGGED: set[str] = set()


def _once(what: str) -> None:
    if what not in _LOGGED:
        _LOGGED.add(what)
        log.info("messages: ignoring %s (accepted, not used)", what)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class Source(_Lenient):
    type: str
    media_type: str | None = None
    data: str | None = None


class Block(_Lenient):
    type: str
    text: str | None = None
    source: Source | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None


class Message(_Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class AnthropicTool(_Lenient):
    name: str = Field(..., min_length=1, max_length=128)
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(_Lenient):
    model: str | None = None
    messages: list[Message] = Field(..., min_length=1)
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(..., ge=1, le=MAX_TOKENS)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOPS)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1, le=MAX_TOKENS)
    stream: bool = False
    metadata: dict[str, Any] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value: list[str] | None) -> list[str] | None:
        if value and not all(0 < len(stop) <= MAX_STOP_CHARS for stop in value):
            raise ValueError(f"each stop sequence must be a non-empty string of at most {MAX_STOP_CHARS} characters")
        return value


# -- Anthropic -> chat ---------------------------------------------------------------------------


def _system_text(system: str | list[Block] | None, where: str = "system") -> str:
    if system is None or isinstance(system, str):
        return "" if system is None or system.startswith(BILLING_HEADER) else system
    texts = []
    for j, block in enumerate(system):
        if block.type != "text" or block.text is None:
            raise RequestError(f"{where}[{j}]: expected a text block with a 'text' string", param=where)
        if not block.text.startswith(BILLING_HEADER):
            texts.append(block.text)
    return "\n\n".join(texts)


def _fold(out: list[dict[str, Any]], text: str) -> None:
    """A system message in the middle of the chat, added to the user turn before it."""
    last = out[-1] if out else None
    if last is None or last["role"] != "user":
        out.append({"role": "user", "content": text})
    elif isinstance(last["content"], str):
        last["content"] += "\n\n" + text
    else:
        last["content"].append({"type": "text", "text": text})


def _image(block: Block, where: str, vision: bool) -> dict[str, Any]:
    if not vision:
        raise RequestError(f"{where}: image blocks need a model with task vlm; send text only", param="messages")
    source = block.source
    if source is None or source.type != "base64" or not source.data or not source.media_type:
        raise RequestError(f'{where}.source: expected {{"type": "base64", "media_type": "image/png", "data": ...}} '
                           "(this server fetches no URLs)", param="messages")
    return {"type": "image_url", "image_url": {"url": f"data:{source.media_type};base64,{source.data}"}}


def _result_text(block: Block, where: str) -> str:
    content = block.content
    if isinstance(content, list):
        texts = [part.text or "" for part in content if part.type == "text"]
        if len(texts) < len(content):
            _once("non-text blocks in tool_result content")
        content = "\n".join(texts)
    text = content or ""
    return f"Error: {text}" if block.is_error else text


def _user(message: Message, where: str, vision: bool) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    results, parts = [], []
    for j, block in enumerate(message.content):
        at = f"{where}.content[{j}]"
        if block.type == "text":
            parts.append({"type": "text", "text": block.text or ""})
        elif block.type == "image":
            parts.append(_image(block, at, vision))
        elif block.type == "tool_result":
            if not block.tool_use_id:
                raise RequestError(f"{at}.tool_use_id: required for a tool_result block", param="messages")
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block, at)})
        else:
            _once(f"{block.type!r} content blocks")
    return results + ([{"role": "user", "content": parts}] if parts else [])


def _assistant(message: Message, where: str) -> dict[str, Any]:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts, calls = [], []
    for j, block in enumerate(message.content):
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "tool_use":
            if not block.id or not block.name:
                raise RequestError(f"{where}.content[{j}]: a tool_use block needs an 'id' and a 'name'",
                                   param="messages")
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input or {}}})
        elif block.type not in ("thinking", "redacted_thinking"):
            _once(f"{block.type!r} content blocks")
    return {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None,
            "tool_calls": calls or None}


def chat_messages(body: CountTokensRequest, vision: bool) -> list[dict[str, Any]]:
    """The chat route's messages for ``body`` (see the module's docstring for the rules)."""
    system, out = [_system_text(body.system)], list[dict[str, Any]]()
    for i, message in enumerate(body.messages):
        where = f"messages[{i}]"
        if message.role == "system":
            text = message.content if isinstance(message.content, str) else _system_text(message.content, where)
            if out:
                _fold(out, text)
            else:
                system.append(text)
        elif message.role == "user":
            out.extend(_user(message, where, vision))
        else:
            out.append(_assistant(message, where))
    joined = "\n\n".join(text for text in system if text)
    return ([{"role": "system", "content": joined}] if joined else []) + out


def _tools(body: CountTokensRequest) -> list[Tool]:
    tools = []
    for i, tool in enumerate(body.tools or ()):
        if tool.type not in (None, "custom"):  # Anthropic's server and client tools: no schema to offer
            _once(f"tools of type {tool.type!r}")
            continue
        if tool.input_schema is None:
            raise RequestError(f"tools[{i}].input_schema: required (a JSON schema of the tool's input)",
                               param="tools")
        function = FunctionDef.model_construct(name=tool.name, description=tool.description,
                                               parameters=tool.input_schema, strict=tool.strict)
        tools.append(Tool.model_construct(type="function", function=function))
    return tools


def _tool_choice(choice: ToolChoice | None, tools: list[Tool]) -> Any:
    if choice is None or choice.type == "auto":
        return "auto" if tools else None
    if choice.type == "none":
        return "none"
    if not tools:
        raise RequestError(f"tool_choice: {choice.type!r} needs `tools` with an input_schema", param="tool_choice")
    if choice.type == "any":
        return "required"
    names = [tool.function.name for tool in tools]
    if choice.name not in names:
        raise RequestError(f"tool_choice.name: {choice.name!r} is not one of the tools ({', '.join(names)})",
                           param="tool_choice")
    return {"type": "function", "function": {"name": choice.name}}


def chat_request(body: CountTokensRequest, vision: bool) -> ChatCompletionRequest:
    """``body`` as the chat route's request: messages, tools, tool choice, sampling, stop strings."""
    data: dict[str, Any] = {"messages": chat_messages(body, vision)}
    tools = _tools(body)
    if tools:
        data["tools"] = tools
    if (choice := _tool_choice(body.tool_choice, tools)) is not None:
        data["tool_choice"] = choice
    if body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use is not None:
        data["parallel_tool_calls"] = not body.tool_choice.disable_parallel_tool_use
    if isinstance(body, MessagesRequest):
        data |= {"max_tokens": body.max_tokens, "temperature": body.temperature, "top_p": body.top_p,
                 "top_k": body.top_k, "stop": body.stop_sequences or None, "stream": body.stream}
    last = data["messages"][-1]
    data["continue_final_message"] = not vision and last["role"] == "assistant" and not last.get("tool_calls")
    try:
        request = ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise RequestError(f"messages: cannot be served as a chat: {exc.errors()[0]['msg']}",
                           param="messages") from None
    request.refuse_unsupported()
    return request


def _unknown_fields(body: BaseModel) -> None:
    for name in body.model_extra or {}:
        _once(f"the field {name!r}")


# -- the answer -----------------------------------------------------------------------------------


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
        self.id = "msg_" + uuid.uuid4().hex[:24]
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
    return {"input_tokens": run.stream.prompt_tokens, "output_tokens": run.stream.completion_tokens,
            "cache_read_input_tokens": cached_tokens(run.stream)}


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
    _unknown_fields(body)
    generator = engine_as(request, TextGenerator)
    vision = spec(request).task == "vlm"
    chat_body = chat_request(body, vision)
    tools, constraint, parse = chat_plan(chat_body, generator.tool_parser)
    sampling = replace(chat.sampling(chat_body, max_tokens), fit_to_context=True)  # 64000 is capped, not a 400
    parser = generator.tool_parser if parse else None
    if vision:
        turns, images = await asyncio.to_thread(vision_turns, chat_body.messages)
        note(request, images=len(images))
        return VisionRequest(sampling, turns, images, tools, constraint), parser
    turns = chat.chat_turns(chat_body.messages)
    continued = chat_body.continue_final_message
    return GenerationRequest(sampling, turns, tools=tools, constraint=constraint, continue_final=continued), parser


async def _create(request: Request) -> Response:
    body = await read_body(request, MessagesRequest)
    generation, parser = await _generation(request, body, body.max_tokens)
    note(request, stream=body.stream, tools=len(generation.tools))
    shape = MessageShape(body.model or spec(request).name)
    (run,) = await chat._start(request, engine_as(request, TextGenerator), [generation], body.stop_sequences or [])
    if body.stream:
        return SSEResponse(_events(run, shape, parser, request), lambda: chat._close(request, [run]))
    try:
        with engine_errors(runtime(request)):
            message = await until_disconnect(request, _body(run, shape, parser))
    except ClientGone:
        return Response(status_code=499)
    finally:
        await chat._close(request, [run])
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
