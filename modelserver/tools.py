"""Tool calling, pure text logic (no engine, no HTTP): the parsers, template detection, the fallback prompt.

A model writes its tool calls as text in its family's own format; a *tool parser* turns
that text back into OpenAI ``tool_calls``:

- ``hermes``       ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen 2.5/3, Hermes, many fine-tunes)
- ``llama3_json``  ``{"name": ..., "parameters": {...}}`` as the whole answer, optionally after ``<|python_tag|>``
- ``pythonic``     ``[get_weather(city="Paris"), ...]`` as the whole answer (Llama 3.2/4 pythonic templates)
- ``mistral``      ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` (or ``[TOOL_CALLS]name[ARGS]{...}``)
- ``none``         the model takes no tools: a request with ``tools`` is a 400

Every parser also accepts an answer that is nothing but a JSON call (``{"name", "arguments"}``
or a list of them), the form constrained decoding writes for the non-Hermes families. When
no parser is configured, :func:`detect_parser` picks one from the chat template; a
template that never mentions ``tools`` gets them described in a system message by
:func:`tools_system_prompt` and answers in the Hermes form.

:class:`ToolStreamSplitter` does the same for a stream: text is passed on as it comes until
a call starts; from there the rest is held and turned into calls at the end (or passed on
as text after all when it does not parse).
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from modelserver.ids import random_hex

__all__ = [
    "PARSERS",
    "ParsedOutput",
    "ToolCall",
    "ToolParserName",
    "ToolStreamSplitter",
    "detect_parser",
    "drop_cut_call",
    "mistral_call_ids",
    "parse_tool_calls",
    "plain_history",
    "template_takes_tools",
    "tools_system_prompt",
]

ToolParserName = Literal["hermes", "llama3_json", "pythonic", "mistral", "none"]
PARSERS: tuple[str, ...] = ("hermes", "llama3_json", "pythonic", "mistral", "none")

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"

#: Markers that start a call anywhere in the text, per parser.
_MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": (HERMES_OPEN,),
    "llama3_json": (PYTHON_TAG,),
    "pythonic": (PYTHON_TAG,),
    "mistral": (MISTRAL_TAG,),
}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: ``arguments`` is a JSON object as a string, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = ""

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None
    calls: tuple[ToolCall, ...]


def new_call_id() -> str:
    return "call_" + random_hex(24)


# -- template detection -----------------------------------------------------------------------


def template_takes_tools(template: str) -> bool:
    """True when the chat template renders a ``tools`` list itself."""
    return bool(re.search(r"\btools\b", template or ""))


def detect_parser(template: str) -> str:
    """The parser for a model's chat template (Hermes when the template says nothing about tools)."""
    text = template or ""
    if not template_takes_tools(text) or HERMES_OPEN in text:
        return "hermes"
    if MISTRAL_TAG in text:
        return "mistral"
    if "[func_name1(" in text or "func_name1(params_name1" in text:
        return "pythonic"
    if PYTHON_TAG in text or "ipython" in text or '"parameters"' in text:
        return "llama3_json"
    return "hermes"


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The system text that describes ``tools`` to a model whose template has no tool support."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call>"
    )


# -- parsing ----------------------------------------------------------------------------------


