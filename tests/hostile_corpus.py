"""The hostile bodies every route must answer with a 4xx JSON error (or a 2xx where the body is in fact
valid), and the routes of an app, enumerated so that a route added later is covered without a
test edit. Used in-process over every router route (tests/test_hostile_routes.py) and over a real
router and model-server process (tests/test_hostile_router.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["METHODS", "Answer", "Case", "Target", "corpus", "fault", "send", "strangers", "targets"]

MIB = 1024 * 1024
DEEP = 100_000


@dataclass(frozen=True)
class Case:
    """One hostile request body: its bytes, its Content-Type, how it arrives (``pieces`` > 1: chunked,
    no Content-Length; ``declared``: a Content-Length that does not match; ``cut``: the client
    hangs up half-way)."""

    name: str
    body: bytes
    content_type: str = "application/json"
    pieces: int = 1
    declared: int | None = None
    cut: bool = False

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Target:
    """One method on one route, its path parameters filled in."""

    method: str
    path: str
    template: str = field(compare=False)
    acts: bool = field(compare=False)  # the route changes a model's process whatever the body (load, restart...)

    def __repr__(self) -> str:
        return f"{self.method} {self.template}"


def _chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, **extra}


def _with(model: str, raw: str) -> bytes:
    """A chat body for ``model`` with ``raw`` JSON text (not valid JSON on its own) spliced in as ``"x"``."""
    return json.dumps(_chat(model))[:-1].encode() + b', "x": ' + raw.encode() + b"}"


def corpus(model: str, too_large_bytes: int) -> list[Case]:
    """Bodies naming ``model`` where they name one; ``too_large_bytes``: a size over the body limit."""
    chat = json.dumps(_chat(model)).encode()
    echoed = json.dumps(_chat(model, stream=True, input="hi", instructions="a SURROGATE b")).encode()
    form = (b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n" + model.encode() +
            b"\r\n--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            b"Content-Type: audio/wav\r\n\r\nRIFF\x00\x00\r\n--b--\r\n")
    return [
        # depth
        Case("deep-arrays", b"[" * DEEP + b"]" * DEEP),
        Case("deep-objects-after-model", _with(model, '{"a":' * DEEP + "1" + "}" * DEEP)),
        Case("deep-never-closed", b'{"model": "' + model.encode() + b'", "x": ' + b"[" * DEEP),
        Case("depth-65", _with(model, "[" * 65 + "]" * 65)),
        Case("deep-inside-a-string", _with(model, '"' + "[" * DEEP + '"')),  # text, not structure: valid
        # size
        Case("over-the-limit", b'{"model": "' + model.encode() + b'", "x": "' + b"a" * too_large_bytes + b'"}'),
        Case("long-model-name", json.dumps(_chat("m" * 100_000)).encode()),
        # encodings
        Case("invalid-utf8", chat.replace(b"hello", b"\xff\xfe\xc3")),
        Case("utf16", json.dumps(_chat(model)).encode("utf-16")),
        Case("utf32-be", json.dumps(_chat(model)).encode("utf-32-be")),
        Case("utf8-bom", b"\xef\xbb\xbf" + chat),
        Case("lone-surrogate", chat.replace(b"hello", b"\\ud800")),
        Case("encoded-surrogate", chat.replace(b"hello", b"\xed\xa0\x80")),
        # in a streamed Responses request's echoed field: the router's own encoding of the opening event failed
        Case("lone-surrogate-echoed", echoed.replace(b"SURROGATE", b"\\ud800")),
        Case("encoded-surrogate-echoed", echoed.replace(b"SURROGATE", b"\xed\xa0\x80")),
        Case("raw-control-chars", chat.replace(b"hello", b"\x01\x1b[2J")),
        Case("nul-bytes", b"\x00" * 64),
        # values
        Case("nan", _with(model, "NaN")),
        Case("nan-temperature", json.dumps(_chat(model))[:-1].encode() + b', "temperature": NaN}'),
        Case("infinity-max-tokens", json.dumps(_chat(model))[:-1].encode() + b', "max_tokens": -Infinity}'),
        Case("huge-integer", json.dumps(_chat(model))[:-1].encode() + b', "seed": ' + b"9" * 5000 + b"}"),
        Case("huge-float", _with(model, "1e999999")),
        Case("duplicate-keys", b'{"model": "nope", "model": "' + model.encode() + b'", "messages": []}'),
        Case("model-not-a-string", json.dumps({"model": {"name": model}}).encode()),
        # shapes
        Case("empty", b""),
        Case("blank", b" \r\n\t "),
        Case("null", b"null"),
        Case("array", json.dumps([_chat(model)]).encode()),
        Case("string", json.dumps(model).encode()),
        Case("truncated", chat[: len(chat) // 2]),
        Case("trailing-garbage", chat + b"}}]"),
        # content types
        Case("multipart-without-boundary", form, "multipart/form-data"),
        Case("multipart-garbage", b"--x\r\n\r\n\r\n" * 50, "multipart/form-data; boundary=x"),
        Case("multipart-with-model", form, "multipart/form-data; boundary=b"),
        Case("form-urlencoded", b"model=" + model.encode(), "application/x-www-form-urlencoded"),
        Case("text-plain-json", chat, "text/plain"),
        Case("garbled-content-type", chat, ';;;=="\x7f; boundary'),
        # framing as the app sees it
        Case("chunked-pieces", chat, pieces=3),
        Case("longer-than-declared", chat, pieces=2, declared=10),
        Case("client-gone-half-way", chat, pieces=2, cut=True),
    ]


#: Values for path parameters by name; any other parameter names a model.
_PARAMS = {"path": "v1/chat/completions", "file": "index.html", "id": "1", "device": "CPU"}
#: Routes that start, stop or restart a model whatever the body says.
_ACTIONS = ("/load", "/unload", "/restart", "/reload", "/reset", "/cancel")


def _routes(app: Any) -> list[Any]:
    """The Starlette routes under ``app``'s middleware wrappers."""
    while not hasattr(app, "routes"):
        app = app.app
    return list(app.routes)


