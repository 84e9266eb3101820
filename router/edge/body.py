"""The router's one bounded reader of client bodies: size (:func:`read_body`), then depth and number
length (:func:`parse_json`, :func:`json_or_none`), then the model a body names (:func:`model_of`).

Every place the router looks inside a client's body goes through these: routing by ``model``
(JSON or a multipart form field), ``/models/load|unload``, resume planning and the cold-start
ticker (which also see ``/upstream`` bodies, read raw). A body the bounds refuse is a 400 or 413
naming the bound, never a ``RecursionError`` or a 500.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterable
from itertools import accumulate
from typing import Any

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.types import Receive

from modelserver.surrogates import lone_surrogate
from router.edge.errors import BadRequest, PayloadTooLarge

__all__ = ["MAX_JSON_DEPTH", "RoutedBody", "check_depth", "check_text", "json_or_none", "model_of", "parse_json",
           "read_body", "too_large"]

MIB = 1024 * 1024
#: Arrays and objects inside one another a JSON body may have (a tool's JSON schema needs ~10).
MAX_JSON_DEPTH = 64
_NOT_MARK = bytes(range(256)).translate(None, b'[]{}"')  # delete all but quotes and brackets
_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as signed bytes


def too_large(limit_bytes: int, what: str = "request body") -> PayloadTooLarge:
    return PayloadTooLarge(
        f"{what} is larger than the limit of {limit_bytes / MIB:.3g} MiB (max_request_mb); send less or raise the limit"
    )


async def read_body(receive: Receive, content_length: int | None, limit_bytes: int) -> bytes:
    """The whole body, refusing with 413 as soon as it is known to exceed ``limit_bytes`` (a body that
    stops arriving is the HTTP protocol's business: ``router.edge.connlimits``, ``body_timeout_s``).

    A body in several pieces with a ``Content-Length`` is copied into one buffer of that size as
    the pieces arrive: the pieces never pile up on the heap (where freed memory stays with the
    process), and the one large buffer goes back to the OS as soon as the body is in ``bytes``.
    """
    if content_length is not None and content_length > limit_bytes:
        raise too_large(limit_bytes)
    chunk, more = await _piece(receive)
    if not more:
        if len(chunk) > limit_bytes:
            raise too_large(limit_bytes)
        return chunk
    if content_length is None:
        return await _read_chunked(receive, chunk, limit_bytes)
    buffer = bytearray(content_length)
    view, size = memoryview(buffer), 0
    while True:
        if size + len(chunk) > content_length:
            raise BadRequest(f"request body is longer than its Content-Length ({content_length})")
        view[size:size + len(chunk)] = chunk
        size += len(chunk)
        if not more:
            break
        chunk, more = await _piece(receive)
    view.release()
    return bytes(buffer) if size == content_length else bytes(buffer[:size])


async def _read_chunked(receive: Receive, first: bytes, limit_bytes: int) -> bytes:
    chunks, size, more = [first], len(first), True
    while more:
        if size > limit_bytes:
            raise too_large(limit_bytes)
        chunk, more = await _piece(receive)
        chunks.append(chunk)
        size += len(chunk)
    if size > limit_bytes:
        raise too_large(limit_bytes)
    return b"".join(chunks)


async def _piece(receive: Receive) -> tuple[bytes, bool]:
    """The next piece of the body and whether more follows; 400 on a disconnect."""
    message = await receive()
    if message["type"] == "http.disconnect":
        raise BadRequest("client disconnected before the request body was complete")
    return message.get("body", b""), bool(message.get("more_body", False))


class RoutedBody:
    """The parts of a body the router needs: the model name and whether a stream is asked for."""

    __slots__ = ("model", "stream")

    def __init__(self, model: str, stream: bool) -> None:
        self.model = model
        self.stream = stream


def check_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """400 when ``body`` nests arrays/objects more than ``limit`` deep, before any recursive parse sees it.

    C-speed passes only: escaped quotes and backslashes go, then everything but quotes and
    brackets; the brackets outside strings give the depth as a running sum. A body with fewer
    than ``limit`` brackets (most) is done after the first pass.
    """
    if b"\\" in body:
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = body.translate(None, _NOT_MARK)
    if len(marks) - marks.count(b'"') <= limit:
        return
    outside = b"".join(marks.split(b'"')[::2])
    if max(accumulate(array("b", outside.translate(_STEP))), default=0) > limit:
        raise BadRequest(f"request body is nested too deeply: more than {limit} levels of arrays/objects; "
                         "flatten it")


def parse_json(body: bytes, hint: str) -> Any:
    """``body`` parsed as JSON within the bounds: 400 for a body nested deeper than :data:`MAX_JSON_DEPTH`
    (checked before the parser recurses), invalid JSON or UTF-8, or an integer longer than Python
    converts (4300 digits); ``hint`` says what to send instead.

    What the parser accepts beyond strict JSON is passed on as the model server's own parser
    reads it: ``NaN``/``Infinity`` (the model server refuses them in the fields it knows), a
    duplicate key (the last one wins, in both), UTF-16/32 with or without a BOM.
    """
    check_depth(body)
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON ({exc}); {hint}") from None
    except RecursionError:  # not reached past check_depth; kept so no recursion ever becomes a 500
        raise BadRequest(f"request body is nested too deeply to parse; {hint}") from None
    except ValueError as exc:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise BadRequest(f"request body holds a number too long to read ({str(exc).split(':')[0]}); {hint}") from None


def check_text(body: bytes, data: Any) -> None:
    """400 when a string of ``data`` (parsed from ``body``) holds a lone UTF-16 surrogate (``"\\ud800"``), for
    a body the router itself re-encodes (the Responses API's): the model server refuses it the same way
    (:func:`modelserver.surrogates.lone_surrogate`), but the router's own encoding failed first, with a 500."""
    if (message := lone_surrogate(body, data)) is not None:
        raise BadRequest(message)


def json_or_none(body: bytes) -> Any:
    """``body`` parsed within the same bounds, or None where :func:`parse_json` would refuse it (for a
    look inside a body that is passed on whatever it holds: ``/upstream``, resume planning)."""
    try:
        return parse_json(body, "")
    except BadRequest:
        return None


def model_of(body: bytes, content_type: str, known: Iterable[str], implied: str | None = None) -> RoutedBody:
    """The ``model`` of a JSON body or of a multipart form (``implied`` when a JSON body names none);
    400 naming what is wrong otherwise."""
    mime, params = parse_options_header(content_type)
    if mime == b"multipart/form-data":
        return RoutedBody(_form_model(body, params.get(b"boundary"), known), stream=False)
    hint = "send a JSON object with a `model` field"
    if mime == b"application/x-www-form-urlencoded":  # curl -d sends JSON under this type too: read as JSON first
        hint += " (a form is read only as multipart/form-data: the audio routes' `file` and `model`, curl -F)"
    data = parse_json(body, hint)
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object with a `model` field")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        names = ", ".join(sorted(known))
        raise BadRequest(f"`model` must be a string, got {json.dumps(model)[:80]}: name one of {names}", param="model")
    if not model and implied is not None and "model" not in data:
        model = implied
    if not model:
        raise BadRequest(_missing_model(known), param="model")
    return RoutedBody(model, stream=data.get("stream") is True)


def _missing_model(known: Iterable[str]) -> str:
    return f"`model` is required: name one of {', '.join(sorted(known))}"


def _form_model(body: bytes, boundary: bytes | None, known: Iterable[str]) -> str:
    if not boundary:
        raise BadRequest("multipart body without a boundary in its Content-Type")
    fields: dict[str, bytes] = {}
    state: dict[str, Any] = {"name": None, "header": b"", "value": b"", "headers": {}}

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state["header"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state["headers"][state["header"].lower()] = state["headers"].get(state["header"].lower(), b"") + data[start:end]

    def on_header_end() -> None:
        state["header"] = b""

    def on_headers_finished() -> None:
        _, params = parse_options_header(state["headers"].get(b"content-disposition", b""))
        state["name"] = params.get(b"name", b"").decode("utf-8", "replace")
        state["value"] = b""

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if state["name"] == "model" and len(state["value"]) < 1024:
            state["value"] += data[start:end]

    def on_part_end() -> None:
        if state["name"] == "model":
            fields["model"] = state["value"]
        state["headers"] = {}

    parser = MultipartParser(
        boundary,
        {
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    try:
        parser.write(body)
        parser.finalize()
    except Exception as exc:
        raise BadRequest(f"malformed multipart body ({exc})") from None
    model = fields.get("model", b"").decode("utf-8", "replace").strip()
    if not model:
        raise BadRequest(_missing_model(known) + " (as a form field)", param="model")
    return model
