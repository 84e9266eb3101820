"""Anthropic's Messages request (:class:`MessagesRequest`) and its translation into the chat route's request.

:func:`chat_request` turns the body into a :class:`~modelserver.protocol.ChatCompletionRequest`,
which the chat machinery serves (:mod:`modelserver.api.messages`). The rules:

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

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from modelserver.errors import RequestError
from modelserver.protocol import MAX_STOP_CHARS, MAX_STOPS, MAX_TOKENS, ChatCompletionRequest, FunctionDef, Tool

__all__ = ["BILLING_HEADER", "CountTokensRequest", "MessagesRequest", "chat_messages", "chat_request", "unknown_fields"]

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


def unknown_fields(body: BaseModel) -> None:
    """Log each top-level field the models do not know, once per name."""
    for name in body.model_extra or {}:
        _once(f"the field {name!r}")
