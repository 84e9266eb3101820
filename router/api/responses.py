"""What the router knows of the Responses API: stored conversations, ids, and the stream's framing.

The model server translates ``POST /v1/responses`` (``modelserver/api/responses.py``); the
router adds what must outlive a model process:

- **state**: :func:`prepare` gives each request its response id (header
  ``x-ovrouter-response-id``; the model server names the response and its items after it) and
  puts a ``previous_response_id``'s stored conversation (its input and output items) in front
  of the new input; an unknown, expired or deleted id is a 400 naming it. A finished response
  (``store`` not false) is kept in the :class:`~router.api.responses_store.ResponseStore`;
  ``GET``/``DELETE /v1/responses/{id}`` read and drop it.
- **framing**: :class:`ResponsesStream` is the ``send`` of one ``/v1/responses`` exchange,
  between everything the router writes and the client. It passes a JSON body through (and
  stores it), and rewrites a stream event by event so the client always sees one well-formed
  Responses stream whatever happened underneath: ``sequence_number`` counted by the router;
  the ``response.created`` / ``response.in_progress`` the cold-start feedback sent at once not
  repeated by the model server, nor the item openings a resumed stream repeats (usage then
  counts the tokens sent before the cut as output); the router's own error events (a failed
  start, a cut it could not resume) as ``response.failed``; a stream that ends without a
  terminal event ended with ``response.failed``; nothing after the one terminal event.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Send

from router.api.responses_items import page, with_ids
from router.api.responses_store import ResponseStore
from router.edge.body import check_text, parse_json
from router.edge.errors import BadRequest, NotFound

if TYPE_CHECKING:
    from router.service import RouterService

__all__ = ["ID_HEADER", "INPUT_TOKENS_PATH", "PREVIOUS_HEADER", "RESPONSES_PATH", "Prepared", "ResponsesStream",
           "headers_for", "opening", "prepare"]

log = logging.getLogger(__name__)

RESPONSES_PATH = "/v1/responses"
INPUT_TOKENS_PATH = "/v1/responses/input_tokens"
ID_HEADER = "x-ovrouter-response-id"
PREVIOUS_HEADER = "x-ovrouter-previous-response-id"
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
_LIFECYCLE = ("response.created", "response.in_progress")
_OPENINGS = ("response.output_item.added", "response.content_part.added")


@dataclass(slots=True)
class Prepared:
    """One request after :func:`prepare`: the body to send, its whole input, and what to do with the answer."""

    body: bytes
    response_id: str
    model: str
    input_items: list[dict[str, Any]]
    store: bool = True
    previous: str | None = None
    stream: bool = False
    settings: dict[str, Any] = field(default_factory=dict)  # what the cold-start opening echoes of the request


def prepare(body: bytes, store: ResponseStore) -> Prepared:
    """The body with a previous response's conversation in front of its input (400 for an unknown id)."""
    data = parse_json(body, "the Responses API takes a JSON object with `model` and `input`")  # not a form
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object with `model` and `input`")
    check_text(body, data)  # re-encoded below, echoed in the stream's opening, stored
    previous = data.pop("previous_response_id", None)
    items = _items(data.get("input"))
    if previous is not None:
        stored = store.get(str(previous)) if isinstance(previous, str) else None
        if stored is None:
            raise BadRequest(f"previous_response_id: no stored response {str(previous)[:100]!r} (unknown, expired, "
                             "deleted, or created with store: false, or before the router restarted); send the "
                             "whole conversation as input instead", param="previous_response_id")
        items = [*stored.conversation, *items]
        data["input"] = items
        body = json.dumps(data, ensure_ascii=False).encode()
    settings = {key: data[key] for key in _ECHOED if data.get(key) is not None}
    return Prepared(body, "resp_" + uuid.uuid4().hex, str(data.get("model")), items, data.get("store") is not False,
                    previous, data.get("stream") is True, settings)


def headers_for(prepared: Prepared) -> list[tuple[str, str]]:
    """What the model server is told: the response's id, and the previous one it continues."""
    headers = [(ID_HEADER, prepared.response_id)]
    if prepared.previous is not None:
        headers.append((PREVIOUS_HEADER, prepared.previous))
    return headers


def _items(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


#: The request's settings a response object echoes (OpenAI's spec requires most of them in every response).
_ECHOED = ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls", "temperature", "text",
           "tool_choice", "tools", "top_p", "truncation")


