"""How each client protocol frames a stream, as the router needs it: its clean end, its error event, its wait.

One table by path (:func:`framing_of`); a path in none of them is not a stream the router
looks into (its bytes pass through unchanged)::

    protocol      paths                            clean end               error event              cold start
    OpenAI        /v1/chat/completions, ...        data: [DONE]            data: {"error": ...}     SSE comments
    Anthropic     /v1/messages                     event: message_stop     event: error             ping events
    Ollama        /ollama/api/chat, /generate      a "done":true line      {"error": "..."} line    nothing (NDJSON)
    Responses     /v1/responses (resumed only)     (OpenAI's)              event: response.failed   (OpenAI's)

A Responses stream is looked into only by the recovery that resumes it (:func:`resumed_framing`): the
router writes OpenAI's events into it (:class:`router.api.responses.ResponsesStream` turns an error event
into ``response.failed``), while the model server's own error event starts ``event: response.failed``.

The closing event is held back until the upstream ends cleanly (:func:`held_end`): a
server that sends it and then breaks the connection must not have its client stop there
before the router's error event. A stream cut short ends with the protocol's error event
(:meth:`Framing.error`), never a bare cut, and never after its closing event.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass

from router.edge.errors import anthropic_error, error_body

__all__ = ["ANTHROPIC", "NDJSON", "OPENAI", "RESPONSES", "Framing", "framing_of", "held_end", "resumed_framing",
           "sse_comment"]


def sse_comment(text: str) -> bytes:
    """An SSE comment line: ignored by every SSE parser, but it keeps proxies and clients alive."""
    return ("".join(f": {line}\n" for line in text.splitlines() or [""]) + "\n").encode()


@dataclass(frozen=True, slots=True)
class Framing:
    name: str
    ends: tuple[bytes, ...]  # how the closing event starts
    error_starts: bytes  # how an error event starts
    _error: Callable[[str, str, int], bytes]
    _tick: Callable[[str], bytes]
    content_type: bytes = b"text/event-stream"  # the streams it frames (other answers pass through)
    separator: bytes = b"\n\n"  # between events
    event: bytes = b"data:"  # counted as the events (chunks) a stream relayed

    def frames(self, content_type: bytes) -> bool:
        """Whether an answer of ``content_type`` is one of this protocol's streams."""
        return content_type.startswith(self.content_type)

    def error(self, message: str, code: str = "backend_error", status: int = 502) -> bytes:
        """The events that end a stream with an error (``status``: the HTTP status it would have had)."""
        return self._error(message, code, status)

    def tick(self, text: str) -> bytes:
        """One cold-start event: ``text`` says how long the model has been loading."""
        return self._tick(text)

    def ended(self, tail: bytes) -> bool:
        """Whether ``tail`` (what a stream held back at its end) is its closing event."""
        return any(end in tail for end in self.ends)


def _openai_error(message: str, code: str, status: int) -> bytes:
    return b"data: " + error_body(message, "server_error", code) + b"\n\ndata: [DONE]\n\n"


def _anthropic_error(message: str, code: str, status: int) -> bytes:
    return b"event: error\ndata: " + json.dumps(anthropic_error(status, message)).encode() + b"\n\n"


def _ndjson_error(message: str, code: str, status: int) -> bytes:
    return json.dumps({"error": message}).encode() + b"\n"


def _ping(text: str) -> bytes:
    return sse_comment(text) + b'event: ping\ndata: {"type":"ping"}\n\n'


OPENAI = Framing("openai", (b"data: [DONE]", b"data:[DONE]"), b'data: {"error"', _openai_error, sse_comment)
ANTHROPIC = Framing("anthropic", (b"event: message_stop",), b"event: error", _anthropic_error, _ping)
#: Ollama's NDJSON (modelserver/api/ollama.py writes compact JSON): no line may say anything while a model
#: starts, so its tick is empty and /ollama paths get no cold-start ticker (router.path.loading).
NDJSON = Framing("ollama", (b'"done":true', b'{"error"'), b'{"error"', _ndjson_error, lambda text: b"",
                 b"application/x-ndjson", b"\n", b"\n")
#: A Responses stream as the recovery relays it: OpenAI's framing, but the model server's errors are its own.
RESPONSES = dataclasses.replace(OPENAI, name="responses", error_starts=b"event: response.failed")
#: Path -> the framing of its streams (a path's query string aside).
FRAMINGS: dict[str, Framing] = {
    "/v1/chat/completions": OPENAI,
    "/v1/completions": OPENAI,
    "/v1/messages": ANTHROPIC,
    "/ollama/api/chat": NDJSON,
    "/ollama/api/generate": NDJSON,
}


#: Streams looked into only when they are resumed (else their bytes pass through): path -> framing.
RESUMED: dict[str, Framing] = {"/v1/responses": RESPONSES}


def framing_of(path: str) -> Framing | None:
    return FRAMINGS.get(path.partition("?")[0])


def resumed_framing(path: str) -> Framing:
    """The framing of a stream of ``path`` that the router relays event by event to resume it (OpenAI's else)."""
    path = path.partition("?")[0]
    return FRAMINGS.get(path) or RESUMED.get(path) or OPENAI


def held_end(whole: bytes, framing: Framing = OPENAI) -> int:
    """Where the closing event of ``whole`` (whole events) starts; ``len(whole)`` when its last event is another."""
    start = max(whole.rfind(end) for end in framing.ends)
    if start < 0 or framing.separator in whole[start:].rstrip():
        return len(whole)
    before = whole.rfind(framing.separator, 0, start)  # the event's own start (an NDJSON line's, say)
    return before + len(framing.separator) if before >= 0 else 0
