"""A Responses API request (``POST /v1/responses``) as the chat request the chat machinery runs.

What is translated (everything else is accepted and ignored, named in one log line per request):

- ``input``: a string (one user message) or items: ``message`` (roles user, assistant, system,
  developer; parts ``input_text``/``output_text``/``text``/``refusal``, ``input_image`` for a vlm),
  ``function_call`` / ``custom_tool_call`` (an assistant turn's calls, merged into the assistant
  message before them), ``function_call_output`` / ``custom_tool_call_output`` (tool turns);
  ``reasoning`` and ``item_reference`` items are dropped. ``instructions`` is a first system message.
- ``tools``: ``function`` as in chat; ``custom`` (freeform) as a function taking one string ``input``
  (its grammar, Codex's Lark ``apply_patch``, goes into the description: it runs unconstrained, since
  XGrammar takes no Lark); any other type (``web_search``, ``namespace``, ``mcp``, ...) is dropped.
- ``tool_choice`` none / auto / required / ``{"type": "function"|"custom", "name"}``;
  ``allowed_tools`` keeps its mode; ``text.format`` ``json_schema`` / ``json_object`` become chat's
  ``response_format``; ``max_output_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``.

Unlike the chat route, unknown fields and tool types are never a 400 here: Codex and the agent
SDKs send many (``include``, ``reasoning``, ``prompt_cache_key``, ``client_metadata``, ...).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from modelserver.errors import RequestError, UnsupportedParameter
from modelserver.protocol import MAX_TOKENS, SEED_RANGE, ChatCompletionRequest

__all__ = ["ResponsesRequest", "Translation", "translate"]

log = logging.getLogger(__name__)

#: Fields the translation reads or that need no translation (the rest are logged as ignored).
_KNOWN = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "seed", "stop", "text", "tools",
    "tool_choice", "parallel_tool_calls", "stream", "store", "previous_response_id", "metadata", "user",
    "truncation", "continue_final_message", "stream_options",
})
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
_DROPPED_ITEMS = ("reasoning", "item_reference")


class ResponsesRequest(BaseModel):
    """The fields this server reads, type-checked; anything else is kept in ``model_extra`` and ignored."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=SEED_RANGE - 1)
    stop: str | list[str] | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None
    #: the router's resume: the last input item is the unfinished assistant answer to continue
    continue_final_message: bool = False


@dataclass(slots=True)
class Translation:
    """The chat request, and what the answer needs to become Responses items again."""

    chat: ChatCompletionRequest
    custom_tools: frozenset[str] = frozenset()
    ignored: list[str] = field(default_factory=list)


def translate(body: ResponsesRequest) -> Translation:
    """``body`` as a chat request; :class:`RequestError` naming the ``input`` item that cannot be read."""
    if body.previous_response_id is not None:
        raise RequestError(
            f"previous_response_id: response {body.previous_response_id!r} is not known here; stored responses "
            "live in the router (send the request through ovrouter with store: true), or send the whole input",
            param="previous_response_id",
        )
    ignored = sorted(set(body.model_extra or {}) - _KNOWN)
    messages = _messages(body, ignored)
    tools, custom = _tools(body.tools or [], ignored)
    chat: dict[str, Any] = {
        "messages": messages, "stream": body.stream, "parallel_tool_calls": body.parallel_tool_calls,
        "continue_final_message": body.continue_final_message,
    }
    for key, value in (("max_tokens", body.max_output_tokens), ("temperature", body.temperature),
                       ("top_p", body.top_p), ("seed", body.seed), ("stop", body.stop)):
        if value is not None:
            chat[key] = value
    if tools:
        chat["tools"] = tools
        if (choice := _tool_choice(body.tool_choice, ignored)) is not None:
            chat["tool_choice"] = choice
    if (fmt := _response_format(body.text)) is not None:
        chat["response_format"] = fmt
    try:
        request = ChatCompletionRequest.model_validate(chat, strict=False)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise RequestError(f"the request does not translate to a chat: {where}: {first['msg']}") from None
    return Translation(request, frozenset(custom), ignored)


# -- input ------------------------------------------------------------------------------------------