def opening(prepared: Prepared) -> bytes:
    """``response.created`` + ``response.in_progress`` of a response not started yet (cold-start feedback):
    the object the model server sends at its start, as far as the request tells it (no ``usage`` yet: the
    spec's ``usage`` is an object, so it is left out rather than null)."""
    echoed = {"instructions": None, "max_output_tokens": None, "metadata": {}, "parallel_tool_calls": True,
              "temperature": None, "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
              "top_p": None, "truncation": "disabled", **prepared.settings}
    echoed["tools"] = echoed_tools(echoed["tools"]) if isinstance(echoed["tools"], list) else []
    response = {"id": prepared.response_id, "object": "response", "created_at": int(time.time()),
                "status": "in_progress", "error": None, "incomplete_details": None, "model": prepared.model,
                "output": [], "previous_response_id": prepared.previous, "store": prepared.store, **echoed}
    return b"".join(_event({"type": kind, "sequence_number": n, "response": response})
                    for n, kind in enumerate(_LIFECYCLE))


def echoed_tools(tools: list[Any]) -> list[Any]:
    """The request's tools as a response lists them: a function tool always says ``strict`` (the spec
    requires it; OpenAI's default is true)."""
    return [{**tool, "strict": tool.get("strict", True)} if isinstance(tool, dict) and tool.get("type") == "function"
            else tool for tool in tools]


def _event(data: dict[str, Any]) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


@dataclass(slots=True)
class ResponsesStream:
    """The client-side ``send`` of one ``POST /v1/responses`` (see the module docstring)."""

    send: Send
    store: ResponseStore
    prepared: Prepared | None = None
    _sse: bool = False
    _ok: bool = False
    _buffer: bytes = b""
    _seq: int = 0
    _seen: set[tuple[Any, ...]] = field(default_factory=set)
    _terminal: bool = False
    _response: dict[str, Any] | None = None
    _items: dict[int, dict[str, Any]] = field(default_factory=dict)
    _deltas: int = 0
    _resumed_after: int | None = None  # text deltas sent before a resumed stream's second opening

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._ok = message["status"] == 200
            headers = dict(message.get("headers") or [])
            self._sse = (headers.get(b"content-type") or b"").startswith(b"text/event-stream")
            await self.send(message)
            return
        if message["type"] != "http.response.body" or not self._ok:
            await self.send(message)
            return
        more = message.get("more_body", False)
        if not self._sse:
            if self.prepared is not None and self.prepared.store:
                self._buffer += message.get("body", b"")
            await self.send(message)
            if not more:
                self._record_body()
            return
        out = self._rewrite(message.get("body", b""))
        if not more and not self._terminal:
            out += self._failed("the model server ended the stream without finishing the response", "backend_error")
        if out or not more:
            await self.send({"type": "http.response.body", "body": out, "more_body": more})

    def _rewrite(self, chunk: bytes) -> bytes:
        data = (self._buffer + chunk).replace(b"\r\n", b"\n")
        end = data.rfind(b"\n\n")
        if end < 0:
            self._buffer = data
            return b""
        whole, self._buffer = data[: end + 2], data[end + 2 :]
        return b"".join(self._one(block) for block in whole.split(b"\n\n") if block.strip())

    def _one(self, block: bytes) -> bytes:
        lines = block.split(b"\n")
        payload = b"\n".join(line[5:].strip() for line in lines if line.startswith(b"data:"))
        if not payload:
            return block + b"\n\n" if not self._terminal else b""  # a comment (loading ticks)
        if payload == b"[DONE]" or self._terminal:
            return b""
        try:
            event = json.loads(payload)
        except ValueError:
            return b""
        if "type" not in event and isinstance(event.get("error"), dict):  # the router's own error event
            error = event["error"]
            return self._failed(str(error.get("message")), str(error.get("code") or "backend_error"))
        return self._typed(event)

    def _typed(self, event: dict[str, Any]) -> bytes:
        kind = event.get("type")
        key = self._key(event)
        if key is not None:
            if key in self._seen:
                if kind == "response.created" and self._resumed_after is None and self._items_started():
                    self._resumed_after = self._deltas
                return b""  # already sent: a lifecycle event the feedback sent, or a resumed item's opening
            self._seen.add(key)
        if kind == "response.output_text.delta":
            self._deltas += 1
        elif kind == "response.output_item.done" and isinstance(event.get("item"), dict):
            self._items[int(event.get("output_index", len(self._items)))] = event["item"]
        if isinstance(event.get("response"), dict):
            event["response"] = self._lifecycle(event["response"], kind in TERMINAL)
        event["sequence_number"] = self._seq
        self._seq += 1
        if kind in TERMINAL:
            self._terminal = True
            if kind != "response.failed":
                self._record(event["response"])
        return _event(event)

    @staticmethod
    def _key(event: dict[str, Any]) -> tuple[Any, ...] | None:
        kind = event.get("type")
        if kind in _LIFECYCLE:
            return (kind,)
        if kind in _OPENINGS:
            return kind, event.get("output_index"), event.get("content_index")
        return None

    def _items_started(self) -> bool:
        return any(key[0] in _OPENINGS for key in self._seen)

    def _lifecycle(self, response: dict[str, Any], terminal: bool) -> dict[str, Any]:
        if self.prepared is not None:
            response["previous_response_id"] = self.prepared.previous
        if terminal and self._resumed_after and isinstance(usage := response.get("usage"), dict):
            moved = self._resumed_after  # the continuation's prompt held the text sent before the cut
            usage["output_tokens"] = int(usage.get("output_tokens", 0)) + moved
            usage["input_tokens"] = max(int(usage.get("input_tokens", 0)) - moved, 0)
        self._response = response
        return response

    def _failed(self, message: str, code: str) -> bytes:
        """``response.failed`` carrying the router's reason (once; nothing follows it)."""
        if self._terminal:
            return b""
        self._terminal = True
        response = dict(self._response or {"id": self.prepared.response_id if self.prepared else None,
                                           "object": "response", "created_at": int(time.time())})
        response.update(status="failed", error={"code": code, "message": message},
                        output=[self._items[i] for i in sorted(self._items)])
        event = {"type": "response.failed", "sequence_number": self._seq, "response": response}
        self._seq += 1
        log.info("responses: %s failed: %s", response.get("id"), message)
        return _event(event)

    def _record_body(self) -> None:
        body, self._buffer = self._buffer, b""
        if self.prepared is None or not self.prepared.store:
            return
        try:
            response = json.loads(body)
        except ValueError:
            return
        if isinstance(response, dict) and response.get("object") == "response":
            self._record(response)

    def _record(self, response: dict[str, Any]) -> None:
        prepared = self.prepared
        if prepared is None or not prepared.store or not isinstance(response.get("output"), list):
            return
        inputs = with_ids(prepared.input_items, prepared.response_id)
        if not self.store.put(response, [*inputs, *response["output"]]):
            log.info("responses: %s not stored (over responses_store_mb or responses_store_max 0)", response.get("id"))