def _filled(route: Any, model: str, bystander: str) -> tuple[str, bool]:
    """``route``'s path with its parameters filled in, and whether it acts on a model (then it names ``bystander``)."""
    acts = route.path.endswith(_ACTIONS)
    values = {name: _PARAMS.get(name, bystander if acts else model) for name in route.param_convertors}
    path = route.path
    for name, value in values.items():
        path = path.replace("{" + name + "}", value).replace("{" + name + ":path}", value)
    return path, acts


def targets(app: Any, model: str, bystander: str) -> list[Target]:
    """Every method of every route of ``app``; path parameters name ``model``, or ``bystander`` on the
    routes that act on a model (so ``model``'s process must not change)."""
    found = []
    for route in _routes(app):
        path, acts = _filled(route, model, bystander)
        methods = sorted(set(route.methods or ["GET"]) - {"HEAD", "OPTIONS"})
        found += [Target(method, path, route.path, acts) for method in methods]
    return found


#: The methods tried on every route that does not take them.
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def strangers(app: Any, model: str, bystander: str) -> list[Target]:
    """Each route's path of ``app`` with every method of :data:`METHODS` that no route takes on that path."""
    taken: dict[str, set[str]] = {}
    templates: dict[str, tuple[str, bool]] = {}
    for route in _routes(app):
        path, acts = _filled(route, model, bystander)
        taken.setdefault(path, set()).update(route.methods or ["GET"])
        templates.setdefault(path, (route.path, acts))
    return [Target(method, path, *templates[path]) for path in taken for method in METHODS
            if method not in taken[path]]


@dataclass
class Answer:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


async def send(app: Any, target: Target, case: Case, headers: Sequence[tuple[str, str]] = ()) -> Answer:
    """``case`` to ``target`` through the ASGI app (with ``headers`` too); a stream is hung up on once its head
    arrived."""
    pieces = [case.body[i * len(case.body) // case.pieces:(i + 1) * len(case.body) // case.pieces]
              for i in range(case.pieces)]
    sent = [(b"content-type", case.content_type.encode("latin-1"))]
    sent += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers]
    if case.pieces == 1 or case.declared is not None:
        declared = case.declared if case.declared is not None else len(case.body)
        sent.append((b"content-length", str(declared).encode()))
    else:
        sent.append((b"transfer-encoding", b"chunked"))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": target.method,
             "scheme": "http", "path": target.path, "raw_path": target.path.encode(), "query_string": b"",
             "root_path": "", "headers": sent, "client": ("127.0.0.1", 40000), "server": ("testserver", 80)}
    gone, answer = asyncio.Event(), Answer()

    async def receive() -> dict[str, Any]:
        if pieces and not (case.cut and len(pieces) == 1):
            piece = pieces.pop(0)
            return {"type": "http.request", "body": piece, "more_body": bool(pieces)}
        if case.cut:
            gone.set()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def reply(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
            if answer.headers.get("content-type", "").startswith("text/event-stream"):
                gone.set()  # an endless stream: the client hangs up
        elif message["type"] == "http.response.body":
            answer.body += message.get("body", b"")

    await asyncio.wait_for(app(scope, receive, reply), 30)
    return answer


def fault(status: int, content_type: str, body: bytes, path: str = "") -> str | None:
    """What is wrong with an answer to a hostile body (a 4xx needs the JSON error object: OpenAI's,
    Anthropic's on the Messages API's routes, Ollama's ``{"error": "..."}`` under ``/ollama``), or None."""
    if not 200 <= status < 500:
        return f"status {status}: {body[:200]!r}"
    if status < 400:
        return None
    if not content_type.startswith("application/json"):
        return f"{status} with content-type {content_type!r}"
    try:
        data = json.loads(body)
        error = data["error"]
        if path.startswith("/ollama/"):
            assert isinstance(error, str) and error
            return None
        assert isinstance(error["message"], str) and error["message"] and "type" in error
        if path.startswith("/v1/messages"):
            assert data.get("type") == "error"  # Anthropic's shape on the Messages API's routes
        else:
            assert "code" in error
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"{status} without the error object of {path or 'the route'}: {body[:200]!r}"
    return None