def _messages(body: ResponsesRequest, ignored: list[str]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    names: dict[str, str] = {}  # call_id -> the function's name, for the tool turns that answer it
    for index, item in enumerate(body.input):
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, index))
        elif kind in ("function_call", "custom_tool_call"):
            call = _call(item, index, kind)
            names[call["id"]] = call["function"]["name"]
            _assistant_for_calls(messages)["tool_calls"].append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = _string(item, "call_id", index)
            turn = {"role": "tool", "tool_call_id": call_id, "content": _output_text(item.get("output"))}
            if call_id in names:
                turn["name"] = names[call_id]
            messages.append(turn)
        elif kind in _DROPPED_ITEMS:
            continue
        else:
            ignored.append(f"input[{index}].type={kind}")
    if not messages:
        raise RequestError("input: send a string or at least one message item", param="input")
    return messages


def _message(item: dict[str, Any], index: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise RequestError(f"input[{index}].role: expected user, assistant, system or developer, got {role!r}",
                           param="input")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise RequestError(f"input[{index}].content: expected a string or a list of content parts", param="input")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": str(part.get("text") or part.get("refusal") or "")})
        elif kind == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(part, index, j)}})
        else:
            raise UnsupportedParameter(f"input[{index}].content[{j}]: content part of type {kind!r} is not "
                                       "supported; send input_text, output_text or input_image parts", param="input")
    return {"role": role, "content": parts}


def _image_url(part: dict[str, Any], index: int, j: int) -> str:
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise RequestError(f"input[{index}].content[{j}].image_url: expected a data:image/...;base64,... URL "
                           "(file_id images are not stored here)", param="input")
    return url


def _call(item: dict[str, Any], index: int, kind: str) -> dict[str, Any]:
    name = _string(item, "name", index)
    call_id = str(item.get("call_id") or item.get("id") or f"call_{index}")
    if kind == "custom_tool_call":
        arguments = json.dumps({"input": str(item.get("input") or "")})
    else:
        raw = item.get("arguments")
        arguments = raw if isinstance(raw, str) else json.dumps(raw or {})
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments or "{}"}}


def _assistant_for_calls(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message a call belongs to: the one just before it, else a new one without text."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", [])
        return last
    message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": []}
    messages.append(message)
    return message


def _output_text(output: Any) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "\n".join(str(p.get("text", "")) for p in output if isinstance(p, dict) and p.get("type") in _TEXT_PARTS)
    return json.dumps(output)


def _string(item: dict[str, Any], key: str, index: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise RequestError(f"input[{index}].{key}: required for a {item.get('type')} item", param="input")
    return value


# -- tools and output -------------------------------------------------------------------------------


def _tools(tools: list[dict[str, Any]], ignored: list[str]) -> tuple[list[dict[str, Any]], set[str]]:
    """Chat tools for ``function`` and ``custom`` tools (and the names of the custom ones)."""
    out: list[dict[str, Any]] = []
    custom: set[str] = set()
    for index, tool in enumerate(tools):
        kind, name = tool.get("type"), tool.get("name")
        if kind not in ("function", "custom") or not isinstance(name, str):
            ignored.append(f"tools[{index}].type={kind}")
            continue
        function: dict[str, Any] = {"name": name}
        if kind == "function":
            function["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
            description = tool.get("description")
        else:
            custom.add(name)
            function["parameters"] = {"type": "object", "properties": {"input": {"type": "string"}},
                                      "required": ["input"]}
            description = _custom_description(tool)
        if description:
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out, custom


def _custom_description(tool: dict[str, Any]) -> str:
    """A custom tool's description; a grammar format is written out (it is not enforced)."""
    text = str(tool.get("description") or "")
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and fmt.get("definition"):
        text += f"\nThe input must follow this {fmt.get('syntax', 'grammar')} grammar:\n{fmt['definition']}"
    return text.strip()


def _tool_choice(choice: str | dict[str, Any] | None, ignored: list[str]) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind in ("function", "custom") and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        if kind == "allowed_tools":
            return "required" if choice.get("mode") == "required" else "auto"
    ignored.append(f"tool_choice={json.dumps(choice)[:60]}")
    return "auto"


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {"name": fmt.get("name") or "response", "schema": fmt.get("schema") or {}, "strict": fmt.get("strict")}
        return {"type": "json_schema", "json_schema": schema}
    raise RequestError(f"text.format.type: expected text, json_object or json_schema, got {fmt.get('type')!r}",
                       param="text")