def stored_response_routes(service: RouterService) -> list[Route]:
    """``GET`` / ``DELETE /v1/responses/{id}`` (and ``GET .../input_items``, ``POST .../cancel``) on the router's
    store."""
    from router.service import check_key, credential_of

    def stored(request: Request) -> tuple[str, Any]:
        check_key(credential_of(request.headers), service.config.router.api_keys, "api_keys")
        rid = request.path_params["id"]
        entry = service.responses.get(rid)
        if entry is None:
            raise NotFound(f"no stored response {rid[:100]!r} (unknown, expired, deleted, or created with "
                           "store: false)", param="response_id")
        return rid, entry

    async def get(request: Request) -> Response:
        return JSONResponse(stored(request)[1].response)

    async def delete(request: Request) -> Response:
        rid, _ = stored(request)
        service.responses.delete(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    async def input_items(request: Request) -> Response:
        _, entry = stored(request)
        count = len(entry.conversation) - len(entry.response.get("output") or [])
        return JSONResponse(page(list(entry.conversation[:count]), dict(request.query_params)))

    async def cancel(request: Request) -> Response:
        stored(request)  # an unknown id is a 404 as for GET
        raise BadRequest("cannot cancel a synchronous response: every response here runs to its end before it is "
                         "answered (background mode is not served); close a stream to stop it", param="response_id")

    return [Route(RESPONSES_PATH + "/{id}", get, methods=["GET"]),
            Route(RESPONSES_PATH + "/{id}", delete, methods=["DELETE"]),
            Route(RESPONSES_PATH + "/{id}/input_items", input_items, methods=["GET"]),
            Route(RESPONSES_PATH + "/{id}/cancel", cancel, methods=["POST"])]
