"""Resuming a stream whose backend died: what was relayed, what to ask next, how to splice it in.

A streamed chat or completion whose model process dies (or is killed as fatal, hung or
stalled) mid-generation is continued on the fresh process instead of being cut. The
router keeps the events it relayed (:class:`StreamLog`, whole events only, so a client
never holds half an event when the continuation starts); on a death it reads them back
(:func:`progress`), asks the fresh process to continue the answer
(:func:`continuation`: for a chat, the text so far as a final assistant message with
``continue_final_message``; for a completion, prompt + text so far; ``max_tokens`` less
the tokens already sent) and relays that stream through a :class:`Splice`, which makes
it look like the rest of the first: the same ``id``, ``created`` and ``model``, no second
role delta, usage summed.

A Responses stream (``/v1/responses``) is continued the same way: the text so far as a final
assistant input item with ``continue_final_message`` (the model server's message then starts with
it), ``max_output_tokens`` less what was sent; :class:`router.api.responses.ResponsesStream` drops the
openings the continuation repeats, numbers the events and moves the usage.

Only what can be continued faithfully is resumable (:func:`plan`): one choice, no tools,
no output constraint, no logprobs. An Anthropic Messages stream is resumed the same way
(:mod:`router.path.resume_anthropic`: the text so far as a final assistant message, which the
Messages API continues). Pure functions over bytes and dicts: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from router.edge.body import json_or_none
from router.path.framing import ANTHROPIC, OPENAI, Framing, held_end

__all__ = ["FATAL_EVENT_CODES", "Plan", "Progress", "Resumer", "Splice", "StreamLog", "continuation", "fatal_event",
           "finished", "plan", "progress"]

Kind = Literal["chat", "completion", "responses", "messages"]
_KINDS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
                           "/v1/responses": "responses", "/v1/messages": "messages"}
#: The events that end a Responses stream (it has no ``[DONE]``).
TERMINAL_EVENTS = (b'"response.completed"', b'"response.incomplete"', b'"response.failed"')

#: Error events of the model server that mean its process is beyond repair (it exits next).
FATAL_EVENT_CODES = (b'"engine_fatal"', b'"engine_suspect"')
_CONSTRAINTS = ("tools", "functions", "response_format", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar")


@dataclass(frozen=True, slots=True)
class Plan:
    """A stream that may be resumed: its parsed body and what kind of answer it is."""

    kind: Kind
    body: dict[str, Any]
    default_max_tokens: int


def plan(path: str, body: bytes, default_max_tokens: int, chat_ok: bool = True) -> Plan | None:
    """The resume plan of a streamed request to ``path``, or None when it cannot be continued faithfully.

    ``chat_ok`` False: the backend is not known to take ``continue_final_message`` (chat is not resumed).
    """
    kind = _KINDS.get(path.partition("?")[0])  # a Responses stream is continued like a chat (router/api/responses.py
    if kind is None or (kind != "completion" and not chat_ok):  # splices it), a Messages one with a prefill
        return None
    data = json_or_none(body)  # an /upstream body is read raw: bounded here, passed on whatever it holds
    if not isinstance(data, dict) or data.get("stream") is not True or data.get("n", 1) not in (1, None):
        return None
    if data.get("logprobs") or _constrained(data):
        return None
    if kind == "responses" and ((data.get("text") or {}).get("format") or {}).get("type") not in (None, "text"):
        return None
    if kind == "completion" and not isinstance(data.get("prompt"), str):
        return None
    return Plan(kind, data, default_max_tokens)


def _constrained(data: dict[str, Any]) -> bool:
    """Tools or an output constraint: a continuation from the middle would not honour them."""
    for key in _CONSTRAINTS:
        value = data.get(key)
        if key == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        if value not in (None, [], {}):
            return True
    return False


class StreamLog:
    """The SSE events relayed to the client so far; :meth:`cut` lets only whole events through.

    A closing ``data: [DONE]`` is held back until the stream ends cleanly (:meth:`rest`): a
    server that sends it and then breaks the connection (llama-cpp-python, cutting a stream
    for a concurrent request) must not have its client stop at that ``[DONE]`` before the
    router's error event.
    """

    __slots__ = ("_pending", "framing", "sent")

    def __init__(self, framing: Framing = OPENAI) -> None:
        self._pending = b""
        self.sent: list[bytes] = []
        self.framing = framing

    def cut(self, chunk: bytes) -> bytes:
        """The whole events of ``pending + chunk`` (to send now); the unfinished rest waits for the next chunk."""
        data = self._pending + chunk if self._pending else chunk
        if b"\r" in data:  # CRLF line ends (sse-starlette, so llama-cpp-python): still a blank line ends an event
            data = data.replace(b"\r\n", b"\n")
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        whole, self._pending = data[: end + 2], data[end + 2 :]
        done = held_end(whole, self.framing)
        if done < len(whole):
            whole, self._pending = whole[:done], whole[done:] + self._pending
        if whole:
            self.sent.append(whole)
        return whole

    def rest(self) -> bytes:
        """What is left at the end of an unbroken stream: a held ``[DONE]``, else normally nothing."""
        rest, self._pending = self._pending, b""
        return rest


def events(raw: bytes) -> list[Any]:
    """The ``data:`` payloads of ``raw`` SSE text, parsed (``[DONE]`` as the string "[DONE]")."""
    found: list[Any] = []
    for block in raw.split(b"\n\n"):
        for line in block.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                found.append("[DONE]")
                continue
            try:
                found.append(json.loads(payload))
            except ValueError:
                continue
    return found


def fatal_event(chunk: bytes) -> bool:
    """Whether ``chunk`` holds the model server's error event of a fatal (process-ending) engine error."""
    return b'"error"' in chunk and any(code in chunk for code in FATAL_EVENT_CODES)