def _call_of(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_calls(text: str) -> list[ToolCall] | None:
    """``text`` as one JSON call, a list of calls, or calls separated by ``;`` (Llama 3); None otherwise."""
    text = text.strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        parts = [p for p in text.split(";") if p.strip()] if ";" in text else []
        calls = [_json_calls(p) for p in parts]
        if parts and all(c is not None and len(c) == 1 for c in calls):
            return [c[0] for c in calls if c]
        return None
    items = value if isinstance(value, list) else [value]
    found = [_call_of(item) for item in items]
    if not items or any(c is None for c in found):
        return None
    return [c for c in found if c is not None]


def _hermes(text: str) -> tuple[str, list[ToolCall]] | None:
    if HERMES_OPEN not in text:
        return None
    calls: list[ToolCall] = []
    content, rest = text.split(HERMES_OPEN, 1)
    for block in rest.split(HERMES_OPEN):
        body, _, after = block.partition(HERMES_CLOSE)
        found = _json_calls(body)
        if found is None:  # a block that does not parse (cut by max_tokens, say) stays text
            after = HERMES_OPEN + block
        calls.extend(found or ())
        content += after.strip() and ("\n" + after.strip())
    return (content, calls) if calls else None


def _pythonic_value(node: ast.AST) -> Any:
    return ast.literal_eval(node)


def _pythonic(text: str) -> list[ToolCall] | None:
    text = text.strip()
    if not (text.startswith("[") and text.endswith("]")):
        return None
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return None
    if not isinstance(tree.body, ast.List):
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {kw.arg: _pythonic_value(kw.value) for kw in node.keywords if kw.arg}
        except (ValueError, SyntaxError):
            return None
        calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls or None


def _mistral(text: str) -> tuple[str, list[ToolCall]] | None:
    if MISTRAL_TAG not in text:
        return None
    content, rest = text.split(MISTRAL_TAG, 1)
    calls = _json_calls(rest)
    if calls is None:  # the newer form: [TOOL_CALLS]name[ARGS]{...} repeated
        calls = []
        for block in rest.split(MISTRAL_TAG):
            name, sep, args = block.partition("[ARGS]")
            found = _json_calls(json.dumps({"name": name.strip(), "arguments": args.strip()})) if sep else None
            if not found:
                return None
            calls.extend(found)
    return content, calls


def parse_tool_calls(parser: str, text: str) -> ParsedOutput:
    """The calls in a whole answer; an answer with none (or one that does not parse) is plain content."""
    content: str = text
    calls: list[ToolCall] | None = None
    if parser == "hermes" and (found := _hermes(text)) is not None:
        content, calls = found
    elif parser == "mistral" and (found := _mistral(text)) is not None:
        content, calls = found
    elif parser in ("llama3_json", "pythonic") and text.lstrip().startswith(PYTHON_TAG):
        content, calls = "", _json_calls(text.lstrip()[len(PYTHON_TAG) :])
        if calls is None and parser == "pythonic":
            calls = _pythonic(text.lstrip()[len(PYTHON_TAG) :])
        if calls is None:
            content = text
    if calls is None and parser == "pythonic":
        calls = _pythonic(text)
        content = "" if calls else text
    if calls is None and parser != "none":
        calls = _json_calls(text)
        content = "" if calls else text
    if not calls:
        return ParsedOutput(text, ())
    ids = tuple(ToolCall(c.name, c.arguments, new_call_id()) for c in _distinct(calls))
    return ParsedOutput(content.strip() or None, ids)


def _distinct(calls: list[ToolCall], seen: set[tuple[str, str]] | None = None) -> list[ToolCall]:
    """``calls`` without repeats (same name and arguments; a weak model may write one call over and over)."""
    seen = set() if seen is None else seen
    out = []
    for call in calls:
        if (call.name, call.arguments) not in seen:
            seen.add((call.name, call.arguments))
            out.append(call)
    return out


_BARE_CALL = re.compile(r'\s*\[?\s*\{\s*"name"\s*:')


def drop_cut_call(parser: str, text: str) -> str:
    """``text`` of an answer cut by ``max_tokens`` without the unfinished call at its end (a marker's first
    characters such as ``<tool``, an unclosed ``<tool_call>`` block, a bare JSON call cut short); the complete
    calls before it stay."""
    if parser == "none":
        return text
    markers = _MARKERS.get(parser, ())
    text = text[: len(text) - max((_partial_suffix(text, m) for m in markers), default=0)]
    if parser == "hermes":
        at = text.rfind(HERMES_OPEN)
        unclosed = at >= 0 and HERMES_CLOSE not in text[at:]
        return text[:at] if unclosed and _json_calls(text[at + len(HERMES_OPEN) :]) is None else text
    for marker in markers:
        if (at := text.find(marker)) >= 0 and not parse_tool_calls(parser, text[at:]).calls:
            return text[:at]
    if _BARE_CALL.match(text) and not parse_tool_calls(parser, text).calls:
        while ";" in text:  # Llama 3's `;`-separated calls: keep the complete ones
            text = text.rsplit(";", 1)[0]
            if parse_tool_calls(parser, text).calls:
                return text
        return ""
    return text


# -- streaming --------------------------------------------------------------------------------


class ToolStreamSplitter:
    """Text deltas in; content deltas and tool calls out, each as soon as it is certain.

    Content is passed on until a call may have started: a parser's marker anywhere, or a
    ``{`` / ``[`` opening the whole answer. From there on the text is held. A Hermes call is
    sent as soon as its ``</tool_call>`` arrives; everything else held is parsed at the end,
    and passed on as text after all if it holds no call. A marker's first characters at the
    end of a delta are held back until the next delta shows whether they are a marker.
    """

    def __init__(self, parser: str) -> None:
        self._parser = parser
        self._markers = _MARKERS.get(parser, ())
        self._sent = ""  # content already passed on
        self._pending = ""  # content not yet passed on (a possible marker start)
        self._held: str | None = None  # the text from the start of a call
        self._calls = 0  # calls already sent
        self._seen: set[tuple[str, str]] = set()  # their names and arguments (a repeat is not sent again)

    def push(self, delta: str) -> tuple[str, tuple[ToolCall, ...]]:
        """The content that became certain, and the calls that did."""
        if self._held is not None:
            self._held += delta
            return "", self._complete_calls()
        text = self._pending + delta
        if not self._sent and text.lstrip()[:1] in ("{", "[") and self._parser != "none":
            self._held, self._pending = text, ""
            return "", ()
        for marker in self._markers:
            if (at := text.find(marker)) >= 0:
                self._held, self._pending = text[at:], ""
                return self._emit(text[:at]), self._complete_calls()
        keep = max((_partial_suffix(text, m) for m in self._markers), default=0)
        if not self._sent and not text.strip():
            keep = len(text)  # leading whitespace waits: a call may follow it
        self._pending = text[len(text) - keep :] if keep else ""
        return self._emit(text[: len(text) - keep]), ()

    def _complete_calls(self) -> tuple[ToolCall, ...]:
        """Hermes blocks closed so far, parsed and taken off the held text (a block that does not parse stays)."""
        calls: list[ToolCall] = []
        while self._parser == "hermes" and self._held is not None:
            held = self._held.lstrip()
            end = held.find(HERMES_CLOSE)
            if not held.startswith(HERMES_OPEN) or end < 0:
                break
            found = _json_calls(held[len(HERMES_OPEN) : end])
            if not found:
                break
            calls += [ToolCall(c.name, c.arguments, new_call_id()) for c in _distinct(found, self._seen)]
            self._held = held[end + len(HERMES_CLOSE) :]
        self._calls += len(calls)
        return tuple(calls)

    def _emit(self, text: str) -> str:
        self._sent += text
        return text

    def finish(self, cut: bool = False) -> tuple[str, tuple[ToolCall, ...]]:
        """The last content delta and the last calls once the stream has ended (``cut``: by ``max_tokens``,
        so an unfinished call at the end is dropped, not passed on as text)."""
        held, self._held = self._held, None
        if held is None:
            rest, self._pending = self._pending, ""
            return self._emit(drop_cut_call(self._parser, rest) if cut else rest), ()
        if cut:
            held = drop_cut_call(self._parser, held)
        parsed = parse_tool_calls(self._parser, held) if held.strip() else ParsedOutput(None, ())
        calls = tuple(_distinct(list(parsed.calls), self._seen))
        self._calls += len(calls)
        if not parsed.calls:
            return (self._emit(held) if held.strip() or not self._calls else ""), ()
        return self._emit(parsed.content or ""), calls

    @property
    def calls_sent(self) -> int:
        return self._calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def plain_history(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` for a template without tool support: tools described in the system message, calls
    and results written out as Hermes text (assistant turns) and ``<tool_response>`` user turns."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.get("tool_calls"):
            calls = "\n".join(_hermes_text(c["function"]) for c in message["tool_calls"])
            text = (message.get("content") or "") + ("\n" if message.get("content") else "") + calls
            out.append({"role": "assistant", "content": text})
        elif message["role"] == "tool":
            result = message.get("content") or ""
            out.append({"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"})
        else:
            out.append({"role": message["role"], "content": message.get("content") or ""})
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _hermes_text(function: dict[str, Any]) -> str:
    call = json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False)
    return f"{HERMES_OPEN}\n{call}\n{HERMES_CLOSE}"


def _nine(call_id: str) -> str:
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def mistral_call_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with every tool call id as Mistral's templates demand it (9 alphanumeric characters;
    the same id always maps to the same nine, so calls and their results still pair up)."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [{**c, "id": _nine(str(c.get("id", "")))} for c in message["tool_calls"]]
        if message.get("tool_call_id") is not None:
            message["tool_call_id"] = _nine(str(message["tool_call_id"]))
        out.append(message)
    return out