@dataclass(slots=True)
class Progress:
    """What one stream sent before its backend died."""

    id: str | None = None
    created: int | None = None
    model: str | None = None
    text: str = ""
    tokens: int = 0  # content chunks: one per detokenized step, the tokens sent as near as the router can tell
    role_sent: bool = False
    finish: str | None = None
    done: bool = False
    usage: dict[str, Any] | None = None


def progress(log: StreamLog) -> Progress:
    """Read back what was relayed."""
    seen = Progress()
    for event in events(b"".join(log.sent)):
        if isinstance(event, dict) and isinstance(event.get("type"), str):  # a Responses stream
            _responses_event(seen, event)
            continue
        if event == "[DONE]":
            seen.done = True
            continue
        if not isinstance(event, dict) or "error" in event:
            continue
        if seen.id is None:
            seen.id, seen.created, seen.model = event.get("id"), event.get("created"), event.get("model")
        if event.get("usage"):
            seen.usage = event["usage"]
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            seen.role_sent = seen.role_sent or "role" in delta
            piece = delta.get("content") if "delta" in choice else choice.get("text")
            if piece:
                seen.text += piece
                seen.tokens += 1
            seen.finish = choice.get("finish_reason") or seen.finish
    return seen


def _responses_event(seen: Progress, event: dict[str, Any]) -> None:
    kind = event["type"]
    if kind == "response.output_text.delta":
        seen.text += str(event.get("delta") or "")
        seen.tokens += 1
    elif kind in ("response.completed", "response.incomplete", "response.failed"):
        seen.done = True


def finished(kind: Kind, tail: bytes, sent: list[bytes]) -> bool:
    """Whether a stream ended cleanly: its closing event (``[DONE]``, ``message_stop``: held back until the end),
    or a Responses terminal event."""
    if kind != "responses":
        return (ANTHROPIC if kind == "messages" else OPENAI).ended(tail)
    last = sent[-1] if sent else b""
    return any(marker in last for marker in TERMINAL_EVENTS)


def _responses_continuation(p: Plan, seen: Progress) -> dict[str, Any] | None:
    body = dict(p.body)
    if body.get("max_output_tokens") is not None:
        left = int(body["max_output_tokens"]) - seen.tokens
        if left <= 0:
            return None
        body["max_output_tokens"] = left
    given = body.get("input")
    items = [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else list(given or [])
    body["input"] = [*items, {"type": "message", "role": "assistant", "content": seen.text}]
    body["continue_final_message"] = True
    return body


def continuation(p: Plan, seen: Progress) -> dict[str, Any] | None:
    """The body that asks the fresh process for the rest of the answer; None when nothing is left to generate."""
    if p.kind == "responses":
        return _responses_continuation(p, seen)
    body = dict(p.body)
    limit_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    limit = body.get(limit_key) or p.default_max_tokens
    left = int(limit) - seen.tokens
    if left <= 0:
        return None
    if p.kind == "completion":
        body["prompt"] = str(body["prompt"]) + seen.text
        if body.get(limit_key) is not None:  # without one the model server caps at what its context leaves
            body[limit_key] = left  # (a default-sized limit on a prompt near the context would be a 400)
        return body
    body[limit_key] = left  # a chat continuation (continue_final_message) is capped, never refused, by the server
    messages = list(body.get("messages") or [])
    body["messages"] = [*messages, {"role": "assistant", "content": seen.text}]
    body["continue_final_message"] = True
    return body


@dataclass(slots=True)
class Splice:
    """Rewrites the continuation's events into the first stream: same ids, no second role, usage summed."""

    seen: Progress
    _log: StreamLog = field(default_factory=StreamLog)

    def feed(self, chunk: bytes) -> bytes:
        """The continuation's ``chunk`` as bytes to relay (whole events only)."""
        whole = self._log.cut(chunk)
        return self._rewrite(whole) if whole else b""

    def rest(self) -> bytes:
        rest = self._log.rest()
        return self._rewrite(rest) if rest else b""

    def _rewrite(self, raw: bytes) -> bytes:
        out: list[bytes] = []
        for event in events(raw):
            if event == "[DONE]":
                out.append(b"data: [DONE]\n\n")
                continue
            if isinstance(event, dict) and "error" not in event:
                event = self._adopt(event)
                if event is None:
                    continue
            out.append(b"data: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")
        return b"".join(out)

    def _adopt(self, event: dict[str, Any]) -> dict[str, Any] | None:
        seen = self.seen
        for key in ("id", "created", "model"):
            if getattr(seen, key) is not None:
                event[key] = getattr(seen, key)
        if event.get("usage"):
            usage = dict(event["usage"])
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + seen.tokens
            usage["prompt_tokens"] = max(usage.get("prompt_tokens", 0) - seen.tokens, 0)  # the continuation's
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]  # prompt held the text
            if isinstance(details := usage.get("prompt_tokens_details"), dict) and "cached_tokens" in details:
                usage["prompt_tokens_details"] = {**details, "cached_tokens": min(details["cached_tokens"],
                                                                                    usage["prompt_tokens"])}
            event["usage"] = usage
        choices = event.get("choices") or []
        if seen.role_sent and choices and _role_only(choices[0]):
            if event.get("usage") is None and len(choices) == 1:
                return None  # the opening chunk again: the client has it already
        return event


def _role_only(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    return isinstance(delta, dict) and "role" in delta and not delta.get("content") and not choice.get("finish_reason")


class Streamed(Protocol):
    def feed(self, chunk: bytes) -> bytes: ...

    def rest(self) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Resumer:
    """One protocol's way to resume a stream: read back what was sent, ask for the rest, splice it in."""

    progress: Callable[[StreamLog], Progress]
    continuation: Callable[[Plan, Progress], dict[str, Any] | None]
    splice: Callable[[Progress], Streamed]


OPENAI_RESUMER = Resumer(progress, continuation, Splice)
